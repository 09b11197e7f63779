"""Log-probs and entropy against log_softmax + gather, values and gradients."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.losses import fused_block_shape, fused_token_logprobs, token_entropy, token_logprobs
from rollouts.losses.fused_logprobs import (
    FUSED_FRACTION_OF_LOGITS,
    FUSED_MEMORY_BUDGET_BYTES,
    MIN_TOKEN_CHUNK,
    MIN_VOCAB_BLOCK,
    resolve_matmul_dtype,
)

ALL_TOKENS = 10**6
"""A token chunk larger than any test's token count: one chunk of all tokens."""


def _naive(logits_B_T_V, labels_B_T):
    logp = torch.log_softmax(logits_B_T_V, dim=-1)
    return logp.gather(-1, labels_B_T[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(seed, b=2, t=7, v=13, h=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_token_logprobs_matches_log_softmax_gather(chunk_size):
    hidden, weight, labels = _inputs(0)
    logits = (hidden @ weight.T).requires_grad_()
    g = torch.randn(labels.shape, dtype=logits.dtype)
    ours = token_logprobs(logits, labels, chunk_size=chunk_size)
    (grad_ours,) = torch.autograd.grad((ours * g).sum(), logits)
    ref, _ = _naive(logits, labels)
    (grad_ref,) = torch.autograd.grad((ref * g).sum(), logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, grad_ref)


def test_token_logprobs_float32_and_bfloat16_inputs():
    hidden, weight, labels = _inputs(1, dtype=torch.float32)
    logits = hidden @ weight.T
    ref, _ = _naive(logits, labels)
    torch.testing.assert_close(token_logprobs(logits, labels, chunk_size=4), ref)
    low = logits.bfloat16().requires_grad_()
    out = token_logprobs(low, labels, chunk_size=4)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert low.grad is not None and low.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, _naive(low.float(), labels)[0])


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_token_entropy_matches_naive(chunk_size):
    hidden, weight, labels = _inputs(2)
    logits = (hidden @ weight.T).requires_grad_()
    g = torch.randn(labels.shape, dtype=logits.dtype)
    ours = token_entropy(logits, chunk_size=chunk_size)
    (grad_ours,) = torch.autograd.grad((ours * g).sum(), logits)
    _, ref = _naive(logits, labels)
    (grad_ref,) = torch.autograd.grad((ref * g).sum(), logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, grad_ref)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [1, 5, 100])
@pytest.mark.parametrize("vocab_chunk_size", [None, 1, 4])
def test_fused_matches_naive_with_entropy(temperature, chunk_size, vocab_chunk_size):
    hidden, weight, labels = _inputs(3)
    hidden.requires_grad_()
    weight.requires_grad_()
    g_lp, g_ent = torch.randn(labels.shape, dtype=hidden.dtype), torch.randn(labels.shape, dtype=hidden.dtype)
    lp, ent = fused_token_logprobs(
        hidden,
        weight,
        labels,
        chunk_size=(chunk_size, vocab_chunk_size) if vocab_chunk_size else chunk_size,
        temperature=temperature,
        return_entropy=True,
    )
    ours = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), [hidden, weight])
    ref_lp, ref_ent = _naive(hidden @ weight.T / temperature, labels)
    ref = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), [hidden, weight])
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_fused_float32_grads_and_only_one_output_used():
    hidden, weight, labels = _inputs(4, dtype=torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    _, ent = fused_token_logprobs(hidden, weight, labels, chunk_size=3, return_entropy=True)
    ours = torch.autograd.grad(ent.sum(), [hidden, weight])
    ref = torch.autograd.grad(_naive(hidden @ weight.T, labels)[1].sum(), [hidden, weight])
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    lp = fused_token_logprobs(hidden, weight, labels, chunk_size=3)
    ours = torch.autograd.grad(lp.sum(), [hidden, weight])
    ref = torch.autograd.grad(_naive(hidden @ weight.T, labels)[0].sum(), [hidden, weight])
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_no_tokens_gives_empty_outputs_and_zero_grads():
    hidden, weight, labels = _inputs(8, t=0)
    hidden.requires_grad_()
    weight.requires_grad_()
    lp, ent = fused_token_logprobs(hidden, weight, labels, return_entropy=True)
    assert lp.shape == ent.shape == (2, 0)
    grads = torch.autograd.grad(lp.sum() + ent.sum(), [hidden, weight])
    assert grads[0].shape == hidden.shape and bool((grads[1] == 0).all())


def test_fused_frozen_weight_gets_no_grad():
    hidden, weight, labels = _inputs(5, dtype=torch.float32)
    hidden.requires_grad_()
    fused_token_logprobs(hidden, weight, labels).sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_bad_inputs_raise():
    hidden, weight, labels = _inputs(6)
    with pytest.raises(ValueError, match="labels must lie in"):
        fused_token_logprobs(hidden, weight, labels - 1)
    with pytest.raises(ValueError, match="labels must lie in"):
        token_logprobs(hidden @ weight.T, labels + 13)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden @ weight.T, labels, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        fused_token_logprobs(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="hidden size"):
        fused_token_logprobs(hidden, weight[:, :3], labels)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_token_logprobs(hidden, weight, labels, chunk_size=(4, 0))
    with pytest.raises(ValueError, match=r"a \(C, U\) chunk_size"):
        fused_token_logprobs(hidden, weight, labels, top_k=3, chunk_size=(4, 4))


_floats = st.floats(-30.0, 30.0, allow_nan=False, width=32)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), shift=_floats, chunk_size=st.integers(1, 20))
def test_logprobs_are_shift_invariant(seed, shift, chunk_size):
    hidden, weight, labels = _inputs(seed, dtype=torch.float32)
    logits = hidden @ weight.T
    base = token_logprobs(logits, labels, chunk_size=chunk_size)
    shifted = token_logprobs(logits + shift, labels, chunk_size=chunk_size)
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        token_entropy(logits + shift, chunk_size=chunk_size),
        token_entropy(logits, chunk_size=chunk_size),
        rtol=1e-4,
        atol=1e-4,
    )


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    chunk_a=st.integers(1, 20),
    vocab_chunk=st.integers(1, 20),
    chunk_b=st.integers(1, 20),
    t=st.integers(1, 9),
)
def test_fused_equals_token_logprobs_for_any_block_shape(seed, chunk_a, vocab_chunk, chunk_b, t):
    hidden, weight, labels = _inputs(seed, t=t)
    hidden.requires_grad_()
    weight.requires_grad_()
    fused = fused_token_logprobs(hidden, weight, labels, chunk_size=(chunk_a, vocab_chunk))
    grads_fused = torch.autograd.grad(fused.sum(), [hidden, weight])
    plain = token_logprobs(hidden @ weight.T, labels, chunk_size=chunk_b)
    grads_plain = torch.autograd.grad(plain.sum(), [hidden, weight])
    torch.testing.assert_close(fused, plain)
    for a, b in zip(grads_fused, grads_plain, strict=True):
        torch.testing.assert_close(a, b)


def test_fused_bfloat16_inputs_use_float32_math():
    hidden, weight, labels = _inputs(7, dtype=torch.float32)
    h16, w16 = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    lp, ent = fused_token_logprobs(h16, w16, labels, chunk_size=4, return_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    h32, w32 = h16.detach().float().requires_grad_(), w16.detach().float().requires_grad_()
    ref_lp, ref_ent = _naive(h32 @ w32.T, labels)
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(h16.grad.float(), h32.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w16.grad.float(), w32.grad, rtol=2e-2, atol=2e-2)


# verl's fused-kernel tests accept about 3e-3 on bf16 log-probs. With exact bf16 -> float32
# upcasts and float32 accumulation over H=64 terms, our distance to float64 is ~1e-5; rounding
# the logits (magnitude ~20 here) to bf16, as a bf16 matmul does, costs up to 20 * 2^-8 = 0.08.
_VERL_BF16_ATOL = 3e-3
# The returned gradients are bf16: rounding each element costs at most 2^-8 relative, so the
# relative Frobenius error of a correct computation is <= 2^-8; bf16 logits would add ~5e-2.
_BF16_GRAD_REL = 2.0**-8


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize(("chunk_size", "vocab_chunk_size"), [(5, None), (5, 64), (None, 64)])
def test_fused_bfloat16_matches_float64_reference(temperature, with_entropy, chunk_size, vocab_chunk_size):
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 24, 64, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(700, 64, generator=g) * 1.5).bfloat16().requires_grad_()
    labels = torch.randint(0, 700, (2, 24), generator=g)
    g_lp, g_ent = torch.randn(2, 24, generator=g), torch.randn(2, 24, generator=g)
    out = fused_token_logprobs(
        hidden,
        weight,
        labels,
        chunk_size=(chunk_size or ALL_TOKENS, vocab_chunk_size) if vocab_chunk_size else chunk_size,
        temperature=temperature,
        return_entropy=with_entropy,
    )
    lp, ent = out if with_entropy else (out, None)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    ours = torch.autograd.grad(loss, [hidden, weight])
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_lp, ref_ent = _naive(h64 @ w64.T / temperature, labels)
    ref_loss = (ref_lp * g_lp.double()).sum() + ((ref_ent * g_ent.double()).sum() if with_entropy else 0.0)
    ref = torch.autograd.grad(ref_loss, [h64, w64])
    assert (h64 @ w64.T).abs().max() > 10.0, "logits large enough that bf16 rounding would show"
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=0.0, atol=_VERL_BF16_ATOL)
    if with_entropy:
        torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=0.0, atol=_VERL_BF16_ATOL)
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == torch.bfloat16
        assert float((a.double() - b).norm() / b.norm()) <= _BF16_GRAD_REL


_BF16_U = 2.0**-8
"""bf16's unit roundoff: rounding to bf16 moves a value by at most this fraction of it."""


def _native_case(seed, temperature, with_entropy, device):
    """bf16 inputs with logits up to ~20, the fused outputs and gradients with matmul_dtype=bf16, and a float64 reference."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 24, 64, generator=g).bfloat16().to(device).requires_grad_()
    weight = (torch.randn(700, 64, generator=g) * 1.5).bfloat16().to(device).requires_grad_()
    labels = torch.randint(0, 700, (2, 24), generator=g).to(device)
    g_lp, g_ent = torch.randn(2, 24, generator=g).to(device), torch.randn(2, 24, generator=g).to(device)
    out = fused_token_logprobs(
        hidden, weight, labels, chunk_size=(16, 128), temperature=temperature,
        return_entropy=with_entropy, matmul_dtype=None if device == "cuda" else torch.bfloat16,
    )  # fmt: skip
    lp, ent = out if with_entropy else (out, None)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    ours = torch.autograd.grad(loss, [hidden, weight])
    return hidden, weight, labels, (g_lp, g_ent), (lp, ent), ours


def _reference(hidden, weight, labels, grads_out, temperature, with_entropy, *, round_logits):
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits = h64 @ w64.T
    if round_logits:  # the bf16 product's rounding, with the gradient passing straight through it
        logits = logits + (logits.detach().bfloat16().double() - logits.detach())
    ref_lp, ref_ent = _naive(logits / temperature, labels)
    g_lp, g_ent = (x.double() for x in grads_out)
    ref_loss = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if with_entropy else 0.0)
    return ref_lp.detach(), ref_ent.detach(), torch.autograd.grad(ref_loss, [h64, w64]), logits.detach()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_bf16_matmul_on_cpu_rounds_the_logits_like_a_bf16_matmul(temperature, with_entropy):
    """matmul_dtype=bf16 off CUDA: each block's logits are rounded to bf16 (torch.mm has no float32
    output there), so the log-probs sit within 2 u max|z| / T of exact (the label's logit and the
    log-sum-exp each move by at most u max|z| / T). The gradients match those of the rounded logits
    within 3u: the block of the logits' gradient, the [K, H] operand of dW and the output are each
    rounded once to bf16."""
    hidden, weight, labels, grads_out, (lp, ent), ours = _native_case(3, temperature, with_entropy, "cpu")
    lp, ent = lp.detach(), None if ent is None else ent.detach()
    ref_lp, ref_ent, _, logits = _reference(
        hidden, weight, labels, grads_out, temperature, with_entropy, round_logits=False
    )
    bound = 2 * _BF16_U * float(logits.abs().max()) / temperature
    assert bound > 5e-2, "logits large enough that the rounding shows"
    assert float((lp.double() - ref_lp).abs().max()) <= bound
    if with_entropy:
        assert float((ent.double() - ref_ent).abs().max()) <= 2 * bound  # H = lse - sum p z: two such terms
    _, _, rounded_grads, _ = _reference(hidden, weight, labels, grads_out, temperature, with_entropy, round_logits=True)
    for a, b in zip(ours, rounded_grads, strict=True):
        assert a.dtype == torch.bfloat16
        assert float((a.double() - b).norm() / b.norm()) <= 3 * _BF16_U


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_bf16_on_cuda_multiplies_in_bf16_with_float32_logits(temperature, with_entropy):
    """On CUDA bf16 inputs are multiplied as they are, with float32 accumulation and float32 logits:
    the log-probs are as close to exact as the upcast path's (products of bf16 values are exact in
    float32; only the float32 sums round), and the gradients within 3u of exact (the logits'
    gradient block, dW's [K, H] operand and the output are each rounded once to bf16)."""
    hidden, weight, labels, grads_out, (lp, ent), ours = _native_case(5, temperature, with_entropy, "cuda")
    lp, ent = lp.detach(), None if ent is None else ent.detach()
    assert resolve_matmul_dtype(hidden, weight, None) == torch.bfloat16
    ref_lp, ref_ent, ref_grads, _ = _reference(
        hidden, weight, labels, grads_out, temperature, with_entropy, round_logits=False
    )
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0.0, atol=1e-4)
    if with_entropy:
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0.0, atol=1e-4)
    for a, b in zip(ours, ref_grads, strict=True):
        assert a.dtype == torch.bfloat16
        assert float((a.double() - b).norm() / b.norm()) <= 3 * _BF16_U


def test_matmul_dtype_default_and_refusals():
    h32, w32 = torch.zeros(1, 2, 4), torch.zeros(3, 4)
    h16, w16 = h32.bfloat16(), w32.bfloat16()
    assert resolve_matmul_dtype(h16, w16, None) == torch.float32  # CPU: exact upcast by default
    assert resolve_matmul_dtype(h16, w16, torch.bfloat16) == torch.bfloat16
    assert resolve_matmul_dtype(h32.double(), w32, None) == torch.float64
    for hidden, weight, asked in [(h32, w32, torch.bfloat16), (h16, w32, torch.bfloat16), (h16, w16, torch.float16)]:
        with pytest.raises(ValueError, match="matmul_dtype"):
            resolve_matmul_dtype(hidden, weight, asked)
    labels = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="low-precision matmul_dtype"):
        fused_token_logprobs(h16, w16, labels, top_k=2, matmul_dtype=torch.bfloat16)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 10**7),
    v=st.integers(1, 300_000),
    budget=st.one_of(st.just(FUSED_MEMORY_BUDGET_BYTES), st.integers(1, 2**32)),
)
def test_fused_block_shape_stays_within_budget_and_fraction(n, v, budget):
    c, u = fused_block_shape(n, v, budget_bytes=budget)
    k = max(n, 1)
    assert 1 <= c <= k and 1 <= u <= v
    buffers = 2 * c * u * 4  # the kernel's two float32 C x U buffers
    u_floor, c_floor = min(v, MIN_VOCAB_BLOCK), min(k, MIN_TOKEN_CHUNK)
    assert u >= u_floor and c >= c_floor  # never below the sizes where the matmuls stay efficient
    # within the budget unless both sides are at their floors (a budget below one floor-sized block)
    assert buffers <= budget or (c == c_floor and u == u_floor)
    # within 1/8 of the K x V float32 logits unless U is at its floor
    assert buffers <= k * v * 4 / FUSED_FRACTION_OF_LOGITS or u == u_floor
    # all tokens in one block (W read once per pass) whenever that block fits the budget
    if 2 * k * u * 4 <= budget:
        assert c == k


def test_fused_block_shape_at_qwen_sizes():
    """V=151936: all tokens in one block from 1k to 16k tokens, U = V/16 until the budget binds."""
    v = 151936
    assert fused_block_shape(1024, v) == (1024, v // 16)
    assert fused_block_shape(4096, v) == (4096, v // 16)
    assert fused_block_shape(8192, v) == (8192, FUSED_MEMORY_BUDGET_BYTES // (2 * 4 * 8192))
    assert fused_block_shape(16384, v) == (16384, FUSED_MEMORY_BUDGET_BYTES // (2 * 4 * 16384))


def test_fused_kept_blocks_match_recomputed_ones():
    """A log-probs-only forward over all tokens leaves its last two blocks for the first backward; a
    second backward (retain_graph) recomputes every block: the gradients agree."""
    hidden, weight, labels = _inputs(9, t=6, v=40)
    hidden.requires_grad_()
    weight.requires_grad_()
    g_lp = torch.randn(labels.shape, dtype=hidden.dtype)
    lp = fused_token_logprobs(hidden, weight, labels, chunk_size=(ALL_TOKENS, 7))
    first = torch.autograd.grad((lp * g_lp).sum(), [hidden, weight], retain_graph=True)
    second = torch.autograd.grad((lp * g_lp).sum(), [hidden, weight])
    ref_lp = _naive(hidden @ weight.T, labels)[0]
    ref = torch.autograd.grad((ref_lp * g_lp).sum(), [hidden, weight])
    for a, b, r in zip(first, second, ref, strict=True):
        torch.testing.assert_close(a, r)
        torch.testing.assert_close(b, r)


def test_fused_block_shape_refuses_bad_sizes():
    with pytest.raises(ValueError, match="vocab_size"):
        fused_block_shape(10, 0)
    with pytest.raises(ValueError, match="budget_bytes"):
        fused_block_shape(10, 10, budget_bytes=0)


def _naive_truncated_logprobs(hidden, weight, labels, temperature, top_k, top_p):
    """Softmax over the tokens a top-k-then-top-p sampler keeps, written out row by row."""
    out = []
    for h, label in zip(hidden, labels, strict=True):
        logits = (h @ weight.t()) / temperature
        values = logits.detach().tolist()  # the set is chosen without gradient, as in the sampler
        order = sorted(range(len(values)), key=lambda i: -values[i])
        kept = set(order)
        if 0 < top_k < len(values):
            kth = values[order[top_k - 1]]
            kept = {i for i in kept if values[i] >= kth}
        if top_p < 1.0:
            in_k = [i for i in order if i in kept]
            probs = torch.softmax(logits.detach()[in_k], dim=0)
            mass, survivors = 0.0, set()
            for i, p in zip(in_k, probs.tolist(), strict=True):
                if mass >= top_p:
                    break
                survivors.add(i)
                mass += p
            kept = survivors
        kept.add(int(label))
        idx = torch.tensor(sorted(kept))
        lse = torch.logsumexp(logits[idx], dim=0)
        out.append(logits[int(label)] - lse)
    return torch.stack(out)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_k=st.sampled_from([-1, 1, 3, 7, 40]),
    top_p=st.sampled_from([1.0, 0.95, 0.7, 0.3]),
    temperature=st.sampled_from([1.0, 0.7]),
)
def test_truncated_logprobs_match_the_distribution_a_top_k_top_p_sampler_draws_from(seed, top_k, top_p, temperature):
    """With top_k / top_p the trainer's log-probs are those of the truncated, renormalised
    distribution the sampler drew from (values and gradients), so ratios and KL compare like with like."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 24, (2, 5), generator=g)
    ours = fused_token_logprobs(hidden, weight, labels, temperature=temperature, top_k=top_k, top_p=top_p, chunk_size=3)
    ref = _naive_truncated_logprobs(hidden.reshape(10, 8), weight, labels.reshape(10), temperature, top_k, top_p)
    torch.testing.assert_close(ours.reshape(10), ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(ours.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
