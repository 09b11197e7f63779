"""The autograd Function behind `fused_token_logprobs`: log p(label) and entropy of
softmax(h W.T / temperature) in C x U float32 blocks, never holding the K x V logits.

Legend: K flattened tokens, C tokens per block, V vocabulary, U vocabulary rows per block, H hidden.

Both passes walk W in blocks of U vocabulary rows in the outer loop and the tokens in chunks of C
in the inner one, so each row of W is read (and, for a bf16 W, upcast to float32) once per pass
however many tokens there are, and with C = K each block's weight gradient is one float32 matmul
over all K tokens, written once: no V x H float32 accumulator. The forward keeps, per token, a
running max m, sum s of exp(x - m) and sum t of exp(x - m) (x - m), rescaled whenever a block
raises the max (the online softmax of Milakov & Gimelshein, 2018, extended to the entropy
H = log s - t / s). Backward recomputes each block's logits from the saved [K] log-sum-exp, except
the last two blocks of a log-probs-only forward over all tokens at once: those are still in the
forward's two buffers, so backward starts from them instead of recomputing them.

Operand dtype. By default a bf16 / fp16 hidden and W are upcast exactly to float32 a block at a
time and multiplied in float32. On CUDA that forgoes the tensor cores, so there `matmul_dtype` is
the inputs' own: the products of bf16 operands are accumulated and returned in float32 (cuBLAS's
out_dtype), so the logits are not rounded; backward rounds each C x U block of the logits'
gradient to bf16 before its two matmuls, as a bf16 model's own backward does. Elsewhere (CPU)
a low-precision matmul_dtype rounds each block's logits to bf16 (torch.mm has no float32 output
there), like naive bf16 logits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from rollouts.losses.logprobs import chunks, compute_dtype

__all__ = ["FusedTokenLogprobs"]

_KEPT_BLOCKS = 2
"""Blocks the forward leaves for backward: its two C x U buffers, which the block rule pays for anyway."""


def _scaled(hidden_K_H: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """hidden / temperature in dtype: upcast first, so a bf16 input is divided in float32."""
    h_K_H = hidden_K_H.to(dtype)
    return h_K_H / temperature if temperature != 1.0 else h_K_H


def _mm(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b in float32 (float64 for float64 operands), into `out` when given.

    bf16 / fp16 operands: on CUDA accumulated and returned in float32, never rounded; elsewhere
    the product is rounded to the operands' dtype, then widened.
    """
    wide = out.dtype if out is not None else compute_dtype(a)
    if a.dtype == wide:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=wide, out=out)
    product = torch.mm(a, b)
    return product.to(wide) if out is None else out.copy_(product)


def _block_view(flat: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous [rows, cols] view of the front of a flat buffer (the last blocks are smaller)."""
    return flat[: rows * cols].view(rows, cols)


def _weight_block(weight_V_H: Tensor, start: int, end: int, upcast_U_H: Tensor | None) -> Tensor:
    """W[start:end] in the compute dtype: a view when W already is, else an exact upcast into upcast_U_H."""
    if upcast_U_H is None:
        return weight_V_H[start:end]
    return _block_view(upcast_U_H, end - start, weight_V_H.shape[1]).copy_(weight_V_H[start:end])


def _in_block(labels_C: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
    """(label - start clamped into the block, whether the label lies in [start, end)), without a host sync."""
    offset_C = labels_C - start
    inside_C = (offset_C >= 0) & (offset_C < end - start)
    return offset_C.clamp_(0, end - start - 1), inside_C


class _Running(NamedTuple):
    """Per-token state of the online softmax over the blocks seen so far (views of [K] tensors)."""

    max_C: Tensor
    """running max m of the logits"""
    sum_C: Tensor
    """sum of exp(x - m)"""
    tilt_C: Tensor
    """sum of exp(x - m) (x - m); empty without entropy"""
    picked_C: Tensor
    """the label's logit, once its block has been seen"""


def _absorb_block(x_C_U: Tensor, aux_C_U: Tensor | None, offset_C: Tensor, inside_C: Tensor, run: _Running) -> Tensor:
    """Fold one block of logits into the running state; leaves exp(x - m) in x_C_U (log-probs only)
    or x_C_U * exp(x - m) (with entropy, aux_C_U given); returns the new running max."""
    run.picked_C.copy_(torch.where(inside_C, x_C_U.gather(1, offset_C[:, None]).squeeze(1), run.picked_C))
    new_max_C = torch.maximum(run.max_C, x_C_U.amax(dim=1))
    decay_C = torch.exp(run.max_C - new_max_C)  # 0 on the first block (max -inf)
    x_C_U.sub_(new_max_C[:, None])
    if aux_C_U is not None:
        exp_C_U = torch.exp(x_C_U, out=aux_C_U)
        # t re-centred on the new max: sum e^(x-m')(x-m') = decay (t + log(decay) s); xlogy(0, 0) = 0
        run.tilt_C.mul_(decay_C).add_(torch.xlogy(decay_C, decay_C) * run.sum_C).add_(x_C_U.mul_(exp_C_U).sum(dim=1))
        run.sum_C.mul_(decay_C).add_(exp_C_U.sum(dim=1))
    else:
        run.sum_C.mul_(decay_C).add_(x_C_U.exp_().sum(dim=1))
    run.max_C.copy_(new_max_C)
    return new_max_C


class _GradTargets(NamedTuple):
    """What backward accumulates into, and the [K, H] operands it uses (None where not needed)."""

    acc_K_H: Tensor | None
    """sum over blocks of x @ W_block (dh before the row scale and the label term)"""
    scaled_h_K_H: Tensor | None
    """row_scale * h / temperature: dW_block = x.T @ this + the label rows"""
    label_h_K_H: Tensor | None
    """g h / temperature added onto the label rows; None when it is -scaled_h (row_scale = -g)"""
    labels_K: Tensor
    block_C_U: Tensor | None
    """flat buffer for a block rounded to a low-precision matmul_dtype; None for float32 operands"""


def _add_block_grads(
    x_C_U: Tensor, w_U_H: Tensor, gw_U_H: Tensor | None, rows: tuple[int, int], vs: int, t: _GradTargets
) -> None:
    """Add one block's share of dh (into t.acc_K_H) and dW (into gw_U_H, overwritten on the first rows)."""
    s, e = rows
    if t.block_C_U is not None:  # low-precision operands: the block is rounded once, as a bf16 backward's is
        x_C_U = _block_view(t.block_C_U, e - s, x_C_U.shape[1]).copy_(x_C_U)
    if t.acc_K_H is not None:
        if x_C_U.dtype == t.acc_K_H.dtype:
            t.acc_K_H[s:e].addmm_(x_C_U, w_U_H)
        else:
            t.acc_K_H[s:e].add_(_mm(x_C_U, w_U_H))
    if gw_U_H is not None:
        assert t.scaled_h_K_H is not None  # built whenever dW is needed
        scaled_h_C_H = t.scaled_h_K_H[s:e]
        # the first chunk overwrites the block: its old contents (uninitialised) are ignored
        if x_C_U.dtype == gw_U_H.dtype:
            gw_U_H.addmm_(x_C_U.t(), scaled_h_C_H, beta=0.0 if s == 0 else 1.0)
        elif s == 0:
            _mm(x_C_U.t(), scaled_h_C_H, out=gw_U_H)
        else:
            gw_U_H.add_(_mm(x_C_U.t(), scaled_h_C_H))
        offset_C, inside_C = _in_block(t.labels_K[s:e], vs, vs + gw_U_H.shape[0])
        if t.label_h_K_H is None:  # g h = -(row_scale h) when row_scale = -g
            gw_U_H.index_add_(0, offset_C, (scaled_h_C_H * inside_C[:, None]).to(gw_U_H.dtype), alpha=-1.0)
        else:
            gw_U_H.index_add_(0, offset_C, (t.label_h_K_H[s:e] * inside_C[:, None]).to(gw_U_H.dtype))


class FusedTokenLogprobs(torch.autograd.Function):
    """([K, H] hidden, [V, H] W, [K] labels) -> ([K] log p(label), [K] entropy or empty), in C x U blocks.

    Backward: G = g (onehot - p) - g_H p (log p + H) is never formed beyond one block. Without the
    entropy term the per-token scale -g moves off the C x U block into the [K, H] operands (the
    block is touched only by exp); the onehot part is a gather / index_add of H-vectors.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_K_H: Tensor,
        weight_V_H: Tensor,
        labels_K: Tensor,
        block_shape: tuple[int, int],
        temperature: float,
        with_entropy: bool,
        matmul_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        """Online log-sum-exp (and entropy) over the vocabulary blocks; saves the [K] results (and the last blocks)."""
        ctx.set_materialize_grads(False)
        (n, _), v, device = hidden_K_H.shape, weight_V_H.shape[0], hidden_K_H.device
        dtype = compute_dtype(hidden_K_H, weight_V_H)
        c, u = min(block_shape[0], max(n, 1)), min(block_shape[1], v)
        # low-precision operands: h and W as they are, the temperature applied to each float32 block
        native = matmul_dtype != dtype
        h_K_H = hidden_K_H if native else _scaled(hidden_K_H, temperature, dtype)
        flats = [torch.empty(c * u, dtype=dtype, device=device) for _ in range(2)]
        upcast_w = weight_V_H.dtype != dtype and not native  # W's blocks are upcast before each matmul
        upcast_U_H = torch.empty(u * weight_V_H.shape[1], dtype=dtype, device=device) if upcast_w else None
        max_K = torch.full((n,), -torch.inf, dtype=dtype, device=device)
        sum_K = torch.zeros(n, dtype=dtype, device=device)
        tilt_K = torch.zeros(n if with_entropy else 0, dtype=dtype, device=device)
        picked_K = torch.zeros(n, dtype=dtype, device=device)
        blocks = chunks(v, u)
        keep_from = len(blocks) - _KEPT_BLOCKS if not with_entropy and c >= n > 0 else len(blocks)
        kept: list[tuple[int, int, Tensor, Tensor]] = []  # (start, end, buffer holding exp(x - m), that m)
        for i, (vs, ve) in enumerate(blocks):
            w_U_H = _weight_block(weight_V_H, vs, ve, upcast_U_H)
            flat, aux = (flats[0], flats[1]) if with_entropy else (flats[i % 2], None)
            for s, e in chunks(n, c):
                x_C_U = _mm(h_K_H[s:e], w_U_H.t(), out=_block_view(flat, e - s, ve - vs))
                if native and temperature != 1.0:
                    x_C_U.div_(temperature)
                run = _Running(max_K[s:e], sum_K[s:e], tilt_K[s:e], picked_K[s:e])
                aux_C_U = None if aux is None else _block_view(aux, e - s, ve - vs)
                new_max_C = _absorb_block(x_C_U, aux_C_U, *_in_block(labels_K[s:e], vs, ve), run)
            if i >= keep_from:
                kept.append((vs, ve, flat, new_max_C))
        log_sum_K = sum_K.log()
        lse_K = max_K + log_sum_K
        entropy_K = log_sum_K - tilt_K / sum_K if with_entropy else tilt_K
        ctx.save_for_backward(hidden_K_H, weight_V_H, labels_K, lse_K, entropy_K)
        ctx.block_shape, ctx.temperature, ctx.with_entropy = (c, u), temperature, with_entropy
        ctx.matmul_dtype = matmul_dtype
        ctx.kept_blocks = kept if any(ctx.needs_input_grad[:2]) else []
        return picked_K - lse_K, entropy_K

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs_K: Tensor | None, grad_entropy_K: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None, None]:
        """dh = G W / temperature and dW = G.T (h / temperature), block by block from the recomputed logits."""
        hidden_K_H, weight_V_H, labels_K, lse_K, entropy_K = ctx.saved_tensors
        kept, ctx.kept_blocks = ctx.kept_blocks, []  # used once: a second backward recomputes them
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_entropy = ctx.with_entropy and grad_entropy_K is not None
        if (grad_logprobs_K is None and not use_entropy) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        (n, hid), v, device, temperature = hidden_K_H.shape, weight_V_H.shape[0], hidden_K_H.device, ctx.temperature
        if n == 0:
            grad_h = torch.zeros_like(hidden_K_H) if need_h else None
            return grad_h, (torch.zeros_like(weight_V_H) if need_w else None), None, None, None, None, None
        dtype = compute_dtype(hidden_K_H, weight_V_H)
        c, u = ctx.block_shape
        native = ctx.matmul_dtype != dtype
        h_K_H = _scaled(hidden_K_H, temperature, dtype)
        g_K = grad_logprobs_K.to(dtype) if grad_logprobs_K is not None else torch.zeros(n, dtype=dtype, device=device)
        # G = row_scale * x + g onehot, with x = p (log-probs only) or p (g + g_H (log p + H)) (with entropy)
        row_scale_K1 = torch.full((n, 1), -1.0, dtype=dtype, device=device) if use_entropy else -g_K[:, None]
        operand = ctx.matmul_dtype  # the [K, H] operands of dW's matmuls are in it
        targets = _GradTargets(
            acc_K_H=torch.zeros(n, hid, dtype=dtype, device=device) if need_h else None,
            scaled_h_K_H=(h_K_H * row_scale_K1).to(operand) if need_w else None,
            label_h_K_H=(h_K_H * g_K[:, None]).to(operand) if need_w and use_entropy else None,
            labels_K=labels_K,
            block_C_U=torch.empty(c * u, dtype=operand, device=device) if native else None,
        )
        # the logits' recomputation multiplies h as forward did: unscaled in its own dtype, or h / temperature
        logits_h_K_H = hidden_K_H if native else h_K_H
        del h_K_H
        grad_w_V_H = torch.empty_like(weight_V_H) if need_w else None  # every block written by its first chunk
        low_precision = weight_V_H.dtype != dtype
        upcast_w = low_precision and not native  # as in forward
        upcast_U_H = torch.empty(u * hid, dtype=dtype, device=device) if upcast_w else None
        # float32 block gradient for a bf16 W: summed over all tokens in float32, rounded to bf16 once
        grad_block = torch.empty(u * hid, dtype=dtype, device=device) if need_w and low_precision else None

        def block_grad(vs: int, ve: int) -> Tensor | None:
            if grad_w_V_H is None:
                return None
            return grad_w_V_H[vs:ve] if grad_block is None else _block_view(grad_block, ve - vs, hid)

        def finish_block(vs: int, ve: int, gw_U_H: Tensor | None) -> None:
            if grad_w_V_H is not None and gw_U_H is not None and grad_block is not None:
                grad_w_V_H[vs:ve] = gw_U_H  # one rounding to W's dtype

        flat = kept[0][2] if kept else torch.empty(c * u, dtype=dtype, device=device)
        kept_starts = {vs for vs, *_ in kept}
        while kept:  # log-probs only, all tokens in one chunk: p = exp(x - m) * exp(m - lse)
            vs, ve, kept_flat, kept_max_K = kept.pop()
            p_K_U = _block_view(kept_flat, n, ve - vs).mul_(torch.exp(kept_max_K - lse_K)[:, None])
            gw_U_H = block_grad(vs, ve)
            _add_block_grads(p_K_U, _weight_block(weight_V_H, vs, ve, upcast_U_H), gw_U_H, (0, n), vs, targets)
            finish_block(vs, ve, gw_U_H)
        aux = torch.empty_like(flat) if use_entropy else None
        for vs, ve in chunks(v, u):
            if vs in kept_starts:
                continue
            w_U_H = _weight_block(weight_V_H, vs, ve, upcast_U_H)
            gw_U_H = block_grad(vs, ve)
            for s, e in chunks(n, c):
                x_C_U = _mm(logits_h_K_H[s:e], w_U_H.t(), out=_block_view(flat, e - s, ve - vs))
                if native and temperature != 1.0:
                    x_C_U.div_(temperature)
                x_C_U.sub_(lse_K[s:e, None])  # log p
                if aux is not None:
                    assert grad_entropy_K is not None  # use_entropy
                    p_C_U = torch.exp(x_C_U, out=_block_view(aux, e - s, ve - vs))
                    g_ent_C1 = grad_entropy_K[s:e, None].to(dtype)
                    x_C_U.add_(entropy_K[s:e, None]).mul_(g_ent_C1).add_(g_K[s:e, None]).mul_(p_C_U)
                else:
                    x_C_U.exp_()  # p
                _add_block_grads(x_C_U, w_U_H, gw_U_H, (s, e), vs, targets)
            finish_block(vs, ve, gw_U_H)
        grad_h_K_H = None
        if targets.acc_K_H is not None:
            # G @ W = row_scale * sum_blocks(x @ W) + g W[label]
            grad_h_K_H = targets.acc_K_H.mul_(row_scale_K1).add_(weight_V_H[labels_K].to(dtype) * g_K[:, None])
            if temperature != 1.0:
                grad_h_K_H.div_(temperature)
            grad_h_K_H = grad_h_K_H.to(hidden_K_H.dtype)
        return grad_h_K_H, grad_w_V_H, None, None, None, None, None
