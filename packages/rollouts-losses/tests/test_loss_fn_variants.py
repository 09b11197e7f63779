"""The 2025-26 losses and corrections through loss_fn_from_config: same as the direct calls, packing and
micro-batching invisible, every correction multiplying the per-token loss."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from losses_layouts import micro_batch, packed, padded, random_seqs

from rollouts.losses import (
    Reduction,
    dppo_loss,
    gmpo_loss,
    kl_cov_loss,
    loss_fn_from_config,
    off_policy_sequence_mask,
    ppo_clip_loss,
    rejection_mask,
    sapo_loss,
)
from rollouts.types import AlgorithmConfig

ADDITIVE = {  # configs whose per-token loss depends only on the sequence itself: split and packing are invisible
    "sapo": AlgorithmConfig(policy_loss="sapo", loss_aggregation="seq-mean-token-mean"),
    "gmpo": AlgorithmConfig(policy_loss="gmpo", eps_low=0.3, eps_high=0.3, loss_aggregation="seq-mean-token-mean"),
    "dppo": AlgorithmConfig(policy_loss="dppo_tv", eps_low=0.05, eps_high=0.05, log_ratio_sq_coef=0.1),
    "dppo_kl": AlgorithmConfig(policy_loss="dppo_kl", eps_low=0.02, eps_high=0.02, is_cap=2.0),
    "rs_seq": AlgorithmConfig(rs_level="seq_mean", rs_estimator="k3", rs_high=0.05, is_cap=2.0, is_level="sequence"),
    "rs_token_opm": AlgorithmConfig(
        rs_level="token",
        rs_estimator="k1",
        rs_low=-0.3,
        rs_high=0.3,
        off_policy_mask_threshold=0.01,
        kl_coef=0.1,
        kl_placement="loss",
        kl_kind="k3+",
    ),
}


def _seqs(seed, lengths):
    seqs = random_seqs(seed, lengths)
    for s in seqs:  # log-probs of probabilities (DPPO's binary KL needs p <= 1)
        for key in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs"):
            s[key] = s[key].clamp(max=-1e-3)
    return seqs


def _call(fn, layout, *, num_tokens, num_sequences, drop=()):
    logp = layout["logprobs"].clone().requires_grad_()
    batch = micro_batch({k: v for k, v in layout.items() if k not in drop})
    entropy = layout["entropy"] if fn.needs_entropy else None
    loss, metrics = fn(logp, batch, num_tokens=num_tokens, num_sequences=num_sequences, entropy_B_T=entropy)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, metrics, grad[layout["segment_ids"] >= 0]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(2, 8), min_size=2, max_size=5),
    name=st.sampled_from(sorted(ADDITIVE)),
    split=st.integers(1, 4),
)
def test_micro_batches_sum_to_the_step_and_packing_is_invisible(seed, lengths, name, split):
    fn = loss_fn_from_config(ADDITIVE[name])
    seqs = _seqs(seed, lengths)
    counts = {"num_tokens": sum(int((s["loss_mask"] > 0).sum()) for s in seqs), "num_sequences": len(seqs)}
    whole, _, whole_grad = _call(fn, padded(seqs), **counts)
    split = min(split, len(seqs) - 1)
    parts = [_call(fn, packed(seqs[:split], pad=2), **counts), _call(fn, padded(seqs[split:]), **counts)]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]]), whole_grad)


def _direct(loss, cfg, batch, **kw):
    logp = batch["logprobs"].clone().requires_grad_()
    value, _ = loss(
        logp,
        kw.pop("old", batch["old_logprobs"]),
        batch["advantages"],
        batch["loss_mask"],
        reduction=Reduction(mode=cfg.loss_aggregation, segment_ids_B_T=batch["segment_ids"]),
        **kw,
    )
    return value, torch.autograd.grad(value, logp)[0][batch["segment_ids"] >= 0]


@pytest.mark.parametrize("name", ["sapo", "gmpo", "kl_cov"])
def test_config_calls_the_loss(name):
    batch = packed(_seqs(1, [5, 7, 4]), pad=2)
    cfg = {
        "sapo": AlgorithmConfig(policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0),
        "gmpo": AlgorithmConfig(policy_loss="gmpo", eps_low=0.1, eps_high=0.3),
        "kl_cov": AlgorithmConfig(policy_loss="kl_cov", cov_fraction=0.3, kl_cov_coef=0.5),
    }[name]
    kw = {
        "sapo": {"tau_pos": 2.0, "tau_neg": 3.0},
        "gmpo": {"eps_low": 0.1, "eps_high": 0.3},
        "kl_cov": {"cov_fraction": 0.3, "kl_coef": 0.5},
    }[name]
    ref, ref_grad = _direct({"sapo": sapo_loss, "gmpo": gmpo_loss, "kl_cov": kl_cov_loss}[name], cfg, batch, **kw)
    loss, _, grad = _call(
        loss_fn_from_config(cfg), batch, num_tokens=None, num_sequences=None, drop=("rollout_logprobs",)
    )
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)


def test_dppo_trust_region_is_around_the_engine_policy_plus_the_squared_log_ratio():
    batch = padded(_seqs(2, [6, 8, 5]))
    cfg = AlgorithmConfig(policy_loss="dppo_tv", eps_low=0.05, eps_high=0.05, log_ratio_sq_coef=0.2)
    logp = batch["logprobs"].clone().requires_grad_()
    rollout, mask = batch["rollout_logprobs"], batch["loss_mask"]
    ref, _ = dppo_loss(logp, rollout, batch["advantages"], mask, eps_low=0.05, eps_high=0.05)
    ref = ref + 0.2 * (((logp - rollout) ** 2) * mask).sum() / mask.sum()
    loss, metrics, grad = _call(loss_fn_from_config(cfg), batch, num_tokens=None, num_sequences=None)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, logp)[0][batch["segment_ids"] >= 0])
    assert (
        "offpolicy_ess_seq" in metrics and "offpolicy_chi2_token" in metrics
    )  # diagnostics whenever rollout log-probs come


def test_corrections_multiply_the_per_token_loss():
    batch = padded(_seqs(3, [6, 8, 5, 7]))
    cfg = AlgorithmConfig(rs_level="token", rs_estimator="k2", rs_high=0.02, off_policy_mask_threshold=0.0)
    old, rollout, mask, adv = batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"], batch["advantages"]
    logp = batch["logprobs"].clone().requires_grad_()
    keep_rs, _ = rejection_mask(old, rollout, mask, estimator="k2", level="token", high=0.02)
    keep_opm, _ = off_policy_sequence_mask(logp.detach(), rollout, adv, mask, threshold=0.0)
    assert 0 < (keep_rs * keep_opm).sum() < (mask > 0).sum()  # both masks drop something, keep something
    ref, _ = ppo_clip_loss(logp, old, adv, mask, is_weights=keep_rs * keep_opm)
    loss, metrics, _ = _call(loss_fn_from_config(cfg), batch, num_tokens=None, num_sequences=None)
    torch.testing.assert_close(loss, ref)
    assert metrics["rs_masked_frac"] > 0 and metrics["off_policy_masked_frac"] > 0


def test_high_entropy_mask_needs_entropy_and_trains_only_those_tokens():
    batch = padded(_seqs(4, [9, 8, 7]))
    fn = loss_fn_from_config(AlgorithmConfig(top_entropy_quantile=0.3))
    assert fn.needs_entropy
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        fn(batch["logprobs"], micro_batch(batch), num_tokens=None, num_sequences=None)
    _, metrics, grad = _call(fn, batch, num_tokens=None, num_sequences=None)
    assert 0 < metrics["entropy_mask_frac"] < 0.5
    selected = batch["loss_mask"][batch["segment_ids"] >= 0] > 0
    assert 0 < int((grad != 0).sum()) <= round(0.3 * int(selected.sum())) + 1


@pytest.mark.parametrize(
    "cfg",
    [
        AlgorithmConfig(rs_level="token", rs_high=1.0),
        AlgorithmConfig(off_policy_mask_threshold=0.1),
    ],
)
def test_corrections_name_the_missing_rollout_logprobs(cfg):
    batch = padded(_seqs(5, [4, 5]))
    assert cfg.needs_rollout_logprobs
    with pytest.raises(ValueError, match="rollout_logprobs"):
        _call(loss_fn_from_config(cfg), batch, num_tokens=None, num_sequences=None, drop=("rollout_logprobs",))


def test_every_policy_loss_runs_without_nan_through_the_config():
    batch = packed(_seqs(6, [5, 6, 7]), pad=1)
    for policy_loss in ("sapo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"):
        cfg = dataclasses.replace(AlgorithmConfig(), policy_loss=policy_loss, eps_low=0.2, eps_high=0.2)
        loss, metrics, grad = _call(loss_fn_from_config(cfg), batch, num_tokens=None, num_sequences=None)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and metrics["loss"] == loss.item()
