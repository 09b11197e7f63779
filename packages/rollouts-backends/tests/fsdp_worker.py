"""Run under `torchrun --nproc_per_node 2`: FSDP2 training, checkpoint and resume on CPU with gloo.

Writes to OUT_DIR (rank 0): losses.json (global loss per step), final/ (exported weights after
3 straight steps), ckpt/step_1/ and ckpt/step_2/ (checkpoints with one optimizer shard file per
rank; step 1 saved with wait=False) and
resumed/ (weights after reloading step 2 into a fresh sharded model and running step 3 again).
The reload must take the same-layout path: each rank reads only its own shard file.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import rollouts.backends.checkpoint as checkpoint_module
import torch
import torch.distributed as dist
from helpers import TRAIN_CONFIG_KW, packed_batch, tiny_model
from rollouts.backends import (
    build_components,
    export_weights,
    forward_backward,
    load_checkpoint,
    optim_step,
    save_checkpoint,
    shard_model,
)
from rollouts.losses import sft_loss_fn
from rollouts.types import OptimizerConfig, TrainingState

GLOBAL_SEQUENCES = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16, 17, 18], [19, 20, 21, 22, 23, 24]]
NUM_STEPS = 3


def sharded_components():
    model = shard_model(tiny_model(seed=0))
    return build_components(model, OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=NUM_STEPS)


def step(components, state, rank, world):
    mine = packed_batch(GLOBAL_SEQUENCES[rank::world])
    num_tokens = int(sum((packed_batch([s])["loss_mask"] > 0).sum() for s in GLOBAL_SEQUENCES))
    metrics = forward_backward(components, [mine], sft_loss_fn(), num_tokens=num_tokens, num_sequences=len(GLOBAL_SEQUENCES))
    loss = torch.tensor(metrics["loss"])
    dist.all_reduce(loss)
    state, _ = optim_step(components, state, OptimizerConfig(**TRAIN_CONFIG_KW), num_tokens=num_tokens, num_samples=4)
    return state, float(loss)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    components = sharded_components()
    state, losses = TrainingState(), []
    for i in range(NUM_STEPS):
        state, loss = step(components, state, rank, world)
        losses.append(loss)
        if i <= 1:  # step 1 published in the background (step 2's save waits for it), step 2 at once
            save_checkpoint(components, state, out / "ckpt", wait=i == 1)
    export_weights(components, out / "final")

    def refuse_join(files):
        raise AssertionError(f"same world size and layout, yet the shards were joined: {files}")

    checkpoint_module._join_shards = refuse_join
    resumed = sharded_components()
    state, _ = load_checkpoint(resumed, out / "ckpt" / "step_2")
    state, _ = step(resumed, state, rank, world)
    export_weights(resumed, out / "resumed")
    if rank == 0:
        (out / "losses.json").write_text(json.dumps({"losses": losses, "resumed_step": state.step}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
