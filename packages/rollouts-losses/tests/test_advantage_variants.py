"""GPG, ReMax and pass@k advantages against plain loops; k1+/k3+ and the adaptive KL controller."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.losses import (
    KLControllerState,
    adaptive_kl_update,
    gpg_advantages,
    kl_penalty,
    passk_advantages,
    remax_advantages,
)

rewards_and_groups = st.integers(1, 5).flatmap(
    lambda g: st.tuples(
        st.lists(st.floats(-4.0, 4.0, width=32) | st.sampled_from([0.0, 1.0]), min_size=2 * g, max_size=2 * g + 6),
        st.just(g),
    )
)


def _groups(n, num_groups, seed):
    """Group ids for n samples, every group at least 2 samples, shuffled."""
    ids = [i % num_groups for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    return torch.tensor(ids)[torch.randperm(n, generator=g)]


def _members(groups, i):
    return [j for j in range(len(groups)) if groups[j] == groups[i]]


@settings(max_examples=60, deadline=None)
@given(data=rewards_and_groups, seed=st.integers(0, 100))
def test_gpg_matches_naive(data, seed):
    values, num_groups = data
    rewards = torch.tensor(values, dtype=torch.float64)
    groups = _groups(len(values), num_groups, seed)
    centered = [
        values[i] - sum(values[j] for j in _members(groups, i)) / len(_members(groups, i)) for i in range(len(values))
    ]
    valid = sum(1 for c in centered if c != 0)
    alpha = len(values) / max(valid, 1)
    ours = gpg_advantages(rewards, groups)
    # float64 means of float32 rewards: 1e-12 absolute is many ulps of the rewards' scale (<= 4)
    torch.testing.assert_close(
        ours, torch.tensor([alpha * c for c in centered], dtype=torch.float64), rtol=0, atol=1e-12
    )
    for group in set(groups.tolist()):  # each group's advantages sum to 0
        assert abs(float(ours[groups == group].sum())) < 1e-9


def test_gpg_rescales_by_the_samples_that_carry_gradient():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])  # the second group is uniform: no gradient
    adv = gpg_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))  # 2 * (+-0.5)


@settings(max_examples=60, deadline=None)
@given(data=rewards_and_groups, seed=st.integers(0, 100), scale=st.sampled_from(["group", "none"]))
def test_passk_matches_naive(data, seed, scale):
    values, num_groups = data
    rewards = torch.tensor(values, dtype=torch.float64)
    groups = _groups(len(values), num_groups, seed)
    expected = [0.0] * len(values)
    for group in set(groups.tolist()):
        members = [j for j in range(len(values)) if groups[j] == group]
        ordered = sorted(members, key=lambda j: (-values[j], j))
        gap = values[ordered[0]] - values[ordered[1]]
        mean = sum(values[j] for j in members) / len(members)
        std = math.sqrt(sum((values[j] - mean) ** 2 for j in members) / (len(members) - 1))
        expected[ordered[0]] = gap / (std + 1e-6) if scale == "group" else gap
    ours = passk_advantages(rewards, groups, scale=scale)
    torch.testing.assert_close(ours, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert (ours >= 0).all()


def test_passk_refuses_groups_of_one_and_other_scales():
    with pytest.raises(ValueError, match=">= 2 samples per group"):
        passk_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="scale"):
        passk_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), scale="batch")


def test_remax_subtracts_the_greedy_reward_of_the_prompt():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    greedy = torch.tensor([0.5, 0.5, 1.0, 1.0])
    torch.testing.assert_close(
        remax_advantages(rewards, greedy, group_ids_B=torch.tensor([0, 0, 1, 1])),
        torch.tensor([0.5, -0.5, -0.5, -0.75]),
    )
    with pytest.raises(ValueError, match="one value per group"):
        remax_advantages(rewards, torch.tensor([0.5, 0.4, 1.0, 1.0]), group_ids_B=torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="greedy_rewards_B must be"):
        remax_advantages(rewards, greedy[:3])
    with pytest.raises(ValueError, match="finite"):
        remax_advantages(rewards, torch.tensor([0.5, 0.5, math.nan, 1.0]))


@pytest.mark.parametrize(("kind", "value_kind"), [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_kl_has_its_value_and_k2s_gradient(kind, value_kind):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 2).requires_grad_()
    ref = logp.detach() + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    ours = kl_penalty(logp, ref, kind=kind)
    torch.testing.assert_close(ours, kl_penalty(logp, ref, kind=value_kind))
    (grad,) = torch.autograd.grad(ours.sum(), logp)
    torch.testing.assert_close(grad, logp.detach() - ref)  # d/dx 0.5 (x - ref)^2


def test_adaptive_kl_controller_follows_ziegler():
    state = KLControllerState(coef=0.1)
    up = adaptive_kl_update(state, observed_kl=0.2, target_kl=0.1, horizon=100, num_steps=10)
    assert up.coef == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error 1.0 clipped to 0.2
    down = adaptive_kl_update(state, observed_kl=0.09, target_kl=0.1, horizon=100)
    assert down.coef == pytest.approx(0.1 * (1 - 0.1 / 100))
    assert state.coef == 0.1  # state in, new state out
    assert adaptive_kl_update(state, observed_kl=0.1, target_kl=0.1, horizon=5) == state


def _verl_adaptive_kl(coef, current_kl, target_kl, horizon, n_steps):
    """verl's AdaptiveKLController.update (core_algos.py); the trainer passes n_steps = the batch's samples."""
    error = min(max(current_kl / target_kl - 1, -0.2), 0.2)
    return coef * (1 + error * n_steps / horizon)


def test_adaptive_kl_controller_counts_samples_in_the_horizon_as_verl_when_asked():
    """50 steps of 64 sequences, horizon 10000: verl reaches 0.05142; counting steps (the default) 0.05002."""
    by_samples = by_steps = KLControllerState(coef=0.05)
    verl = 0.05
    for _ in range(50):
        by_samples = adaptive_kl_update(by_samples, observed_kl=0.10875, target_kl=0.1, horizon=10_000, num_samples=64)
        by_steps = adaptive_kl_update(by_steps, observed_kl=0.10875, target_kl=0.1, horizon=10_000)
        verl = _verl_adaptive_kl(verl, 0.10875, 0.1, 10_000, 64)
    assert by_samples.coef == pytest.approx(verl, rel=1e-12)
    assert round(by_samples.coef, 5) == 0.05142 and round(by_steps.coef, 5) == 0.05002
    three_steps = adaptive_kl_update(
        KLControllerState(coef=0.1), observed_kl=0.2, target_kl=0.1, horizon=1000, num_steps=3, num_samples=96
    )
    assert three_steps.coef == pytest.approx(0.1 * (1 + 0.2 * 96 / 1000))  # the samples of all three steps


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"observed_kl": math.nan}, "observed_kl"),
        ({"target_kl": 0.0}, "target_kl"),
        ({"horizon": 0}, "horizon"),
        ({"num_steps": 11}, r"num_steps \(11\) must be <= horizon \(10\)"),
        ({"num_samples": 11}, r"num_samples \(11\) must be <= horizon \(10\)"),
        ({"num_samples": 0}, "num_samples must be an int >= 1"),
    ],
)
def test_adaptive_kl_controller_refuses_bad_input(kw, match):
    args = {"observed_kl": 0.1, "target_kl": 0.1, "horizon": 10, "num_steps": 1} | kw
    with pytest.raises(ValueError, match=match):
        adaptive_kl_update(KLControllerState(coef=0.1), **args)
    with pytest.raises(ValueError, match="state.coef"):
        adaptive_kl_update(KLControllerState(coef=0.0), observed_kl=0.1, target_kl=0.1, horizon=10)


def test_sample_advantages_dispatches_by_name():
    from rollouts.losses import group_advantages, rloo_advantages, sample_advantages

    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 0.25]), torch.tensor([0, 0, 1, 1])
    greedy = torch.tensor([0.5, 0.5, 0.0, 0.0])
    expected = {
        "grpo": group_advantages(rewards, groups),
        "rloo": rloo_advantages(rewards, groups),
        "gpg": gpg_advantages(rewards, groups),
        "grpo_passk": passk_advantages(rewards, groups),
        "remax": remax_advantages(rewards, greedy),
    }
    for name, want in expected.items():
        torch.testing.assert_close(sample_advantages(rewards, groups, estimator=name, greedy_rewards_B=greedy), want)
    with pytest.raises(ValueError, match="greedy_rewards_B"):
        sample_advantages(rewards, groups, estimator="remax")
    with pytest.raises(ValueError, match="per-token"):
        sample_advantages(rewards, groups, estimator="gae")
