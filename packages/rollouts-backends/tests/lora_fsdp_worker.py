"""Run under `torchrun --nproc_per_node 2`: LoRA training under FSDP2 on CPU with gloo.

Writes to OUT_DIR (rank 0): lora.json (global loss and gradient norm per step, and the reference
log-probs with the adapter disabled after training) and adapter.safetensors (the trained adapter,
gathered), resumed.safetensors (the adapter after saving a checkpoint with sharded optimizer state and
loading it into a fresh sharded LoRA model). float64, so the comparison with one process can be tight
(see test_fsdp.py).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from fsdp_worker import GLOBAL_SEQUENCES, NUM_STEPS, step
from helpers import TRAIN_CONFIG_KW, packed_batch, tiny_model
from safetensors.torch import save_file

from rollouts.backends import build_components, compute_logprobs, load_checkpoint, save_checkpoint, shard_model
from rollouts.backends.train.distributed import close_process_group
from rollouts.backends.train.lora import adapter_state_dict, apply_lora, reference_components
from rollouts.types import LoraConfig, OptimizerConfig, TrainingState

LORA = LoraConfig(rank=4, alpha=8.0)


def sharded_lora_components():
    model = shard_model(apply_lora(tiny_model(seed=0, dtype=torch.float64), LORA))
    return build_components(model, OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=NUM_STEPS)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    components = sharded_lora_components()
    state, losses, grad_norms = TrainingState(), [], []
    for _ in range(NUM_STEPS):
        state, loss, grad_norm = step(components, state, rank, world)
        losses.append(loss)
        grad_norms.append(grad_norm)
    ref = compute_logprobs(reference_components(components), [packed_batch(GLOBAL_SEQUENCES)])[0]
    adapter = adapter_state_dict(components.model)
    save_checkpoint(components, state, out / "ckpt")
    resumed = sharded_lora_components()
    load_checkpoint(resumed, out / "ckpt" / f"step_{NUM_STEPS}")
    reloaded = adapter_state_dict(resumed.model)
    if rank == 0:
        save_file(adapter, str(out / "adapter.safetensors"))
        save_file(reloaded, str(out / "resumed.safetensors"))
        record = {"losses": losses, "grad_norms": grad_norms, "reference": ref.tolist()}
        (out / "lora.json").write_text(json.dumps(record))
    close_process_group()  # monitored barrier, then destroy: no rank leaves under a peer's send


if __name__ == "__main__":
    main(Path(sys.argv[1]))
