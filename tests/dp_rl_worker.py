"""Run under `torchrun --nproc_per_node 2`: rl_update on each rank's share, for the settings in
dp_rl_cases.CASES. Writes OUT_DIR/<case>/ (exported weights) and OUT_DIR/metrics.json (rank 0)."""

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from dp_rl_cases import CASES, NUM_STEPS, batch, components, config, critic

from rollouts.backends import export_weights
from rollouts.loops.distributed import close_distributed
from rollouts.loops.policy_update import rl_update
from rollouts.types import TrainingState


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
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
    if dist.get_rank() == 0:
        (out / "metrics.json").write_text(json.dumps(metrics))
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
