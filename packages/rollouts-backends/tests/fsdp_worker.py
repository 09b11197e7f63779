"""Run under `torchrun --nproc_per_node 2`: FSDP2 training, checkpoint and resume on CPU with gloo.

Writes to OUT_DIR (rank 0): losses.json (global loss per step), final/ (exported weights after
3 straight steps), ckpt/step_1/ and ckpt/step_2/ (checkpoints with one optimizer shard file per
rank; step 1 saved with wait=False) and
resumed/ (weights after reloading step 2 into a fresh sharded model and running step 3 again).
The reload must take the same-layout path: each rank reads only its own shard file. Then the same 3
steps with each rank's sequences in micro-batches of one, sharded per micro-batch and with
`gather_once_per_step`: gathered.json (losses, gradient norms, and the FSDP collectives of each
step, counted where torch.distributed runs them, for both) and gathered/ (the latter's weights).

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


_COLLECTIVES = {
    "all_gather": ("all_gather_into_tensor", "all_gather_single"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single"),
}


def count_collectives() -> dict[str, int]:
    """Count FSDP2's collectives from now on (it calls them as torch.distributed.<name>)."""
    counts = dict.fromkeys(_COLLECTIVES, 0)
    for kind, names in _COLLECTIVES.items():
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counted(*args, _kind=kind, _original=original, **kwargs):
                counts[_kind] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
    return counts


def micro_batch_run(rank, world, *, gather_once, counts):
    """The 3 steps with this rank's sequences one per micro-batch: (losses, grad norms, collectives
    per step, components)."""
    model = shard_model(tiny_model(seed=0, dtype=DTYPE), gather_once_per_step=gather_once)
    components = build_components(model, OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=NUM_STEPS)
    mine = [packed_batch([s]) for s in GLOBAL_SEQUENCES[rank::world]]
    num_tokens = int(sum((packed_batch([s]).loss_mask > 0).sum() for s in GLOBAL_SEQUENCES))
    state, losses, grad_norms, per_step = TrainingState(), [], [], []
    for _ in range(NUM_STEPS):
        before = dict(counts)
        metrics = forward_backward(
            components, mine, sft_loss_fn(), num_tokens=num_tokens, num_sequences=len(GLOBAL_SEQUENCES)
        )
        per_step.append({k: counts[k] - before[k] for k in counts})
        loss = torch.tensor(metrics["loss"], dtype=torch.float64)
        dist.all_reduce(loss)
        state, optim_metrics = optim_step(
            components, state, OptimizerConfig(**TRAIN_CONFIG_KW), num_tokens=num_tokens, num_samples=4
        )
        losses.append(float(loss))
        grad_norms.append(optim_metrics["grad_norm"])
    return losses, grad_norms, per_step, components


def failed_step_leaves_no_gradient(components, rank, world):
    """A gathered step that fails at its second micro-batch, then the same step whole: its squared
    gradient norm, that of the step whole on a clean model, and whether every weight was a shard again."""
    mine = [packed_batch([s]) for s in GLOBAL_SEQUENCES[rank::world]]
    counts = {"num_tokens": 20, "num_sequences": len(GLOBAL_SEQUENCES)}
    seen = []

    def fails_second(logprobs, batch, **kwargs):
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("injected")
        return sft_loss_fn()(logprobs, batch, **kwargs)

    def squared_norm():
        return float(
            sum(p.grad.full_tensor().pow(2).sum() for p in components.model.parameters() if p.grad is not None)
        )

    components.optimizer.zero_grad(set_to_none=True)
    try:
        forward_backward(components, mine, fails_second, **counts)
    except RuntimeError:
        pass
    sharded = all(isinstance(p, torch.distributed.tensor.DTensor) for p in components.model.parameters())
    forward_backward(components, mine, sft_loss_fn(), **counts)
    after = squared_norm()
    components.optimizer.zero_grad(set_to_none=True)
    forward_backward(components, mine, sft_loss_fn(), **counts)
    return {"after_failure": after, "clean": squared_norm(), "sharded": sharded}


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
    if not bug:
        counts = count_collectives()
        runs = {}
        for gather_once in (False, True):
            run_losses, run_norms, per_step, run = micro_batch_run(rank, world, gather_once=gather_once, counts=counts)
            runs[str(gather_once)] = {"losses": run_losses, "grad_norms": run_norms, "collectives": per_step}
        export_weights(run, out / "gathered")
        runs["after_failure"] = failed_step_leaves_no_gradient(run, rank, world)
        if rank == 0:
            (out / "gathered.json").write_text(json.dumps(runs))
    close_process_group()  # monitored barrier, then destroy: no rank leaves under a peer's send


if __name__ == "__main__":
    main(Path(sys.argv[1]), bug=sys.argv[2:] == ["missing-world-scale"])
