"""A loss's metrics stay on the device: the built-in losses never read a tensor into Python (which on
CUDA waits for every kernel queued before it, once per micro-batch), and their metrics are 0-dim
detached tensors that `floats_of` / `metrics_to_floats` read once.

Reading a value on the host goes through `aten._local_scalar_dense` (float(), int(), bool(),
.item()); a data-dependent shape (`nonzero`, boolean indexing) waits for the device as well. A
TorchDispatchMode counts those calls while each loss runs. A copy from the host to the device waits
as well (the stream is synchronized after it): the losses run once more on fake CUDA tensors
(FakeTensorMode, no GPU needed), where a host read raises and such a copy is counted.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from losses_layouts import micro_batch, packed, random_seqs
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from rollouts.losses import (
    PairLogps,
    aggregate,
    detached_metrics,
    floats_of,
    kto_loss,
    loss_fn_from_config,
    metrics_to_floats,
    preference_loss,
    sft_loss_fn,
    value_loss,
)
from rollouts.types import AlgorithmConfig, PreferenceConfig

_HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select")


class _CountHostReads(TorchDispatchMode):
    """Counts the ops that read device values on the host, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name
        boolean_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if name in _HOST_READS or boolean_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class _CountHostCopies(TorchDispatchMode):
    """Counts copies from a host tensor to another device: each waits for that device's stream."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name, kwargs = func._schema.name, kwargs or {}
        if name == "aten::_to_copy":
            target = kwargs.get("device")
            if args[0].device.type == "cpu" and target is not None and torch.device(target).type != "cpu":
                self.copies.append(name)
        elif name == "aten::copy_" and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            self.copies.append(name)
        return func(*args, **kwargs)


def _fake_cuda(t):
    """A fake CUDA tensor of t's shape and dtype (inside FakeTensorMode: no GPU, no values)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cuda")


def _fake_cuda_batch(batch):
    tensors = {
        f.name: _fake_cuda(v)
        for f in dataclasses.fields(batch)
        if isinstance(v := getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **tensors, extras={k: _fake_cuda(v) for k, v in batch.extras.items()})


def _assert_detached_scalars(metrics):
    for name, value in metrics.items():
        assert isinstance(value, torch.Tensor), f"{name} is a {type(value).__name__}, not a tensor"
        assert value.dim() == 0 and not value.requires_grad, name


_ALGORITHMS = {
    "ppo_dual_clip_kl_entropy": AlgorithmConfig(
        dual_clip_c=3.0, kl_coef=0.1, kl_placement="loss", kl_kind="k3", entropy_coef=0.01, log_ratio_sq_coef=0.1
    ),
    "gspo_seq_is": AlgorithmConfig(
        policy_loss="gspo", loss_aggregation="seq-mean-token-mean", is_cap=2.0, is_level="sequence"
    ),
    "cispo_is_mask": AlgorithmConfig(policy_loss="cispo", eps_high=0.5, is_cap=2.0, is_mode="mask"),
    "pg_rejection": AlgorithmConfig(policy_loss="pg", rs_level="seq_mean", rs_high=0.5),
    "sapo_off_policy_mask": AlgorithmConfig(policy_loss="sapo", off_policy_mask_threshold=0.1),
    "gmpo": AlgorithmConfig(policy_loss="gmpo"),
    "dppo_tv": AlgorithmConfig(policy_loss="dppo_tv"),
    "dppo_kl_norm": AlgorithmConfig(
        policy_loss="dppo_kl", loss_aggregation="seq-mean-token-sum-norm", norm_constant=8.0
    ),
    "clip_cov_high_entropy": AlgorithmConfig(
        policy_loss="clip_cov", cov_fraction=0.3, clip_cov_bounds=(-1.0, 10.0), top_entropy_quantile=0.5
    ),
    "kl_cov_seq_mean": AlgorithmConfig(policy_loss="kl_cov", cov_fraction=0.3, loss_aggregation="seq-mean-token-mean"),
}


@pytest.mark.parametrize("name", sorted(_ALGORITHMS))
def test_policy_loss_reads_nothing_on_the_host_and_its_metrics_are_detached_tensors(name):
    """Packed rows with old, ref and rollout log-probs (IS weights, rejection, off-policy diagnostics)."""
    seqs = random_seqs(3, [5, 7, 4])
    layout = packed(seqs, pad=2)
    fn = loss_fn_from_config(_ALGORITHMS[name])
    logp = layout["logprobs"].clone().requires_grad_()
    entropy = layout["entropy"] if fn.needs_entropy else None
    batch = micro_batch(layout)  # built outside the count: it reads the layout on the host
    with _CountHostReads() as counter:
        loss, metrics = fn(logp, batch, num_tokens=11, num_sequences=3, entropy_B_T=entropy)
    assert counter.reads == []
    assert "offpolicy_kl_k1" in metrics and "loss" in metrics
    assert float(metrics.get("cov_picked_frac", 1.0)) > 0  # Clip-Cov / KL-Cov picked tokens
    _assert_detached_scalars(metrics)
    assert float(metrics["loss"]) == float(loss.detach())


@pytest.mark.parametrize("name", sorted(_ALGORITHMS))
def test_policy_loss_on_fake_cuda_tensors_reads_and_copies_nothing_from_the_host(name):
    """On fake CUDA tensors a host read raises (a data-dependent output) and a copy from the host is counted."""
    layout = packed(random_seqs(3, [5, 7, 4]), pad=2)
    fn = loss_fn_from_config(_ALGORITHMS[name])
    batch = micro_batch(layout)
    with FakeTensorMode(), _CountHostCopies() as counter:
        logp = _fake_cuda(layout["logprobs"]).requires_grad_()
        entropy = _fake_cuda(layout["entropy"]) if fn.needs_entropy else None
        loss, metrics = fn(logp, _fake_cuda_batch(batch), num_tokens=11, num_sequences=3, entropy_B_T=entropy)
    assert counter.copies == []
    assert loss.device.type == "cuda" and all(v.device.type == "cuda" for v in metrics.values())


def test_aggregate_with_a_zero_count_on_a_device_neither_reads_nor_raises():
    """The zero-count check reads the mask, so it runs on CPU tensors only (its CPU test: test_aggregate.py)."""
    with FakeTensorMode(), _CountHostCopies() as counter:
        loss, mask = _fake_cuda(torch.ones(2, 3)), _fake_cuda(torch.ones(2, 3))
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            aggregate(loss, mask, mode, num_tokens=0, num_sequences=0)
            aggregate(loss, mask, mode, num_tokens=7, num_sequences=2, norm_constant=4.0)
        kto_loss(*(_fake_cuda(torch.zeros(3)) for _ in range(4)), kl=0.25, num_pairs=3)
    assert counter.copies == []


@pytest.mark.parametrize("loss", ["sigmoid", "simpo", "orpo", "kto"])
def test_sft_value_and_preference_losses_on_fake_cuda_tensors_copy_nothing_from_the_host(loss):
    layout = packed(random_seqs(4, [6, 3]), pad=1)
    batch = micro_batch(layout)
    with FakeTensorMode(), _CountHostCopies() as counter:
        fake = {k: _fake_cuda(v) for k, v in layout.items()}
        sft_loss_fn()(fake["logprobs"], _fake_cuda_batch(batch), num_tokens=5, num_sequences=2, entropy_B_T=None)
        value_loss(fake["values"], fake["old_logprobs"], fake["advantages"], fake["loss_mask"])
        names = ("chosen_P", "rejected_P", "chosen_tokens_P", "rejected_tokens_P", "ref_chosen_P", "ref_rejected_P")
        pair = PairLogps(**{name: _fake_cuda(torch.zeros(3, dtype=torch.float64)) for name in names})
        preference_loss(pair, PreferenceConfig(loss=loss), num_pairs=3, num_chosen_tokens=13)
    assert counter.copies == []


def test_the_copy_counter_sees_a_copy_from_the_host():
    with FakeTensorMode(), _CountHostCopies() as counter:
        x = _fake_cuda(torch.ones(3))
        x / torch.as_tensor(3.0, device=x.device)
        x.copy_(torch.ones(3))
    assert counter.copies == ["aten::_to_copy", "aten::copy_"]


def test_sft_and_value_losses_read_nothing_on_the_host():
    layout = packed(random_seqs(4, [6, 3]), pad=1)
    values, batch = layout["values"].clone().requires_grad_(), micro_batch(layout)
    with _CountHostReads() as counter:
        _, sft_metrics = sft_loss_fn()(
            layout["logprobs"], batch, num_tokens=5, num_sequences=2, entropy_B_T=layout["entropy"]
        )
        _, value_metrics = value_loss(values, layout["old_logprobs"], layout["advantages"], layout["loss_mask"])
        _, unclipped_metrics = value_loss(
            values, layout["old_logprobs"], layout["advantages"], layout["loss_mask"], clip_range=None
        )
    assert counter.reads == []
    for metrics in (sft_metrics, value_metrics, unclipped_metrics):
        _assert_detached_scalars(metrics)
    assert float(unclipped_metrics["vf_clip_frac"]) == 0.0


@pytest.mark.parametrize("loss", ["sigmoid", "robust", "hinge", "ipo", "simpo", "orpo", "kto"])
def test_preference_losses_read_nothing_on_the_host(loss):
    g = torch.Generator().manual_seed(5)
    logps = PairLogps(
        chosen_P=-torch.rand(3, generator=g, dtype=torch.float64) * 20,
        rejected_P=-torch.rand(3, generator=g, dtype=torch.float64) * 20,
        chosen_tokens_P=torch.tensor([4.0, 7.0, 2.0], dtype=torch.float64),
        rejected_tokens_P=torch.tensor([5.0, 3.0, 6.0], dtype=torch.float64),
        ref_chosen_P=-torch.rand(3, generator=g, dtype=torch.float64) * 20,
        ref_rejected_P=-torch.rand(3, generator=g, dtype=torch.float64) * 20,
    )
    with _CountHostReads() as counter:
        _, metrics = preference_loss(logps, PreferenceConfig(loss=loss), num_pairs=3, num_chosen_tokens=13)
    assert counter.reads == []
    _assert_detached_scalars(metrics)


def test_the_counter_sees_a_host_read():
    """The check above can fail: float(), bool() and boolean indexing are counted."""
    x = torch.randn(4)
    with _CountHostReads() as counter:
        float(x.sum())
        bool((x > 0).any())
        x[x > 0]
    assert counter.reads.count("aten::_local_scalar_dense") == 2 and len(counter.reads) >= 3


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            st.floats(-1e6, 1e6, width=32),
            st.floats(-1e6, 1e6, width=32).map(lambda v: torch.tensor(v, dtype=torch.float32)),
            st.integers(0, 10**6).map(torch.tensor),
        ),
        max_size=8,
    )
)
def test_floats_of_reads_floats_and_tensors_in_order(values):
    """float64 of each value, as float() of the value itself gives it (float32 widens exactly)."""
    assert floats_of(values) == [float(v) for v in values]


def test_detached_metrics_and_metrics_to_floats():
    x = torch.tensor([2.0, 4.0], requires_grad=True)
    metrics = detached_metrics(mean=x.mean(), count=(x > 3).sum(), constant=0.5)
    _assert_detached_scalars(metrics)
    assert metrics["constant"].dtype == torch.float64
    assert metrics_to_floats(metrics) == {"mean": 3.0, "count": 1.0, "constant": 0.5}
    assert metrics_to_floats({"a": 1.5, "b": torch.tensor(2.5)}) == {"a": 1.5, "b": 2.5}  # a user's floats too
    with pytest.raises(ValueError, match="'pair' must be a scalar"):
        detached_metrics(pair=x.detach())
