"""The adaptive KL controller in the RL loop: each step's coefficient is the controller's update
from the previous step's KL, a resumed run continues with the coefficient its checkpoint holds, and a horizon counted in samples
moves it by the sequences each step trained (verl's)."""

import dataclasses

import pytest
from test_rl_loop import _run, starts_with_seven

from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.rl.state import KLController
from rollouts.losses import KLControllerState, adaptive_kl_update
from rollouts.types import RLConfig, RolloutConfig


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_each_step_uses_the_controllers_update_of_the_last_kl(tiny_run_inputs, tmp_path, placement):
    algorithm = dataclasses.replace(
        ALGORITHMS["grpo"], kl_coef=0.1, kl_placement=placement, kl_kind="k3", kl_target=0.001, kl_horizon=3
    )
    _, history = _run(tiny_run_inputs, tmp_path, algorithm=algorithm, steps=4, lr=3e-2, reward=starts_with_seven)
    key = "kl" if placement == "loss" else "kl_reward"
    coefs = [h["kl_coef"] for h in history]
    assert coefs[0] == 0.1
    for before, after, h in zip(coefs, coefs[1:], history, strict=False):
        expected = adaptive_kl_update(KLControllerState(coef=before), observed_kl=h[key], target_kl=0.001, horizon=3)
        assert after == pytest.approx(expected.coef, rel=1e-12)
    assert len(set(coefs)) > 1  # it moved


def test_a_resumed_run_continues_with_the_checkpointed_coefficient(tiny_run_inputs, tmp_path):
    algorithm = dataclasses.replace(
        ALGORITHMS["grpo"], kl_coef=0.1, kl_placement="loss", kl_kind="k3", kl_target=0.001, kl_horizon=3
    )
    _, first = _run(tiny_run_inputs, tmp_path, algorithm=algorithm, steps=2, lr=3e-2, reward=starts_with_seven)
    after_two = adaptive_kl_update(
        KLControllerState(coef=first[-1]["kl_coef"]), observed_kl=first[-1]["kl"], target_kl=0.001, horizon=3
    ).coef
    _, resumed = _run(
        tiny_run_inputs, tmp_path, algorithm=algorithm, steps=3, lr=3e-2, reward=starts_with_seven, resume=True
    )
    assert len(resumed) == 1 and resumed[0]["kl_coef"] == pytest.approx(after_two, rel=1e-12)


def test_without_a_target_the_coefficient_is_fixed(tiny_run_inputs, tmp_path):
    algorithm = dataclasses.replace(ALGORITHMS["grpo"], kl_coef=0.05, kl_placement="loss", kl_kind="k3")
    _, history = _run(tiny_run_inputs, tmp_path, algorithm=algorithm, steps=2, lr=3e-2, reward=starts_with_seven)
    assert [h["kl_coef"] for h in history] == [0.05, 0.05]


def _samples_config(**fields):
    algorithm = dataclasses.replace(
        ALGORITHMS["grpo"], kl_coef=0.05, kl_placement="reward", kl_kind="k1", kl_target=0.1, **fields
    )
    return RLConfig(algorithm=algorithm, rollout=RolloutConfig(batch_size=8, samples_per_prompt=8))


def test_a_sample_horizon_moves_the_coefficient_by_the_sequences_trained():
    """verl's horizon counts samples: 50 steps of 64 sequences at 8.75% over target move 0.05 to
    0.05142 (a horizon in steps: 0.05002)."""
    config = _samples_config(kl_horizon_unit="samples")
    controller, by_steps = KLController(config), KLController(_samples_config())
    expected = KLControllerState(coef=0.05)
    for _ in range(50):
        metrics = {"kl_reward": 0.10875, "num_trained": 64.0}
        controller.observe(config, metrics)
        by_steps.observe(_samples_config(), metrics)
        expected = adaptive_kl_update(expected, observed_kl=0.10875, target_kl=0.1, horizon=10_000, num_samples=64)
    assert controller.state == expected
    assert controller.state.coef == pytest.approx(0.05142, abs=5e-6)
    assert by_steps.state.coef == pytest.approx(0.05002, abs=5e-6)


def test_a_sample_horizon_shorter_than_a_step_is_refused():
    with pytest.raises(ValueError, match="kl_horizon"):
        KLController(_samples_config(kl_horizon_unit="samples", kl_horizon=32))


def test_the_loop_counts_the_sequences_each_step_trained(tiny_run_inputs, tmp_path):
    algorithm = dataclasses.replace(
        ALGORITHMS["grpo"],
        kl_coef=0.1,
        kl_placement="loss",
        kl_kind="k3",
        kl_target=0.001,
        kl_horizon=200,
        kl_horizon_unit="samples",
    )
    _, history = _run(tiny_run_inputs, tmp_path, algorithm=algorithm, steps=3, lr=3e-2, reward=starts_with_seven)
    coefs = [h["kl_coef"] for h in history]
    for before, after, h in zip(coefs, coefs[1:], history, strict=False):
        expected = adaptive_kl_update(
            KLControllerState(coef=before),
            observed_kl=h["kl"],
            target_kl=0.001,
            horizon=200,
            num_samples=int(h["num_trained"]),
        )
        assert after == pytest.approx(expected.coef, rel=1e-12)
    assert len(set(coefs)) > 1
