"""LossFn contract: config mapping, packed == padded, micro-batches summed == one batch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from losses_layouts import micro_batch, packed, padded, random_seqs

from rollouts.losses import LossFn, loss_fn_from_config, ppo_clip_loss, sft_loss_fn
from rollouts.types import AlgorithmConfig

_CONFIGS = {
    "grpo": AlgorithmConfig(),
    "dapo": AlgorithmConfig(eps_high=0.28, dual_clip_c=3.0, loss_aggregation="token-mean", entropy_coef=0.01),
    "drgrpo": AlgorithmConfig(advantage_scale="none", loss_aggregation="seq-mean-token-sum-norm", norm_constant=8.0),
    "gspo": AlgorithmConfig(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4, loss_aggregation="seq-mean-token-mean"),
    "cispo": AlgorithmConfig(policy_loss="cispo", eps_high=0.5, is_cap=2.0, is_level="sequence", is_mode="mask"),
    "pg_kl": AlgorithmConfig(policy_loss="pg", kl_coef=0.1, kl_placement="loss", kl_kind="k3", is_cap=1.5),
    "ppo_kl_seq": AlgorithmConfig(
        kl_coef=0.05, kl_placement="loss", kl_kind="k2", loss_aggregation="seq-mean-token-sum"
    ),
}


def _call(fn, layout, *, num_tokens, num_sequences):
    logp = layout["logprobs"].clone().requires_grad_()
    entropy = layout["entropy"].clone().requires_grad_()
    batch = micro_batch(layout)
    loss, metrics = fn(
        logp,
        batch,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        entropy_B_T=entropy if fn.needs_entropy else None,
    )
    grads = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    seg = layout["segment_ids"] >= 0
    return loss, metrics, [None if g is None else g[seg] for g in grads]


def test_protocol_and_needs_entropy():
    assert isinstance(sft_loss_fn(), LossFn)
    assert isinstance(loss_fn_from_config(AlgorithmConfig()), LossFn)
    assert not loss_fn_from_config(AlgorithmConfig()).needs_entropy
    assert loss_fn_from_config(AlgorithmConfig(entropy_coef=0.01)).needs_entropy
    with pytest.raises(TypeError):
        loss_fn_from_config({"policy_loss": "ppo_clip"})


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(2, 7), min_size=2, max_size=5),
    name=st.sampled_from(sorted(_CONFIGS)),
    split=st.integers(1, 4),
)
def test_micro_batches_sum_to_whole_batch_and_packing_is_invisible(seed, lengths, name, split):
    fn = loss_fn_from_config(_CONFIGS[name])
    seqs = random_seqs(seed, lengths)
    num_tokens = sum(int((s["loss_mask"] > 0).sum()) for s in seqs)
    counts = {"num_tokens": num_tokens, "num_sequences": len(seqs)}
    ref_loss, ref_metrics, ref_grads = _call(fn, padded(seqs), **counts)
    split = min(split, len(seqs) - 1)
    parts = [_call(fn, packed(seqs[:split], pad=1), **counts), _call(fn, padded(seqs[split:]), **counts)]
    torch.testing.assert_close(sum(p[0] for p in parts), ref_loss)
    for i, ref in enumerate(ref_grads):
        if ref is not None:
            torch.testing.assert_close(torch.cat([p[2][i] for p in parts]), ref)
    whole_packed = _call(fn, packed(seqs, pad=2), **counts)
    torch.testing.assert_close(whole_packed[0], ref_loss)
    assert whole_packed[1].keys() == ref_metrics.keys()
    # 0-dim detached tensors, read by the trainer once per step
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in ref_metrics.values())


def test_sft_loss_fn_micro_batches():
    seqs = random_seqs(0, [3, 5, 4])
    fn = sft_loss_fn(mode="token-mean")
    n = sum(int((s["loss_mask"] > 0).sum()) for s in seqs)
    whole, _, _ = _call(fn, packed(seqs), num_tokens=n, num_sequences=3)
    parts = (
        _call(fn, packed(seqs[:1]), num_tokens=n, num_sequences=3)[0]
        + _call(fn, packed(seqs[1:]), num_tokens=n, num_sequences=3)[0]
    )
    torch.testing.assert_close(parts, whole)
    b = packed(seqs)
    torch.testing.assert_close(whole, -(b["logprobs"] * b["loss_mask"]).sum() / n)


def test_on_policy_without_old_logprobs_is_ratio_one():
    layout = padded(random_seqs(1, [4, 6]))
    logp = layout["logprobs"].clone().requires_grad_()
    batch = micro_batch({k: layout[k] for k in ("loss_mask", "advantages", "segment_ids")})
    loss, metrics = loss_fn_from_config(AlgorithmConfig())(logp, batch, num_tokens=None, num_sequences=None)
    ref, _ = ppo_clip_loss(logp, logp.detach(), layout["advantages"], layout["loss_mask"])
    torch.testing.assert_close(loss, ref)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0) and metrics["clip_frac_high"] == 0.0


def test_kl_in_loss_and_entropy_bonus_are_added():
    layout = padded(random_seqs(2, [4, 6]))
    cfg = AlgorithmConfig(kl_coef=0.5, kl_placement="loss", kl_kind="k1", entropy_coef=0.1)
    logp = layout["logprobs"]
    loss, metrics = loss_fn_from_config(cfg)(
        logp, micro_batch(layout), num_tokens=None, num_sequences=None, entropy_B_T=layout["entropy"]
    )
    mask = layout["loss_mask"]
    pg, _ = ppo_clip_loss(logp, layout["old_logprobs"], layout["advantages"], mask)
    kl = ((logp - layout["ref_logprobs"]) * mask).sum() / mask.sum()
    ent = (layout["entropy"] * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, pg + 0.5 * kl - 0.1 * ent)
    assert float(metrics["kl"]) == pytest.approx(kl.item()) and float(metrics["entropy"]) == pytest.approx(ent.item())


def test_missing_keys_raise_naming_the_key():
    layout = padded(random_seqs(3, [4]))
    logp = layout["logprobs"]
    base = micro_batch({k: layout[k] for k in ("loss_mask", "advantages", "segment_ids")})
    with pytest.raises(ValueError, match="advantages"):
        loss_fn_from_config(AlgorithmConfig())(
            logp, micro_batch({k: layout[k] for k in ("loss_mask", "segment_ids")}), num_tokens=1, num_sequences=1
        )
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_fn_from_config(AlgorithmConfig(kl_coef=0.1, kl_placement="loss"))(
            logp, base, num_tokens=1, num_sequences=1
        )
    with pytest.raises(ValueError, match="rollout_logprobs"):
        loss_fn_from_config(AlgorithmConfig(is_cap=2.0))(logp, base, num_tokens=1, num_sequences=1)
    with pytest.raises(ValueError, match="entropy_B_T"):
        loss_fn_from_config(AlgorithmConfig(entropy_coef=0.1))(logp, base, num_tokens=1, num_sequences=1)


def test_a_dict_is_refused_naming_the_micro_batch_type():
    layout = padded(random_seqs(4, [4]))
    with pytest.raises(TypeError, match="MicroBatch"):
        sft_loss_fn()(layout["logprobs"], {"loss_mask": layout["loss_mask"]}, num_tokens=1, num_sequences=1)
