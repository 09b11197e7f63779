"""`fused_token_logprobs(kernel="triton")` against float64: compiled on a CUDA GPU, else in triton's CPU
interpreter (TRITON_INTERPRET=1, which triton reads when a kernel is defined, so it is set here before
the kernels' module is imported). Skips without triton.

Tolerances. Log-probs and entropy: the logits are float32 sums of exact products, summed BLOCK_H at a
time and the partial sums added rounded to nearest, so their error is a random walk of a few float32
ulps of the logits (under 4e-6 at |logits| <= 32); 1e-5, the kernel's goal, at H up to 3584 with
logits as large as a trained LM head's (20 to 30). Gradients, elementwise: the
logits' gradient G is rounded once to the inputs' dtype (unit roundoff u: 2^-8 for bf16) and the
result once more, so |dh - exact| <= u |exact| + u (|G| |W|) (and |dW - exact| likewise with h), plus
1e-5 (|terms| |W|) from G's own float32 arithmetic, relative to the terms G is the sum of (u0 onehot,
u0 p, u1 p |log p + H|): their cancellation can leave G exactly 0 (a vocabulary of one) while float32
leaves a few ulps of them.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # before triton's first import: triton.language's own helpers are defined then
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rollouts.losses import fused_token_logprobs  # noqa: E402
from rollouts.losses.triton_logprobs import default_triton_config  # noqa: E402

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
FLOAT32_SLACK = 1e-5
"""Relative error of G's float32 arithmetic (exp of logits accurate to ~1e-6), with a 10x margin."""
LOGPROB_TOL = 1e-5


def _inputs(k, v, h, dtype, seed=0, logit_std=2.0):
    """Hidden states N(0, 1) and W rows N(0, logit_std^2 / H), so the logits are about N(0, logit_std^2)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, k, h, generator=gen).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * logit_std / h**0.5).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, v, (1, k), generator=gen).to(DEVICE)
    upstream = torch.randn(2, 1, k, generator=gen).to(DEVICE)
    return hidden, weight, labels, upstream


def _exact(hidden, weight, labels, upstream, temperature, with_entropy):
    """float64 log-probs, entropy, dh, dW, |G| (the logits' gradient / temperature) and the size of the
    terms G is made of (/ temperature), on the same inputs.

    G = u0 (onehot - p) + u1 (-p (log p + H)) per logit: its float32 error is relative to those terms'
    magnitudes, not to G, which cancellation can make exactly 0 (one vocabulary entry: p = 1)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.T / temperature
    logits.retain_grad()
    log_p = torch.log_softmax(logits, dim=-1)
    lp = log_p.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    loss = (lp * upstream[0].double()).sum() + ((ent * upstream[1].double()).sum() if with_entropy else 0.0)
    loss.backward()
    assert logits.grad is not None and h.grad is not None and w.grad is not None
    p = log_p.detach().exp()
    onehot = torch.nn.functional.one_hot(labels, p.shape[-1]).double()
    terms = upstream[0].double().abs()[..., None] * (onehot + p)
    if with_entropy:
        terms = terms + upstream[1].double().abs()[..., None] * p * (log_p.detach().abs() + ent.detach()[..., None])
    return lp, ent, h.grad, w.grad, logits.grad.abs() / temperature, terms / temperature


def _check_case(k, v, h, dtype, temperature, with_entropy, seed=0, logit_std=2.0):
    hidden, weight, labels, upstream = _inputs(k, v, h, dtype, seed, logit_std)
    out = fused_token_logprobs(
        hidden, weight, labels, temperature=temperature, return_entropy=with_entropy, kernel="triton"
    )
    lp, ent = out if isinstance(out, tuple) else (out, None)
    loss = (lp * upstream[0]).sum() + ((ent * upstream[1]).sum() if ent is not None else 0.0)
    dh, dw = torch.autograd.grad(loss, [hidden, weight])
    lp_x, ent_x, dh_x, dw_x, abs_g, terms = _exact(hidden, weight, labels, upstream, temperature, with_entropy)
    assert lp.dtype == torch.float32 and lp.shape == labels.shape
    assert float((lp.detach().double() - lp_x).abs().max()) <= LOGPROB_TOL
    if ent is not None:
        assert float((ent.detach().double() - ent_x).abs().max()) <= LOGPROB_TOL
    u = UNIT_ROUNDOFF[dtype]
    w_abs, h_abs = weight.detach().double().abs(), hidden.detach()[0].double().abs()
    for got, exact, spread, float32_spread in (
        (dh, dh_x, abs_g[0] @ w_abs, terms[0] @ w_abs),
        (dw, dw_x, abs_g[0].T @ h_abs, terms[0].T @ h_abs),
    ):
        assert got.dtype == dtype
        bound = u * exact.abs() + u * spread + FLOAT32_SLACK * float32_spread + 1e-12
        excess = (got.double() - exact).abs() - bound
        assert float(excess.max()) <= 0, f"gradient off by {float(excess.max())} beyond its bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("temperature", "with_entropy"), [(1.0, False), (0.7, True), (1.6, False)])
def test_triton_matches_float64_on_odd_sizes(dtype, temperature, with_entropy):
    """K, V and H that are not multiples of the tiles (16 x 32 x 64 in the interpreter's forward, x 16 in its backward)."""
    _check_case(37, 101, 40, dtype, temperature, with_entropy)


@settings(max_examples=8, deadline=None)
@given(
    k=st.integers(1, 40),
    v=st.integers(1, 90),
    h=st.integers(1, 48),
    temperature=st.floats(0.5, 2.0),
    with_entropy=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(k=4, v=1, h=15, temperature=1.0, with_entropy=False, seed=0)  # G = 0 exactly, float32's is not
def test_triton_matches_float64_for_any_shape(k, v, h, temperature, with_entropy, seed):
    _check_case(k, v, h, torch.bfloat16, temperature, with_entropy, seed)


def test_triton_equals_the_torch_kernel():
    """Same inputs, both kernels, float32: equal to float32 rounding, gradients included."""
    hidden, weight, labels, upstream = _inputs(21, 70, 24, torch.float32)
    outs = []
    for kernel in ("torch", "triton"):
        lp, ent = fused_token_logprobs(hidden, weight, labels, return_entropy=True, kernel=kernel)
        grads = torch.autograd.grad((lp * upstream[0] + ent * upstream[1]).sum(), [hidden, weight])
        outs.append((lp, ent, *grads))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_triton_one_output_used_frozen_weight_and_no_tokens():
    hidden, weight, labels, _ = _inputs(19, 50, 16, torch.bfloat16)
    _, ent = fused_token_logprobs(hidden, weight, labels, return_entropy=True, kernel="triton")
    (dh,) = torch.autograd.grad(ent.sum(), [hidden])  # only the entropy, only dh
    _, _, dh_x, _, _, _ = _exact(
        hidden, weight, labels, torch.stack([torch.zeros_like(ent), torch.ones_like(ent)]), 1.0, True
    )
    assert float((dh.double() - dh_x).norm() / dh_x.norm()) < 2 * UNIT_ROUNDOFF[torch.bfloat16]
    frozen = weight.detach()
    fused_token_logprobs(hidden, frozen, labels, kernel="triton").sum().backward()
    assert hidden.grad is not None and frozen.grad is None
    empty = hidden[:, :0].detach().requires_grad_()
    lp, ent = fused_token_logprobs(empty, weight, labels[:, :0], return_entropy=True, kernel="triton")
    assert lp.shape == ent.shape == (1, 0)
    dh0, dw0 = torch.autograd.grad(lp.sum() + ent.sum(), [empty, weight], allow_unused=True)
    assert dw0 is None or not dw0.any()


def test_triton_takes_non_contiguous_hidden():
    hidden, weight, labels, _ = _inputs(18, 40, 16, torch.float32)
    sliced = hidden[:, ::2]
    got = fused_token_logprobs(sliced, weight, labels[:, ::2], kernel="triton")
    want = fused_token_logprobs(sliced, weight, labels[:, ::2], kernel="torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_choice_and_refusals(monkeypatch):
    hidden, weight, labels, _ = _inputs(5, 20, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="kernel must be one of"):
        fused_token_logprobs(hidden, weight, labels, kernel="cuda")
    with pytest.raises(ValueError, match="chunk_size and matmul_dtype"):
        fused_token_logprobs(hidden, weight, labels, chunk_size=4, kernel="triton")
    with pytest.raises(ValueError, match="one dtype"):
        fused_token_logprobs(hidden.double(), weight.double(), labels, kernel="triton")
    with pytest.raises(ValueError, match="top_k / top_p"):
        fused_token_logprobs(hidden, weight, labels, top_k=3, kernel="triton")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 20\)"):
        fused_token_logprobs(hidden, weight, labels + 20, kernel="triton")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            fused_token_logprobs(hidden, weight, labels, kernel="triton")


def test_default_blocks_fit_tl_dot():
    config = default_triton_config(torch.device(DEVICE))
    for blocks in (config.forward, config.backward):
        assert min(blocks.block_k, blocks.block_v, blocks.block_h) >= 16
    # the forward's logits are summed BLOCK_H at a time in float32 (the log-probs' accuracy rests on it)
    assert config.forward.split_accumulation


LM_HEAD_LOGIT_STD = 7.0
"""Logits about N(0, 49): over 20 tokens x a vocabulary of 96 the largest reach 20 to 30, as a trained LM head's do."""


@pytest.mark.parametrize(("h", "with_entropy"), [(896, False), (2048, True), (3584, False)])
def test_triton_within_1e5_of_float64_at_lm_head_scale(h, with_entropy):
    """bf16 inputs at real hidden sizes (H BLOCK_H-wide steps) with logits of 20 to 30: log-probs within
    1e-5 of float64 (the goal), gradients within their rounding bound."""
    hidden, weight, _, _ = _inputs(20, 96, h, torch.bfloat16, 1, LM_HEAD_LOGIT_STD)
    top = float((hidden.detach().double() @ weight.detach().double().T).abs().max())
    assert 20.0 <= top <= 32.0, f"largest |logit| {top}: the case should have an LM head's logits"
    _check_case(20, 96, h, torch.bfloat16, 1.0, with_entropy, 1, LM_HEAD_LOGIT_STD)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (the tensor cores' accumulation)")
@pytest.mark.parametrize(("h", "v"), [(896, 151936), (3584, 152064)])
def test_triton_within_1e5_of_float64_on_cuda_at_real_vocabulary(h, v):
    """The tensor cores' own rounding over all of H and a real vocabulary: max |log p - exact| <= 1e-5."""
    hidden, weight, labels, _ = _inputs(256, v, h, torch.bfloat16, 2, 4.0)
    with torch.no_grad():
        lp = fused_token_logprobs(hidden, weight, labels, kernel="triton")
        exact = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1).gather(-1, labels[..., None])
    assert float((lp.double() - exact.squeeze(-1)).abs().max()) <= LOGPROB_TOL
