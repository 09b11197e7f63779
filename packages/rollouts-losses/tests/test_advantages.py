"""Advantage estimators against naive loops, plus group properties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.losses import (
    broadcast_to_tokens,
    gae_advantages,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
)

_reward = st.floats(-10.0, 10.0, allow_nan=False, width=32)


def _naive_grpo(rewards, groups, eps=1e-6, scale=True):
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = torch.tensor([x for x, h in zip(rewards, groups, strict=True) if h == g], dtype=torch.float64)
        mean, std = (members.mean(), members.std()) if len(members) > 1 else (0.0, 1.0)
        out.append((r - mean) / (std + eps) if scale else r - mean)
    return torch.tensor(out, dtype=torch.float64)


def test_group_advantages_match_naive():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 3.0]
    groups = [0, 0, 0, 0, 7, 3, 3]
    r, g = torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups)
    torch.testing.assert_close(group_advantages(r, g), _naive_grpo(rewards, groups))
    torch.testing.assert_close(group_advantages(r, g, scale="none"), _naive_grpo(rewards, groups, scale=False))
    centered = _naive_grpo(rewards, groups, scale=False)
    torch.testing.assert_close(group_advantages(r, g, scale="batch"), centered / (r.std() + 1e-6))
    assert group_advantages(r, g)[4].item() == pytest.approx(0.5 / (1 + 1e-6))  # a group of one: mean 0, std 1


@settings(max_examples=40, deadline=None)
@given(
    rewards=st.lists(_reward, min_size=2, max_size=12),
    num_groups=st.integers(1, 4),
    seed=st.integers(0, 1000),
    scale=st.sampled_from(["group", "batch", "none"]),
)
def test_group_advantages_sum_to_zero_and_are_permutation_equivariant(rewards, num_groups, seed, scale):
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.arange(len(rewards)) % num_groups
    adv = group_advantages(r, g, scale=scale)
    for k in range(num_groups):
        if (g == k).sum() > 1:
            assert abs(adv[g == k].sum().item()) < 1e-6 * max(1.0, r.abs().max().item() * len(rewards))
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(group_advantages(r[perm], g[perm], scale=scale), adv[perm])
    assert torch.isfinite(adv).all()


def test_group_advantages_constant_group_is_zero_and_bad_input_raises():
    adv = group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.int64))
    assert torch.equal(adv, torch.zeros(4))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.ones(2), torch.zeros(2, dtype=torch.int64), scale="std")


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan"), float("inf")])
def test_every_estimator_refuses_an_eps_that_cannot_guard_a_zero_std(eps):
    rewards, groups, mask = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        group_advantages(rewards, groups, eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        masked_whiten(torch.ones(4, 3), mask, eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        reinforce_pp_advantages(rewards, mask, eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        gae_advantages(torch.ones(4, 3), torch.ones(4, 3), mask, gamma=1.0, lam=1.0, eps=eps)


def test_reinforce_pp_and_group_estimators_check_rewards_at_the_edge():
    mask = torch.ones(3, 2)
    with pytest.raises(ValueError, match="rewards must be finite"):
        reinforce_pp_advantages(torch.tensor([1.0, float("nan"), 0.0]), mask)
    with pytest.raises(ValueError, match="one shape"):
        reinforce_pp_advantages(torch.ones(3), mask, group_ids_B=torch.zeros(2, dtype=torch.int64))
    for fn in (group_advantages, rloo_advantages):
        with pytest.raises(TypeError, match="floating-point"):
            fn(torch.tensor([1, 0, 1]), torch.zeros(3, dtype=torch.int64))


def test_a_plain_list_of_rewards_is_a_type_error_naming_it():
    """A list instead of a tensor failed inside the check with a raw AttributeError."""
    for fn in (group_advantages, rloo_advantages):
        with pytest.raises(TypeError, match=r"rewards must be a \[B\] torch.Tensor .*got list \[1.0, 0.0\]"):
            fn([1.0, 0.0], torch.zeros(2, dtype=torch.int64))
        with pytest.raises(TypeError, match=r"group_ids must be a \[B\] torch.Tensor .*got list \[0, 0\]"):
            fn(torch.tensor([1.0, 0.0]), [0, 0])
    with pytest.raises(TypeError, match="rewards must be"):
        reinforce_pp_advantages([1.0, 0.0], torch.ones(2, 3))


@settings(max_examples=30, deadline=None)
@given(rewards=st.lists(_reward, min_size=1, max_size=10), num_groups=st.integers(1, 3))
def test_rloo_matches_leave_one_out(rewards, num_groups):
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.arange(len(rewards)) % num_groups
    adv = rloo_advantages(r, g)
    for i in range(len(rewards)):
        others = r[(g == g[i]) & (torch.arange(len(rewards)) != i)]
        expected = r[i] - others.mean() if len(others) else r[i]
        assert adv[i].item() == pytest.approx(expected.item(), abs=1e-9)


def _naive_gae(rewards, values, gamma, lam):
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    for i in range(b):
        last = 0.0
        for j in reversed(range(t)):
            nv = values[i, j + 1] if j + 1 < t else 0.0
            delta = rewards[i, j] + gamma * nv - values[i, j]
            last = delta + gamma * lam * last
            adv[i, j] = last
    return adv, adv + values


def test_gae_matches_naive_on_full_masks_and_skips_masked_tokens():
    g = torch.Generator().manual_seed(0)
    rewards, values = (
        torch.randn(3, 6, generator=g, dtype=torch.float64),
        torch.randn(3, 6, generator=g, dtype=torch.float64),
    )
    mask = torch.ones(3, 6)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    ref_adv, ref_ret = _naive_gae(rewards, values, 0.9, 0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    # a masked-out middle token (a tool turn) is skipped: same as removing it
    mask[:, 2] = 0.0
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    keep = [0, 1, 3, 4, 5]
    ref_adv, _ = _naive_gae(rewards[:, keep], values[:, keep], 0.9, 0.8)
    torch.testing.assert_close(adv[:, keep], ref_adv)
    assert torch.equal(adv[:, 2], torch.zeros(3, dtype=torch.float64))
    white, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert abs(white[mask > 0].mean().item()) < 1e-9


def test_reinforce_pp_places_reward_on_last_token_and_whitens():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float64)
    rewards = torch.tensor([1.0, -1.0], dtype=torch.float64)
    adv = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    returns = torch.tensor([[0, 1, 1, 0], [0, -1, -1, -1]], dtype=torch.float64)
    torch.testing.assert_close(adv, masked_whiten(returns, mask))
    kl = torch.full((2, 4), 0.5, dtype=torch.float64)
    adv_kl = reinforce_pp_advantages(rewards, mask, kl_B_T=kl, kl_coef=0.2, gamma=1.0)
    returns_kl = returns - 0.1 * torch.tensor([[0, 2, 1, 0], [0, 3, 2, 1]], dtype=torch.float64)
    torch.testing.assert_close(adv_kl, masked_whiten(returns_kl, mask))
    baseline = reinforce_pp_advantages(rewards, mask, group_ids_B=torch.tensor([0, 0]))
    torch.testing.assert_close(baseline, adv)  # centering a whole-batch group does not change whitened returns


def test_broadcast_to_tokens():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.5]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 2.0], [0.0, 0.0, -1.0]]))
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.ones(3), mask)


def _verl_reinforce_pp_baseline_scores(rewards, groups):
    """verl's REINFORCE++-baseline centering (core_algos.py): r - group mean; a group of one keeps its reward."""
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        out.append(r - (sum(members) / len(members) if len(members) > 1 else 0.0))
    return out


def test_reinforce_pp_baseline_keeps_the_reward_of_a_group_of_one():
    rewards = torch.tensor([0.99, 1.0, 0.0, 0.3, 0.5, 0.7], dtype=torch.float64)
    groups = [4, 1, 1, 2, 2, 5]  # groups 4 and 5 have one sample each
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.float64)
    ours = reinforce_pp_advantages(rewards, mask, group_ids_B=torch.tensor(groups))
    centered = torch.tensor(_verl_reinforce_pp_baseline_scores(rewards.tolist(), groups), dtype=torch.float64)
    # gamma 1, no KL: every trained token's return is its sample's centered reward
    torch.testing.assert_close(ours, masked_whiten(broadcast_to_tokens(centered, mask), mask))


@settings(max_examples=30, deadline=None)
@given(rewards=st.lists(_reward, min_size=2, max_size=8), seed=st.integers(0, 2**16))
def test_reinforce_pp_groups_of_one_are_no_baseline(rewards, seed):
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(len(rewards), 5, generator=g) > 0.3).double()
    singletons = torch.randperm(len(rewards), generator=g)  # every sample its own group, ids shuffled
    torch.testing.assert_close(
        reinforce_pp_advantages(r, mask, group_ids_B=singletons), reinforce_pp_advantages(r, mask)
    )
