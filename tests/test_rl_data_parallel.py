"""Data-parallel RL (torchrun, 2 gloo ranks) gives what one process gives on the same batch (and the
broadcasts that hand rank 0's batch to the others deliver it unchanged), for
settings whose advantages need the whole batch, for KL in the loss, and for on-policy distillation
from a sharded teacher added to GRPO's advantage."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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

from rollouts.backends import read_weights
from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.rl.step import rl_update
from rollouts.loops.run.distributed import all_gather_arrays
from rollouts.types import TrainingState

_TORCHRUN_TIMEOUT_S = 600


def test_all_gather_arrays_in_one_process_returns_the_arrays():
    arrays = [torch.arange(3, dtype=torch.float32).numpy(), torch.zeros(0).numpy()]
    (gathered,) = all_gather_arrays(arrays)
    assert [a.tolist() for a in gathered] == [[0.0, 1.0, 2.0], []]


@pytest.mark.slow
def test_rl_update_on_two_ranks_matches_one_process(tmp_path):
    worker = Path(__file__).parent / "dp_rl_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(worker), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=_TORCHRUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    held = [json.loads((tmp_path / f"broadcast_rank{r}.json").read_text()) for r in (0, 1)]
    assert held[0] == held[1]  # the batch decoded on rank 1 is rank 0's, byte for byte
    assert held[1]["equal"] and held[1]["empty"] == ["E", ""]
    assert held[1]["bytes"] == "00616263" and held[1]["json"] == {"a": [1, 2.5, None]}
    distributed = json.loads((tmp_path / "metrics.json").read_text())
    for name, algorithm in CASES.items():
        trained, ref = components(sharded=False)
        value = critic(sharded=False) if algorithm.advantage_estimator == "gae" else None
        state = TrainingState()
        for _ in range(NUM_STEPS):
            state, metrics = rl_update(trained, state, batch(), config(algorithm), ref_components=ref, critic=value)
        assert distributed[name]["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-6), name
        if "kl_reward" in metrics:
            assert distributed[name]["kl_reward"] == pytest.approx(metrics["kl_reward"], rel=1e-4, abs=1e-7), name
        if value is not None:  # the critic's loss and weights too
            assert distributed[name]["vf_loss"] == pytest.approx(metrics["vf_loss"], rel=1e-4, abs=1e-6), name
            critic_weights = read_weights(tmp_path / f"{name}_critic")
            for key, tensor in value.model.state_dict().items():
                torch.testing.assert_close(critic_weights[key], tensor, atol=1e-5, rtol=1e-4, msg=f"critic: {key}")
        reference = trained.model.state_dict()
        weights = read_weights(tmp_path / name)
        assert set(weights) == set(reference), name
        for key, tensor in weights.items():
            torch.testing.assert_close(tensor, reference[key], atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")
    for name, options in DISTILL_CASES.items():
        trained, _ = components(sharded=False)
        distill, state = distillation(sharded=False, **options), TrainingState()
        for _ in range(NUM_STEPS):
            state, metrics = rl_update(trained, state, batch(), config(ALGORITHMS["grpo"]), distill=distill)
        assert set(distributed[name]) == {"loss", *(k for k in DISTILL_METRICS if k in metrics)}, name
        for key, value in distributed[name].items():
            assert value == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), (name, key)
        for key, tensor in read_weights(tmp_path / name).items():
            torch.testing.assert_close(
                tensor, trained.model.state_dict()[key], atol=1e-5, rtol=1e-4, msg=f"{name}: {key}"
            )
