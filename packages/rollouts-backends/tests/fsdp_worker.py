"""Run under `torchrun --nproc_per_node 2`: FSDP2 training, checkpoint and resume on CPU with gloo.

Writes to OUT_DIR (rank 0): losses.json (global loss per step), final/ (exported weights after
3 straight steps), ckpt/step_1/ and ckpt/step_2/ (checkpoints with one optimizer shard file per
rank; step 1 saved with wait=False) and
resumed/ (weights after reloading step 2 into a fresh sharded model and running step 3 again).
The reload must take the same-layout path: each rank reads only its own shard file.

The model is float64 so that the comparison with one process can be tight (see test_fsdp.py). With a
second argument `missing-world-scale` each rank normalises its loss by its own token count instead of the
step-wide one: the gradient is world_size times too large, a bug the comparison must catch.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from helpers import TRAIN_CONFIG_KW, packed_batch, tiny_model

import rollouts.backends.checkpoint.optimizer_state as optimizer_state
from rollouts.backends import (
    CheckpointWriter,
    build_components,
    export_weights,
    forward_backward,
    load_checkpoint,
    optim_step,
    save_checkpoint,
    shard_model,
)
from rollouts.backends.train.distributed import close_process_group
from rollouts.losses import sft_loss_fn
from rollouts.types import OptimizerConfig, TrainingState

GLOBAL_SEQUENCES = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16, 17, 18], [19, 20, 21, 22, 23, 24]]
NUM_STEPS = 3


DTYPE = torch.float64


def sharded_components():
    model = shard_model(tiny_model(seed=0, dtype=DTYPE))
    return build_components(model, OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=NUM_STEPS)


def step(components, state, rank, world, *, bug=False):
    mine = packed_batch(GLOBAL_SEQUENCES[rank::world])
    num_tokens = int(sum((packed_batch([s]).loss_mask > 0).sum() for s in GLOBAL_SEQUENCES))
    normaliser = int((mine.loss_mask > 0).sum()) if bug else num_tokens
    metrics = forward_backward(
        components, [mine], sft_loss_fn(), num_tokens=normaliser, num_sequences=len(GLOBAL_SEQUENCES)
    )
    loss = torch.tensor(metrics["loss"], dtype=torch.float64)
    dist.all_reduce(loss)
    state, optim_metrics = optim_step(
        components, state, OptimizerConfig(**TRAIN_CONFIG_KW), num_tokens=num_tokens, num_samples=4
    )
    return state, float(loss), optim_metrics["grad_norm"]


def main(out: Path, bug: bool) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    components = sharded_components()
    state, losses, grad_norms = TrainingState(), [], []
    writer = CheckpointWriter()
    for i in range(NUM_STEPS):
        state, loss, grad_norm = step(components, state, rank, world, bug=bug)
        losses.append(loss)
        grad_norms.append(grad_norm)
        if i <= 1:  # step 1 published in the background (step 2's save waits for it), step 2 at once
            save_checkpoint(components, state, out / "ckpt", writer=writer if i == 0 else None)
    writer.close()
    export_weights(components, out / "final")

    def refuse_join(files):
        raise AssertionError(f"same world size and layout, yet the shards were joined: {files}")

    optimizer_state.join_shards = refuse_join
    resumed = sharded_components()
    state, _ = load_checkpoint(resumed, out / "ckpt" / "step_2")
    state, _, _ = step(resumed, state, rank, world, bug=bug)
    export_weights(resumed, out / "resumed")
    if rank == 0:
        record = {"losses": losses, "grad_norms": grad_norms, "resumed_step": state.step}
        (out / "losses.json").write_text(json.dumps(record))
    close_process_group()  # monitored barrier, then destroy: no rank leaves under a peer's send


if __name__ == "__main__":
    main(Path(sys.argv[1]), bug=sys.argv[2:] == ["missing-world-scale"])
