"""The one-file GRPO recipe (`python -m rollouts.loops.recipes.grpo_minimal`): it learns, syncs its engine
through disk every step, and a resumed run ends with the same weights as an uninterrupted one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import latest_checkpoint, read_weights
from rollouts.loops.recipes.grpo_minimal import GRPOLoss, group_baseline, main
from rollouts.types import MicroBatch


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_the_recipe_raises_its_reward_and_syncs_each_step(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--steps", "40"]) == 0
    lines = _lines(capsys)
    rewards = [float(line.split()[3]) for line in lines if line.startswith("step")]
    syncs = [line for line in lines if "sync: engine" in line]
    assert len(rewards) == 40 and len(syncs) == 40
    assert "weight version 40" in syncs[-1] and str(tmp_path / "weights") in syncs[-1]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, rewards  # 0.07 -> 0.18 here; random-init sampling scores ~0.06


def test_a_resumed_recipe_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, capsys):
    main(["--out", str(tmp_path / "straight"), "--steps", "4"])
    main(["--out", str(tmp_path / "resumed"), "--steps", "2"])
    main(["--out", str(tmp_path / "resumed"), "--steps", "4"])
    assert any(line.startswith("resuming from step 2") for line in _lines(capsys))
    straight = read_weights(latest_checkpoint(tmp_path / "straight" / "checkpoints"))
    resumed = read_weights(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_the_recipe_runs_as_a_module(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollouts.loops.recipes.grpo_minimal",
            "--out",
            str(tmp_path),
            "--steps",
            "1",
            "--prompts",
            "2",
            "--samples",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "step    1" in done.stdout and "sync: engine" in done.stdout


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5)), min_size=1, max_size=24))
def test_group_baseline_centres_and_scales_each_group(pairs):
    groups_N = torch.tensor([g for g, _ in pairs])
    rewards_N = torch.tensor([r for _, r in pairs], dtype=torch.float64)
    advantages_N = group_baseline(rewards_N, groups_N)
    for g in groups_N.unique():
        a = advantages_N[groups_N == g]
        r = rewards_N[groups_N == g]
        assert abs(float(a.sum())) <= 1e-6 * len(a) * (1 + float(r.abs().max()) / 1e-6)  # centred
        spread = float(r.std(unbiased=False))
        if spread > 1e-3:  # scaled to unit std (the eps is negligible against the spread)
            assert float(a.std(unbiased=False)) == pytest.approx(1.0, rel=1e-3)


def test_the_written_out_loss_is_the_step_token_mean_of_the_policy_gradient():
    """Split across micro-batches, the losses add up to the step's token mean; the gradient of a
    token's log-prob is -A_t / num_tokens."""
    logprobs_B_T = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    ones = torch.ones(2, 3, dtype=torch.long)
    batch = MicroBatch(
        input_ids=ones,
        position_ids=torch.arange(3).expand(2, 3),
        segment_ids=torch.tensor([[0, 0, 0], [1, 1, 1]]),
        attention_mask=ones,
        sample_indices=torch.arange(2),
        loss_mask=torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        advantages=torch.tensor([[0.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]),
    )
    loss, _ = GRPOLoss()(logprobs_B_T, batch, num_tokens=4, num_sequences=2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.5)  # ratio 1: -(2 + 2 - 1 - 1) / 4
    expected = -(batch.advantages * batch.loss_mask) / 4
    assert torch.allclose(logprobs_B_T.grad, expected)
    halves = [
        GRPOLoss()(logprobs_B_T[i : i + 1], batch.map(lambda _, v: v[i : i + 1]), num_tokens=4, num_sequences=2)[0]  # noqa: B023
        for i in range(2)
    ]
    assert float(sum(halves).detach()) == pytest.approx(float(loss.detach()))
