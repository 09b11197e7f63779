import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_worker import GLOBAL_SEQUENCES, NUM_STEPS
from helpers import TRAIN_CONFIG_KW, packed_batch, tiny_model
from rollouts.backends import (
    build_components,
    forward_backward,
    latest_checkpoint,
    load_checkpoint,
    optim_step,
    read_weights,
)
from rollouts.losses import sft_loss_fn
from rollouts.types import OptimizerConfig, TrainingState

_TORCHRUN_TIMEOUT_S = 300
_ATTEMPTS = 2
"""A gloo rank on an oversubscribed CPU occasionally aborts in C++ teardown ("terminate called
without an active exception", SIGABRT) with no Python error; that one failure is run again."""


def _torchrun(worker: str, out: Path) -> None:
    """Run tests/<worker> on 2 gloo ranks with `out` as its argument; fail with its stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(Path(__file__).parent / worker), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(_ATTEMPTS):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_TORCHRUN_TIMEOUT_S, check=False)
        if done.returncode == 0 or "terminate called without an active exception" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
def test_a_checkpoint_failure_on_one_rank_raises_on_every_rank(tmp_path):
    _torchrun("fsdp_failure_worker.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert "No space left on device" in ranks[0]["publish"] and "another rank" in ranks[1]["publish"]
    assert "another rank" in ranks[0]["shard"] and "No space left on device" in ranks[1]["shard"]
    assert ranks[0]["latest"] == ranks[1]["latest"] == str(tmp_path / "ckpt" / "step_4")


@pytest.mark.slow
def test_fsdp2_on_two_gloo_ranks_matches_single_process(tmp_path):
    _torchrun("fsdp_worker.py", tmp_path)
    result = json.loads((tmp_path / "losses.json").read_text())

    config = OptimizerConfig(**TRAIN_CONFIG_KW)
    single = build_components(tiny_model(seed=0), config, num_training_steps=NUM_STEPS)
    state, losses = TrainingState(), []
    batch = packed_batch(GLOBAL_SEQUENCES)
    num_tokens = int((batch["loss_mask"] > 0).sum())

    def step(components, state):
        metrics = forward_backward(components, [batch], sft_loss_fn(), num_tokens=num_tokens, num_sequences=4)
        state, _ = optim_step(components, state, config, num_tokens=num_tokens, num_samples=4)
        return state, metrics["loss"]

    for _ in range(NUM_STEPS):
        state, loss = step(single, state)
        losses.append(loss)

    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    reference = single.model.state_dict()
    for directory in ("final", "resumed"):
        weights = read_weights(tmp_path / directory)
        assert set(weights) == set(reference)
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, reference[name], atol=1e-5, rtol=1e-4)
    assert result["resumed_step"] == NUM_STEPS

    # Each rank wrote only its own optimizer shards: two files, each about half of the whole.
    step_dir = tmp_path / "ckpt" / "step_2"
    shard_files = sorted(p.name for p in step_dir.glob("optimizer*.safetensors"))
    assert shard_files == ["optimizer-rank00000-of-00002.safetensors", "optimizer-rank00001-of-00002.safetensors"]
    moments = 2 * sum(t.numel() * t.element_size() for t in reference.values())
    for name in shard_files:
        assert (step_dir / name).stat().st_size < 0.6 * moments

    # The background-published step 1 is complete too.
    assert latest_checkpoint(tmp_path / "ckpt") == step_dir
    early = build_components(tiny_model(seed=1), config, num_training_steps=NUM_STEPS)
    assert load_checkpoint(early, tmp_path / "ckpt" / "step_1")[0].step == 1

    # The same checkpoint resumes in one process without FSDP (shards joined): step 3 matches.
    single_resumed = build_components(tiny_model(seed=1), config, num_training_steps=NUM_STEPS)
    state, _ = load_checkpoint(single_resumed, step_dir)
    assert state.step == 2
    _, loss = step(single_resumed, state)
    assert loss == pytest.approx(losses[-1], rel=1e-5)
    for name, tensor in single_resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-5, rtol=1e-4)
