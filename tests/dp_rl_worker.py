"""Run under `torchrun --nproc_per_node 2`: rl_update on each rank's share, for the settings in
dp_rl_cases.CASES and with dp_rl_cases.distillation. Writes OUT_DIR/<case>/ (exported weights) and OUT_DIR/metrics.json (rank 0)."""

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from dp_rl_cases import (
    CASES,
    DISTILL_CASES,
    DISTILL_METRICS,
    NUM_STEPS,
    batch,
    components,
    config,
    critic,
    distillation,
)

from rollouts.backends import export_weights
from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.rl.step import rl_update
from rollouts.loops.run.distributed import broadcast_bytes, broadcast_json, broadcast_tagged, close_distributed
from rollouts.types import RolloutBatch, TrainingState
from rollouts.types.wire import batch_from_bytes, batch_to_bytes, batch_to_parts


def check_broadcasts(out: Path) -> None:
    """Rank 0's batch (as wire parts, behind a tag), bytes and JSON reach rank 1 unchanged; each
    rank writes what it holds for the test to compare."""
    rank = dist.get_rank()
    sent = RolloutBatch(samples=tuple(s.with_reward(float(i)) for i, s in enumerate(batch())), step=3)
    tag, data = broadcast_tagged(b"B", *batch_to_parts(sent)) if rank == 0 else broadcast_tagged()
    assert tag == b"B" and data.readonly
    got = batch_from_bytes(data) if rank else sent
    empty_tag, empty = broadcast_tagged(b"E") if rank == 0 else broadcast_tagged()
    held = {
        "batch": batch_to_bytes(got).hex(),
        "equal": got == sent,
        "empty": [empty_tag.decode(), bytes(empty).hex()],
        "bytes": broadcast_bytes(b"\x00abc" if rank == 0 else b"").hex(),
        "json": broadcast_json({"a": [1, 2.5, None]} if rank == 0 else None),
    }
    (out / f"broadcast_rank{rank}.json").write_text(json.dumps(held))


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    check_broadcasts(out)
    metrics = {}
    for name, algorithm in CASES.items():
        trained, ref = components(sharded=True)
        value = critic(sharded=True) if algorithm.advantage_estimator == "gae" else None
        state = TrainingState()
        for _ in range(NUM_STEPS):
            state, step_metrics = rl_update(
                trained, state, batch(), config(algorithm), ref_components=ref, critic=value
            )
        metrics[name] = {k: step_metrics[k] for k in ("loss", "kl_reward", "vf_loss") if k in step_metrics}
        export_weights(trained, out / name)
        if value is not None:
            export_weights(value, out / f"{name}_critic")
    for name, options in DISTILL_CASES.items():
        trained, _ = components(sharded=True)
        distill, state = distillation(sharded=True, **options), TrainingState()
        for _ in range(NUM_STEPS):
            state, step_metrics = rl_update(trained, state, batch(), config(ALGORITHMS["grpo"]), distill=distill)
        metrics[name] = {k: step_metrics[k] for k in ("loss", *DISTILL_METRICS) if k in step_metrics}
        export_weights(trained, out / name)
    if dist.get_rank() == 0:
        (out / "metrics.json").write_text(json.dumps(metrics))
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
