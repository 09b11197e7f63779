"""A run directory, shared by SFT and RL: where checkpoints and exported weights go, and resume.

  <run_dir>/checkpoints/step_<n>/   crash-safe checkpoints (rollouts.backends)
  <run_dir>/weights/                the newest exported weights, read by engines at each sync
  <run_dir>/metrics_<stage>.jsonl   one record per logged step
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from rollouts.backends import TrainingComponents, has_optimizer_state, latest_checkpoint, load_checkpoint
from rollouts.types import TrainingState

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_DIR = "weights"


def resume_if_possible(
    components: TrainingComponents, run_dir: str | Path | None, *, resume: bool
) -> tuple[TrainingState, dict[str, Any], Path | None]:
    """(state, extra, checkpoint path) from the newest complete checkpoint under run_dir, or a fresh state."""
    if run_dir is None or not resume:
        return TrainingState(), {}, None
    path = latest_checkpoint(Path(run_dir) / CHECKPOINTS_DIR)
    if path is None:
        return TrainingState(), {}, None
    saved_optimizer = has_optimizer_state(path)
    if not saved_optimizer:
        warnings.warn(f"{path} holds no optimizer state (save_optimizer=False): resuming with fresh optimizer "
                      "moments, so the run does not continue exactly as it would have", stacklevel=2)
    state, extra = load_checkpoint(components, path, load_optimizer=saved_optimizer)
    return state, extra, path
