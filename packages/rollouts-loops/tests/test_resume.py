"""resume_if_possible: the newest complete checkpoint, with or without optimizer state."""

from __future__ import annotations

import pytest

from rollouts.backends import build_components, save_checkpoint
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.run.run_dir import CHECKPOINTS_DIR, resume_if_possible
from rollouts.types import OptimizerConfig, TrainingState


def _components():
    model = build_tiny_model(
        16, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=32
    )
    return build_components(model, OptimizerConfig(), num_training_steps=10)


@pytest.mark.parametrize("save_optimizer", [True, False])
def test_a_run_resumes_whether_or_not_it_saved_optimizer_state(tmp_path, save_optimizer, recwarn):
    assert resume_if_possible(_components(), tmp_path, resume=True)[0] == TrainingState()
    save_checkpoint(
        _components(), TrainingState(step=3), tmp_path / CHECKPOINTS_DIR, extra={"k": 1}, save_optimizer=save_optimizer
    )
    state, extra, path = resume_if_possible(_components(), tmp_path, resume=True)
    assert state.step == 3 and extra == {"k": 1} and path.name == "step_3"
    warned = [str(w.message) for w in recwarn if "fresh optimizer moments" in str(w.message)]
    assert len(warned) == (0 if save_optimizer else 1)
    assert resume_if_possible(_components(), tmp_path, resume=False)[0] == TrainingState()
