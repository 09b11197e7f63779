"""The adaptive KL controller in the RL loop: each step's coefficient is the controller's update
from the previous step's KL, and a resumed run continues with the coefficient its checkpoint holds."""

import dataclasses

import pytest
from test_rl_loop import _run, starts_with_seven

from rollouts.loops.algorithms import ALGORITHMS
from rollouts.losses import KLControllerState, adaptive_kl_update


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
