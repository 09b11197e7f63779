"""forward_backward's metrics: the loss function's metrics (0-dim tensors from the built-in losses,
floats from a user's) read once after the last backward, averaged over micro-batches weighted by
their loss tokens, exactly as reading each micro-batch's metrics into floats as it ran would."""

from __future__ import annotations

import numpy as np
import torch
from helpers import fresh_components, packed_batch, padded_batch, random_sequences

from rollouts.backends import compute_logprobs, forward_backward
from rollouts.losses import loss_fn_from_config, metrics_to_floats
from rollouts.types import AlgorithmConfig


class _ReadingEachCall:
    """Wraps a loss function, reading each call's metrics into floats (the per-micro-batch way)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.needs_entropy = inner.needs_entropy
        self.read: list[tuple[float, dict[str, float]]] = []

    def __call__(self, logprobs_B_T, batch, **kwargs):
        loss, metrics = self.inner(logprobs_B_T, batch, **kwargs)
        weight = float(max(int((batch.loss_mask > 0).sum()), 1))
        self.read.append((weight, metrics_to_floats(metrics)))
        return loss, metrics


def _micro_batches(components):
    seqs = random_sequences(np.random.default_rng(1), [5, 8, 4, 6])
    batches = [packed_batch(seqs[:2], extra={"advantages": [1.0, -0.5]}), padded_batch(seqs[2:])]
    batches[1] = batches[1].replace(advantages=np.where(batches[1].loss_mask > 0, 0.7, 0.0).astype(np.float32))
    old = compute_logprobs(components, batches)
    return [mb.replace(old_logprobs=lp, rollout_logprobs=lp - 0.05) for mb, lp in zip(batches, old, strict=True)]


def test_step_metrics_equal_the_per_micro_batch_floats():
    components = fresh_components()
    micro_batches = _micro_batches(components)
    num_tokens = int(sum((mb.loss_mask > 0).sum() for mb in micro_batches))
    loss_fn = loss_fn_from_config(AlgorithmConfig(entropy_coef=0.01, is_cap=2.0, kl_coef=0.0))
    reading = _ReadingEachCall(loss_fn)
    torch.manual_seed(0)
    got = forward_backward(components, micro_batches, loss_fn, num_tokens=num_tokens, num_sequences=4)
    components.optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    forward_backward(components, micro_batches, reading, num_tokens=num_tokens, num_sequences=4)
    weight_total = sum(weight for weight, _ in reading.read)
    expected: dict[str, float] = {}
    for weight, metrics in reading.read:
        for key, value in metrics.items():
            expected[key] = expected.get(key, 0.0) + weight * value
    expected = {key: value / weight_total for key, value in expected.items()}
    assert {"entropy", "offpolicy_kl_k1", "is_capped_frac", "clip_frac_low"} <= expected.keys()
    for key, value in expected.items():
        if key != "loss":  # the step's loss is the sum over micro-batches, not their weighted mean
            assert got[key] == value, key
            assert isinstance(got[key], float)
    assert got["loss"] == sum(metrics["loss"] for _, metrics in reading.read)


def test_a_users_loss_may_return_floats_and_tensors():
    components = fresh_components()
    seqs = random_sequences(np.random.default_rng(2), [5, 6])

    def loss_fn(logprobs_B_T, batch, *, num_tokens, num_sequences, entropy_B_T=None):
        loss = -(logprobs_B_T * batch.loss_mask).sum() / num_tokens
        return loss, {"as_float": 1.5, "as_tensor": torch.tensor(2.5), "nll": loss.detach()}

    loss_fn.needs_entropy = False  # type: ignore[attr-defined]
    mb = packed_batch(seqs)
    metrics = forward_backward(components, [mb], loss_fn, num_tokens=int((mb.loss_mask > 0).sum()), num_sequences=2)
    assert metrics["as_float"] == 1.5 and metrics["as_tensor"] == 2.5
    assert metrics["nll"] == metrics["loss"]
