"""The RL run's saved state as parts: each part's state round-trips through a checkpoint, and a
checkpoint holding the batch generated ahead flat (samples and counts under two keys) loads as the
same part."""

from __future__ import annotations

import functools

import trio

from rollouts.backends import CheckpointWriter, build_components, save_checkpoint
from rollouts.data import DataBuffer
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.models import RLModels
from rollouts.loops.rl.state import KLController, PendingBatch, ReferenceAverage, RunFiles, restore, run_parts
from rollouts.loops.run.run_dir import CHECKPOINTS_DIR, parts_state
from rollouts.types import AlgorithmConfig, OptimizerConfig, RLConfig, RolloutBatch, Sample, TrainingState


def _models() -> RLModels:
    model = build_tiny_model(
        16, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=32
    )
    policy = build_components(model, OptimizerConfig(), num_training_steps=10)
    return RLModels(policy=policy, engine=None, engine_shares_model=True)  # a resume syncs nothing


def _batch() -> RolloutBatch:
    samples = [
        Sample(
            tokens=(1, 2, 3),
            num_prompt_tokens=2,
            loss_mask=(0.0, 0.0, 1.0),
            reward=1.0,
            weight_version=1,
            group_index=0,
        )
    ]
    return RolloutBatch(samples=samples, step=1, metadata={"groups_requested": 3, "not_shared": "x"})


def _restore(tmp_path, extra: dict, config: RLConfig) -> tuple[TrainingState, PendingBatch, KLController, DataBuffer]:
    save_checkpoint(_models().policy, TrainingState(step=1, weight_version=1), tmp_path / CHECKPOINTS_DIR, extra=extra)
    buffer, pending, kl = DataBuffer(list(range(10)), seed=0), PendingBatch(), KLController(config)
    parts = run_parts(buffer, None, pending, kl)
    parts["buffer"] = buffer  # as rank 0 holds it
    with CheckpointWriter() as writer:
        files = RunFiles(run_dir=tmp_path, writer=writer)
        average = ReferenceAverage(None, config.reference)  # no reference: nothing to average
        run = functools.partial(restore, resume=True, resume_from=None, lock=trio.Lock(), average=average)
        state = trio.run(run, _models(), parts, config, files)
    return state, pending, kl, buffer


def test_the_parts_of_a_run_come_back_from_its_checkpoint(tmp_path):
    config = RLConfig(algorithm=AlgorithmConfig(kl_coef=0.1, kl_placement="loss", kl_target=0.05))
    buffer, pending, kl = DataBuffer(list(range(10)), seed=0), PendingBatch(), KLController(config)
    buffer.get_prompts(3)
    pending.batch = _batch()
    kl.observe(config, {"kl": 0.5})
    parts = {**run_parts(buffer, None, pending, kl), "buffer": buffer}
    state, restored, restored_kl, restored_buffer = _restore(tmp_path, parts_state(parts), config)
    assert state.step == 1 and restored_kl.state == kl.state != KLController(config).state
    assert restored_buffer.state_dict() == buffer.state_dict()
    assert restored.batch is not None and list(restored.batch.samples) == list(_batch().samples)
    assert restored.batch.metadata == {"groups_requested": 3}  # what every rank receives


def test_a_checkpoint_holding_the_batch_ahead_flat_resumes_with_it(tmp_path):
    batch = _batch()
    extra = {
        "pending_batch": [s.to_dict() for s in batch.samples],
        "pending_batch_metadata": {"groups_requested": 3},
    }
    _, pending, _, _ = _restore(tmp_path, extra, RLConfig())
    assert pending.batch is not None and list(pending.batch.samples) == list(batch.samples)
    assert pending.batch.metadata == {"groups_requested": 3} and pending.batch.step == 1


class _KeptServer:
    """A server kept up from another run: it reports the version it was last synced to."""

    name = "http://127.0.0.1:9"

    def __init__(self, version):
        self.version, self.loads = version, []

    async def weight_version(self):
        return self.version

    async def update_weights_from_disk(self, path, weight_version):
        self.loads.append(weight_version)
        self.version = weight_version


def _fresh_start(tmp_path, engine) -> TrainingState:
    model = build_tiny_model(
        16, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=32
    )
    models = RLModels(policy=build_components(model, OptimizerConfig(), num_training_steps=10), engine=engine)
    config = RLConfig()
    buffer, pending, kl = DataBuffer(list(range(10)), seed=0), PendingBatch(), KLController(config)
    with CheckpointWriter() as writer:
        files = RunFiles(run_dir=tmp_path, writer=writer)
        run = functools.partial(
            restore, resume=True, resume_from=None, lock=trio.Lock(), average=ReferenceAverage(None, config.reference)
        )
        return trio.run(run, models, run_parts(buffer, None, pending, kl), config, files)


def test_a_fresh_run_sends_its_weights_first_to_a_server_serving_another_runs(tmp_path, caplog):
    kept = _KeptServer(version=50)
    with caplog.at_level("WARNING"):
        state = _fresh_start(tmp_path / "kept", kept)
    assert kept.loads == [0] and state.weight_version == 0 and state.step == 0
    assert "serves weight version 50 from before this run" in caplog.text
    for version in (None, 0):  # as started from a model directory, or at this run's first version already
        untouched = _KeptServer(version=version)
        _fresh_start(tmp_path / f"v{version}", untouched)
        assert untouched.loads == []
