# mypy: disable-error-code="no-untyped-def"
# (the @triton.jit kernels: triton reads their annotations, which may only be tl.constexpr)
"""The Triton kernel behind `fused_token_logprobs(..., kernel="triton")`: log p(label) and entropy of
softmax(h W.T / temperature) with float32 logits, never holding the K x V logits. Needs triton
(the `triton` extra); imported only when that kernel is chosen.

Legend: K flattened tokens, V vocabulary, H hidden, S vocabulary splits, U vocabulary rows per backward block.

Forward: one program per (block of tokens, vocabulary split). It walks its split's vocabulary tiles,
multiplies h and W as they are with float32 accumulation (`tl.dot`: bf16 products are exact in
float32, so the logits are never rounded to bf16), and keeps per token the running max m, the sum
s of exp(x - m), the sum t of exp(x - m) (x - m) (for the entropy) and the label's logit: the
online softmax of Milakov & Gimelshein (2018). A few [S, K] torch ops combine the splits.

Accumulation over H. NVIDIA's tensor cores add each few products into their float32 accumulator
with truncation (rounding toward zero, Fasi et al. 2021), so a logit chained through all of H in
that accumulator is biased toward zero by about half an ulp of its running value per few products:
an error that grows linearly with H and, at the vocabulary's largest logits, reaches the log-probs
in full. The forward therefore takes each BLOCK_H-wide partial product from the tensor cores
started from zero (its truncation is relative to a small partial sum, and of either sign) and adds
it to the float32 logits with a round-to-nearest add (`split_accumulation`). That add is PTX
(`add.rn.f32`): triton's combiner folds a plain `acc + tl.dot(a, b)` back into the chained form.
The backward keeps the chained accumulator: its logits only feed a gradient rounded to bf16.

Backward: for each block of U vocabulary rows, a kernel recomputes the logits tile by tile and
writes G = dL/dlogits / temperature = (g (onehot - p) - g_H p (log p + H)) / temperature into a
[K, U] buffer in the inputs' dtype (rounded once, as a bf16 model's own backward rounds its logits'
gradient); two cuBLAS matmuls then give the block's dW = G.T h (summed over all K tokens in float32,
rounded once) and add G W into a float32 [K, H] accumulator for dh. Unlike a flash-attention
backward, dh and dW are not accumulated in registers: with H in the thousands a [tile, H] float32
accumulator does not fit, and cuBLAS runs those two matmuls near the chip's peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from torch import Tensor

__all__ = ["TritonBlocks", "TritonConfig", "TritonTokenLogprobs", "default_triton_config", "triton_interpreting"]

MIN_BACKWARD_ROWS = 2048
"""Fewest vocabulary rows U per backward block: each block reads and writes the [K, H] float32 dh
accumulator once, so its matmul does U / 4 flops per byte of that traffic; 2048 keeps it
compute-bound on an H100 (about 300 flops per byte of HBM bandwidth). Above that U = 2 H, so the
[K, U] bf16 buffer is about the size of the accumulator: the extra memory stays about 2 K H float32.
With few tokens U grows to MIN_BACKWARD_BYTES instead, so each block's kernels still fill the GPU."""
MIN_BACKWARD_BYTES = 16 * 2**20
"""Smallest [K, U] gradient buffer the backward aims for (U = this / 2 K rows, for K under 4096 at bf16)."""
FORWARD_WAVES = 8
"""Forward programs per streaming multiprocessor to aim for (the vocabulary is split until there
are that many): with one large tile per multiprocessor at a time, a grid of a few waves leaves up to
a wave's worth of multiprocessors idle at its end; eight waves keep that under 1/8."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonBlocks:
    """Tile sizes and launch options of the Triton log-prob kernels."""

    block_k: int
    """tokens per tile (>= 16: tl.dot's smallest)"""
    block_v: int
    """vocabulary rows per tile (>= 16)"""
    block_h: int
    """hidden units per step of the tile's matmul loop (>= 16)"""
    num_warps: int
    num_stages: int
    split_accumulation: bool
    """add each BLOCK_H-wide partial product to the float32 logits with a round-to-nearest float32 add,
    instead of chaining all of H in the tensor cores' truncating accumulator (module docstring)"""


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonConfig:
    """The tiles of the forward kernel and of the backward's logits-gradient kernel."""

    forward: TritonBlocks
    backward: TritonBlocks


_CUDA_CONFIG = TritonConfig(
    # 128 x 128: the partial product and the accumulator, two [128, 128] float32 tiles, fit 8 warps' registers
    forward=TritonBlocks(block_k=128, block_v=128, block_h=64, num_warps=8, num_stages=3, split_accumulation=True),
    # chosen on an H100 among 128 x 128, 128 x 256, 64 x 128 and 128 x 64 tiles with 4 or 8 warps
    backward=TritonBlocks(block_k=128, block_v=256, block_h=64, num_warps=8, num_stages=3, split_accumulation=False),
)
_INTERPRETER_CONFIG = TritonConfig(
    # block_h as on a GPU: the logits are then summed in the same steps
    forward=TritonBlocks(block_k=16, block_v=32, block_h=64, num_warps=4, num_stages=1, split_accumulation=True),
    backward=TritonBlocks(block_k=16, block_v=32, block_h=16, num_warps=4, num_stages=1, split_accumulation=False),
)


def triton_interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read by triton when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_triton_config(device: torch.device) -> TritonConfig:
    """The tiles for `device`: large ones for a GPU, the smallest that tl.dot takes for the interpreter."""
    return _CUDA_CONFIG if device.type == "cuda" else _INTERPRETER_CONFIG


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 operands in full float32 ("ieee"), not tf32, whose 10-bit mantissa would round the logits."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit  # type: ignore[untyped-decorator]
def _add_rn(x, y, PTX: tl.constexpr):
    """x + y in float32, rounded to nearest; as PTX, an add the compiler cannot fold into a tl.dot before it."""
    if PTX:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", constraints="=f,f,f", args=[x, y], dtype=tl.float32, is_pure=True, pack=1
        )
    return x + y


@triton.jit  # type: ignore[untyped-decorator]
def _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, SPLIT: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """[BLOCK_K, BLOCK_V] float32 logits h[rows] W[cols].T / temperature, -inf on columns past the vocabulary."""
    acc = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # exact, and the same float32 products: triton's CPU interpreter multiplies bf16 as raw bits
            a, b = a.to(tl.float32), b.to(tl.float32)
        if SPLIT:
            acc = _add_rn(acc, tl.dot(a, tl.trans(b), input_precision=PRECISION), PTX)
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return tl.where(col_ok[None, :], acc * inv_temp, float("-inf"))


@triton.jit  # type: ignore[untyped-decorator]
def _forward_kernel(h_ptr, w_ptr, labels_ptr, part_ptr, K, V, H, stride_h, stride_w, inv_temp, num_splits,
                    WITH_ENTROPY: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Partials [4, S, K] (max, sum, tilt, picked logit) of this split's vocabulary tiles for one token block."""
    pid_k, split = tl.program_id(0), tl.program_id(1)
    rows = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < K
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    run_max = tl.full((BLOCK_K,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_K,), dtype=tl.float32)
    run_tilt = tl.zeros((BLOCK_K,), dtype=tl.float32)
    picked = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for tile in range(split, tl.cdiv(V, BLOCK_V), num_splits):
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        x = _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                        BLOCK_K, BLOCK_V, BLOCK_H, PRECISION, UPCAST, SPLIT, PTX)  # fmt: skip
        picked += tl.sum(tl.where(cols[None, :] == labels[:, None], x, 0.0), axis=1)
        new_max = tl.maximum(run_max, tl.max(x, axis=1))
        decay = tl.exp(run_max - new_max)  # 0 on the first tile (max -inf)
        z = x - new_max[:, None]
        e = tl.exp(z)
        if WITH_ENTROPY:
            # t re-centred on the new max: decay (t + (m - m') s); (m - m') s is 0, not nan, before the first tile
            shift = tl.where(run_sum > 0, run_max - new_max, 0.0) * run_sum
            run_tilt = decay * (run_tilt + shift) + tl.sum(e * tl.where(col_ok[None, :], z, 0.0), axis=1)
        run_sum = run_sum * decay + tl.sum(e, axis=1)
        run_max = new_max
    out = part_ptr + split * K + rows
    plane = num_splits * K
    tl.store(out, run_max, mask=row_ok)
    tl.store(out + plane, run_sum, mask=row_ok)
    tl.store(out + 2 * plane, run_tilt, mask=row_ok)
    tl.store(out + 3 * plane, picked, mask=row_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _grad_logits_kernel(h_ptr, w_ptr, labels_ptr, lse_ptr, ent_ptr, g_ptr, g_ent_ptr, out_ptr, K, V, H,
                        vocab_start, vocab_end, stride_h, stride_w, stride_out, inv_temp,
                        WITH_ENTROPY: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
                        PTX: tl.constexpr):  # fmt: skip
    """out[k, v - vocab_start] = (g (onehot - p) - g_H p (log p + H)) / temperature for the rows' tokens and this tile."""
    pid_k, pid_v = tl.program_id(0), tl.program_id(1)
    rows = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = vocab_start + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < K
    col_ok = cols < vocab_end
    x = _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                    BLOCK_K, BLOCK_V, BLOCK_H, PRECISION, UPCAST, SPLIT, PTX)  # fmt: skip
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    log_p = x - lse[:, None]
    p = tl.exp(log_p)
    grad = tl.where(cols[None, :] == labels[:, None], g[:, None], 0.0) - g[:, None] * p
    if WITH_ENTROPY:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        grad -= g_ent[:, None] * p * (tl.where(col_ok[None, :], log_p, 0.0) + ent[:, None])
    grad *= inv_temp
    if UPCAST and out_ptr.dtype.element_ty == tl.bfloat16:
        # the interpreter truncates float32 -> bf16; round to nearest even first, as the GPU does
        bits = grad.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        grad = bits.to(tl.float32, bitcast=True)
    dest = out_ptr + rows[:, None] * stride_out + (cols - vocab_start)[None, :]
    tl.store(dest, grad.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _num_splits(num_tokens: int, vocab_size: int, blocks: TritonBlocks, device: torch.device) -> int:
    """Vocabulary splits S so the forward grid fills the GPU; every split gets at least one tile."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    token_blocks = triton.cdiv(max(num_tokens, 1), blocks.block_k)
    wanted = triton.cdiv(FORWARD_WAVES * sms, token_blocks)
    return int(max(1, min(wanted, triton.cdiv(vocab_size, blocks.block_v))))


def _combine(part_4_S_K: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """([K] log p(label), [K] log-sum-exp, [K] entropy or empty) from the splits' partials."""
    max_S_K, sum_S_K, tilt_S_K, picked_S_K = part_4_S_K.unbind(0)
    top_K = max_S_K.amax(dim=0)
    scale_S_K = torch.exp(max_S_K - top_K)  # 0 for a split that saw no tile (max -inf)
    sum_K = (sum_S_K * scale_S_K).sum(dim=0)
    lse_K = top_K + sum_K.log()
    logprobs_K = picked_S_K.sum(dim=0) - lse_K  # one split holds each label's logit, the others 0
    if not with_entropy:
        return logprobs_K, lse_K, sum_K.new_empty(0)
    # each split's t re-centred on the global max; (m_s - M) s_s is 0, not nan, for an empty split
    shift_S_K = torch.where(sum_S_K > 0, (max_S_K - top_K) * sum_S_K, 0.0)
    tilt_K = (scale_S_K * (tilt_S_K + shift_S_K)).sum(dim=0)
    return logprobs_K, lse_K, sum_K.log() - tilt_K / sum_K


def _launch_options(blocks: TritonBlocks, operand: Tensor) -> dict[str, Any]:
    upcast = not operand.is_cuda  # the interpreter
    return {
        "BLOCK_K": blocks.block_k,
        "BLOCK_V": blocks.block_v,
        "BLOCK_H": blocks.block_h,
        "PRECISION": "ieee" if upcast else _dot_precision(operand.dtype),
        "UPCAST": upcast,
        "SPLIT": blocks.split_accumulation,
        "PTX": operand.is_cuda and torch.version.hip is None,  # NVIDIA GPUs (ROCm's are "cuda" devices too)
        "num_warps": blocks.num_warps,
        "num_stages": blocks.num_stages,
    }


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b with float32 accumulation, for a bf16 / fp16 a and b and a float32 acc."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # the interpreter's CPU tensors: exact upcast
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class TritonTokenLogprobs(torch.autograd.Function):
    """([K, H] hidden, [V, H] W, [K] labels) -> ([K] log p(label), [K] entropy or empty), float32, by Triton kernels.

    h and W share one dtype (bf16, fp16 or float32) and are contiguous; labels are valid (checked by the caller).
    The remaining arguments: temperature, with_entropy, and the kernels' TritonConfig.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_K_H: Tensor,
        weight_V_H: Tensor,
        labels_K: Tensor,
        temperature: float,
        with_entropy: bool,
        config: TritonConfig,
    ) -> tuple[Tensor, Tensor]:
        """Per-split partials of the online softmax, combined; saves the [K] log-sum-exp and entropy."""
        ctx.set_materialize_grads(False)
        (n, hid), v, device = hidden_K_H.shape, weight_V_H.shape[0], hidden_K_H.device
        blocks = config.forward
        splits = _num_splits(n, v, blocks, device)
        part_4_S_K = torch.empty(4, splits, n, dtype=torch.float32, device=device)
        if n > 0:
            grid = (triton.cdiv(n, blocks.block_k), splits)
            _forward_kernel[grid](
                hidden_K_H, weight_V_H, labels_K, part_4_S_K, n, v, hid, hidden_K_H.stride(0), weight_V_H.stride(0),
                1.0 / temperature, splits, WITH_ENTROPY=with_entropy, **_launch_options(blocks, hidden_K_H),
            )  # fmt: skip
        logprobs_K, lse_K, entropy_K = _combine(part_4_S_K, with_entropy)
        ctx.save_for_backward(hidden_K_H, weight_V_H, labels_K, lse_K, entropy_K)
        ctx.temperature, ctx.with_entropy, ctx.blocks = temperature, with_entropy, config.backward
        return logprobs_K, entropy_K

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs_K: Tensor | None, grad_entropy_K: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        """dh = G W and dW = G.T h, G the logits' gradient / temperature, block by block of U vocabulary rows."""
        hidden_K_H, weight_V_H, labels_K, lse_K, entropy_K = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_entropy = ctx.with_entropy and grad_entropy_K is not None
        if (grad_logprobs_K is None and not use_entropy) or not (need_h or need_w):
            return None, None, None, None, None, None
        (n, hid), v, device = hidden_K_H.shape, weight_V_H.shape[0], hidden_K_H.device
        f32 = {"dtype": torch.float32, "device": device}
        g_K = grad_logprobs_K.float().contiguous() if grad_logprobs_K is not None else torch.zeros(n, **f32)
        g_ent_K = grad_entropy_K.float().contiguous() if use_entropy and grad_entropy_K is not None else g_K
        grad_acc_K_H = torch.zeros(n, hid, **f32) if need_h else None
        grad_w_V_H = torch.empty_like(weight_V_H) if need_w else None
        if n == 0:
            grad_w_V_H = torch.zeros_like(weight_V_H) if need_w else None
        blocks = ctx.blocks
        wanted = max(MIN_BACKWARD_ROWS, 2 * hid, MIN_BACKWARD_BYTES // max(n * hidden_K_H.element_size(), 1))
        rows = triton.cdiv(min(v, wanted), blocks.block_v) * blocks.block_v
        grad_K_U = torch.empty(n * rows, dtype=hidden_K_H.dtype, device=device)
        for vs in range(0, v if n > 0 else 0, rows):
            ve = min(vs + rows, v)
            block_K_U = grad_K_U[: n * (ve - vs)].view(n, ve - vs)
            grid = (triton.cdiv(n, blocks.block_k), triton.cdiv(ve - vs, blocks.block_v))
            _grad_logits_kernel[grid](
                hidden_K_H, weight_V_H, labels_K, lse_K, entropy_K if use_entropy else lse_K, g_K, g_ent_K, block_K_U,
                n, v, hid, vs, ve,
                hidden_K_H.stride(0), weight_V_H.stride(0), block_K_U.stride(0), 1.0 / ctx.temperature,
                WITH_ENTROPY=use_entropy, **_launch_options(blocks, hidden_K_H),
            )  # fmt: skip
            if grad_w_V_H is not None:
                torch.mm(block_K_U.t(), hidden_K_H, out=grad_w_V_H[vs:ve])
            if grad_acc_K_H is not None:
                _add_matmul(grad_acc_K_H, block_K_U, weight_V_H[vs:ve])
        grad_h_K_H = None if grad_acc_K_H is None else grad_acc_K_H.to(hidden_K_H.dtype)
        return grad_h_K_H, grad_w_V_H, None, None, None, None
