"""On a CUDA GPU: the fused log-prob kernel beside naive, and GRPO training steps with FSDP2 + bf16.

Sections (`--sections`, all by default; each prints a table):

logprobs  `fused_token_logprobs` against naive log_softmax(h @ W.T).gather, forward + backward of
          sum(g * log p) for a random upstream gradient g, at Qwen2-0.5B's output layer (H=896,
          V=151936) and Qwen2-7B's (H=3584, V=152064), 1k to 32k tokens. Naive in bf16 is what
          bf16 models do: a bf16 matmul, the [K, V] logits upcast to float32 for the softmax. Fused
          (kernel="torch") runs with its default operands (on CUDA, bf16 inputs multiplied as they
          are, float32 accumulation and logits) and, for bf16, with matmul_dtype=float32 (exact
          upcast, as on CPU) for comparison; triton is kernel="triton" (the default on CUDA for
          bf16 / fp16); triton-chained is the same kernel with its forward summing all of H in the
          tensor cores' accumulator (128 x 256 tiles, no split accumulation), and triton-h128 with
          the split every 128 of H instead of 64 (half the float32 adds; the "logits" line gives
          both slices' error), for bf16; `--hidden 3584` and `--logprob-variants triton,triton-h128`
          keep those shapes and variants (naive always runs: the ratios' base); liger is
          Liger's fused linear cross-entropy (reduction="none", log p = -loss), when liger_kernel
          is installed.
          - time: CUDA events around forward + backward, median of `--repeats` after a warm-up;
          - memory beyond inputs: torch.cuda.max_memory_allocated during the step, less the memory
            allocated before it and the bytes every variant returns (dh, dW, the [K] log-probs);
          - error: on the first 256 tokens, max |log p - exact| and ||dh - exact|| / ||exact||,
            exact being float64 on the same bf16 / float32 inputs;
          - for bf16 on CUDA, a line "logits" before the rows: max |logit - exact| over those tokens'
            [256, V] logits from one cuBLAS bf16 matmul with float32 output (all of H in the tensor
            cores' accumulator) and from the same summed over H in slices of 64 (float32 adds).
train     `rl_step` (advantages, packing into micro-batches of 8192 tokens, forward + backward with
          the fused log-probs over the response positions, grad-norm clip, AdamW) on a random-init
          model of Qwen2-0.5B's shape (494M parameters), 64 samples x 1024 tokens (256 prompt +
          768 response) per step, each variant in its own process:
          - fsdp2-bf16: FSDP2 (`shard_model`, one rank) with bf16 compute, float32 master weights
            and gradient reduction (MixedPrecisionPolicy), the library's AdamW (`build_optimizer`:
            torch's multi-tensor kernels for sharded weights on CUDA);
          - fsdp2-fp32: FSDP2 in float32 throughout;
          - bf16: the unsharded model in bf16 (what `dtype = "bfloat16"` on one device gives), the
            library's AdamW (torch's fused kernel for plain weights on CPU or CUDA);
          - a suffix -compile (bf16-compile, fsdp2-bf16-compile): each decoder layer compiled
            (`compile_layers`, the run file's `model.compile = "layers"`);
          - bf16-compile-graphs: each decoder layer compiled with mode="reduce-overhead" (its forward
            and backward replayed as CUDA graphs: the launches of a layer become one; the bench's
            micro-batches all have the same shape);
          - fsdp2-bf16-gathered (also with -compile): `shard_model(gather_once_per_step=True)`, each
            layer gathered once per step and its gradients reduced once, not per micro-batch;
          - trl, trl-compile, liger: the peer steps of train_peers.py on the same model and batch (HF
            forward + TRL's selective_log_softmax over logits_to_keep; the same with regional
            compilation; HF decoder + liger_kernel's fused linear cross-entropy, "not installed"
            without it), torch's fused AdamW, the same clipping;
          - a suffix -loop-adam, -foreach-adam or -fused-adam (e.g. bf16-loop-adam) swaps in that
            implementation of torch's AdamW; -loop-adam is the AdamW the library used before (the norm
            and clipping stay the library's).
          Step time (median of `--steps` after 2 warm-up steps), its forward + backward and
          optimizer parts, tokens per second, peak GPU memory, and 6 N tokens / time (N the
          parameter count) as a rough model TFLOP/s; `compile s`: the first step's time less the
          median (the compile time, for compiled variants). `--micro-tokens` sets the micro-batch size.
grpo      whole GRPO steps on the GPU: the in-process sampler (sharing the trained bf16 model)
          generates 8 prompts x 8 completions x 128 new tokens from 64-token prompts, then
          `rl_step` trains on them; generate and train times, median of `--steps` after 1 warm-up.

Measured 2026-11-26 on one NVIDIA H200 (torch 2.11.0+cu130, transformers 5.17):

logprobs: the table in packages/rollouts-losses/README.md ("On a CUDA GPU"): fused at 1.4-1.9x
naive's time from 4k tokens and 1/10 to 1/60 of its memory; matmul_dtype=float32 7.8-14x.

train (--steps 4):
                   variant   step ms fwd+bwd ms  optim ms  other ms   tokens/s 6N tok/s TF  peak GiB
                fsdp2-bf16    1943.5     1830.9     107.8       4.9      33721       100.0     19.15
     fsdp2-bf16-fused-adam    2081.2     1903.4     165.7      12.1      31489        93.3     19.15  (*)
                fsdp2-fp32    5772.8     5635.0     120.9      17.0      11352        33.7     40.51
                       bf16    1105.8     1057.2      42.2       6.3      59268       175.7     15.22
(*) Not the fused kernel: the variant rebuilt AdamW from the first optimizer's param groups, which
carry its fused=None / foreach=False, so this row ran the per-tensor loop too (now fixed).
A second machine gave fsdp2-bf16 1620.5 ms and bf16 978.6 ms (--steps 2). Under torch.profiler one
step kept the GPU busy 0.80 s (FSDP2) and 0.75 s (bf16) of it: the step is bound by the host's
launches and syncs (about 3,000 kernels per 8k-token micro-batch; FSDP2 adds its per-layer
casts and copies), not by the GPU's arithmetic.

train --micro-tokens 32768 (two micro-batches per step, --steps 3, a third machine):
                   variant   step ms fwd+bwd ms  optim ms  other ms   tokens/s 6N tok/s TF  peak GiB
                bf16@32768     944.0      914.8      25.4       3.8      69426       205.8     47.16
          fsdp2-bf16@32768    1016.7      936.3      74.2       6.2      64457       191.1     51.07
FSDP2's cost is per micro-batch (each gathers every layer in forward and again in backward, and
reduces the gradients): with 4x fewer micro-batches it falls from 1.65-1.76x the unsharded step to
1.08x. On one device the library trains unsharded anyway (FSDP2 only under torchrun with more than
one rank); on several, micro-batches as large as memory allows pay.

The optimizer rows above used the per-tensor AdamW loop (now the -loop-adam variants); the
library's AdamW is now torch's fused kernel (plain weights) or its foreach kernels (FSDP2), and
the norm and clipping use the foreach kernels (--steps 3, two more machines):
                   variant   step ms fwd+bwd ms  optim ms  other ms   tokens/s 6N tok/s TF  peak GiB
                      bf16     906.1      895.1       8.2       2.8      72326       214.4     15.23
            bf16-loop-adam     944.0      906.0      30.1       7.9      69427       205.8     15.22
                fsdp2-bf16    1424.9     1393.9      17.2      13.8      45992       136.3     19.15
      fsdp2-bf16-loop-adam    1680.6     1568.7     107.0       4.9      38995       115.6     19.15
and, on the second of them: fsdp2-bf16 optim 26.2 ms, fsdp2-bf16-fused-adam 13.3 ms,
fsdp2-bf16-loop-adam 78.8 ms (its forward + backward varied 1143-1420 ms between processes: the
host-bound part is noisy; the optimizer part is the figure to compare).

grpo (--steps 3, the third machine of the 2026-11-26 runs): generate 1435.6 ms (5706 new tokens/s; 128
decode steps of 64 rows, about 11 ms each, bound by the host's launches at this model size),
train 211.4 ms.

Measured 2026-11-27 on one NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, transformers 5.17, triton 3.6,
liger-kernel 0.8.5; the log-probs on the Triton kernel, `kernel="auto"`), train --steps 3, one run
with the peer steps beside ours:
                   variant   step ms fwd+bwd ms  optim ms  other ms   tokens/s 6N tok/s TF  peak GiB compile s
                       trl     904.2      892.6       9.3       2.3      72480       214.8     17.81       2.1
               trl-compile     642.3      632.2       9.2       0.8     102038       302.5     14.72       9.7
                     liger    1219.3     1209.0       8.4       1.8      53750       159.3     14.70       2.0
                      bf16     963.0      948.5       9.0       5.5      68052       201.7     14.71       1.7
              bf16-compile     668.0      652.8       8.9       6.3      98112       290.8     11.61       2.5
                fsdp2-bf16    1503.4     1468.4      26.0       9.0      43590       129.2     18.66       2.9
and just after it, on the same machine: fsdp2-bf16-compile 1321.4 ms, bf16-compile 738.2 ms (the
same variant 10% slower than in the first run: compare rows of one run only). The library's step is
0.94x the TRL-style step's speed eager and 0.96x compiled; regional compilation gives it 1.44x;
FSDP2 on one rank costs 1.56x the unsharded step at 8k-token micro-batches (1.79x compiled).

logprobs (--repeats 3, the same machine): the table in packages/rollouts-losses/README.md ("The
Triton kernel"): at H=896 the Triton kernel runs 0.68-0.74x naive's time from 4k tokens with 1.6x
Liger's extra memory and log-prob errors of 3.4e-6 to 4.8e-6 against float64; at H=3584 1.15x
(4k) and 1.29x (16k) naive's time (32k was cut by the section's time limit).

Run: python benchmarks/bench_cuda.py [--sections logprobs,train] [--repeats 5] [--steps 5] [--quick]
(`--quick`: small sizes, to check the script itself; on a machine without CUDA it runs the
same code on the CPU with gloo, which says nothing about speed.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from train_peers import PEERS, batch_tensors, peer_step_fn

GIB = 2.0**30
LOGPROB_SHAPES = {  # (H, V): token counts, by dtype
    (896, 151936): {torch.bfloat16: (1024, 4096, 16384, 32768), torch.float32: (1024, 4096, 16384)},
    (3584, 152064): {torch.bfloat16: (4096, 16384, 32768), torch.float32: ()},
}
QUICK_SHAPES = {(64, 1000): {torch.bfloat16: (64, 256), torch.float32: (64,)}}
TRAIN_VARIANTS = (
    "trl", "trl-compile", "liger", "bf16", "bf16-compile", "fsdp2-bf16", "fsdp2-bf16-loop-adam", "bf16-loop-adam",
    "fsdp2-fp32",
)  # fmt: skip
ADAMW_SUFFIXES = {"-loop-adam": {"foreach": False}, "-foreach-adam": {"foreach": True}, "-fused-adam": {"fused": True}}
CHECK_TOKENS = 256


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Timer:
    """Elapsed seconds of a region: CUDA events on a GPU, perf_counter otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> _Timer:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


# ---------------------------------------------------------------- log-probs


def _naive(hidden_K_H: torch.Tensor, weight_V_H: torch.Tensor, labels_K: torch.Tensor) -> torch.Tensor:
    logits_K_V = hidden_K_H @ weight_V_H.T
    return torch.log_softmax(logits_K_V.float(), dim=-1).gather(-1, labels_K[:, None]).squeeze(-1)


def _fused(matmul_dtype: torch.dtype | None, kernel: str = "torch"):
    from rollouts.losses import fused_token_logprobs

    def run(hidden_K_H: torch.Tensor, weight_V_H: torch.Tensor, labels_K: torch.Tensor) -> torch.Tensor:
        out = fused_token_logprobs(
            hidden_K_H[None], weight_V_H, labels_K[None], matmul_dtype=matmul_dtype, kernel=kernel
        )
        assert isinstance(out, torch.Tensor)
        return out[0]

    return run


def _liger():
    """Liger's fused linear cross-entropy with reduction="none" (log p = -loss), or None if not installed."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None

    def run(hidden_K_H: torch.Tensor, weight_V_H: torch.Tensor, labels_K: torch.Tensor) -> torch.Tensor:
        loss = liger_fused_linear_cross_entropy(hidden_K_H, weight_V_H, labels_K, reduction="none")
        return -(loss[0] if isinstance(loss, tuple) else loss)

    return run


def _triton_forward(forward_blocks: dict) -> Callable:
    """kernel="triton" with these forward tiles (TritonBlocks' fields) and the default backward."""
    from rollouts.losses.triton_logprobs import TritonBlocks, TritonConfig, TritonTokenLogprobs, default_triton_config

    backward = default_triton_config(torch.device("cuda")).backward
    config = TritonConfig(forward=TritonBlocks(**forward_blocks), backward=backward)

    def run(hidden_K_H: torch.Tensor, weight_V_H: torch.Tensor, labels_K: torch.Tensor) -> torch.Tensor:
        return TritonTokenLogprobs.apply(hidden_K_H, weight_V_H, labels_K, 1.0, False, config)[0]

    return run


TRITON_FORWARDS = {
    # the forward's logits chained through all of H in the tensor cores' accumulator (no split accumulation)
    "triton-chained": {"block_k": 128, "block_v": 256, "block_h": 64, "num_warps": 8, "num_stages": 3,
                       "split_accumulation": False},
    # split accumulation every 128 of H, not 64: half the round-to-nearest adds, twice the chained run
    "triton-h128": {"block_k": 128, "block_v": 128, "block_h": 128, "num_warps": 8, "num_stages": 2,
                    "split_accumulation": True},
}  # fmt: skip


def _logit_errors(hidden_K_H: torch.Tensor, weight_V_H: torch.Tensor, slice_h: int = 64) -> tuple[float, float]:
    """max |logit - exact| on the first CHECK_TOKENS tokens: one bf16 matmul with float32 output, and the
    same summed over H in slices of slice_h with float32 adds (the two accumulations of the Triton forward)."""
    h_C_H, w_V_H = hidden_K_H[:CHECK_TOKENS].detach(), weight_V_H.detach()
    exact_C_V = h_C_H.double() @ w_V_H.double().T
    chained_C_V = torch.mm(h_C_H, w_V_H.T, out_dtype=torch.float32)
    split_C_V = torch.zeros_like(chained_C_V)
    for k0 in range(0, h_C_H.shape[1], slice_h):
        split_C_V += torch.mm(h_C_H[:, k0 : k0 + slice_h], w_V_H[:, k0 : k0 + slice_h].T, out_dtype=torch.float32)
    return float((chained_C_V.double() - exact_C_V).abs().max()), float((split_C_V.double() - exact_C_V).abs().max())


def _triton_available(device: torch.device) -> bool:
    import importlib.util

    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def _exact(hidden_K_H, weight_V_H, labels_K, g_K):
    """float64 log-probs and dh of the first CHECK_TOKENS tokens (token t's dh depends on token t alone)."""
    h = hidden_K_H[:CHECK_TOKENS].detach().double().requires_grad_()
    lp = torch.log_softmax(h @ weight_V_H.detach().double().T, dim=-1).gather(-1, labels_K[:CHECK_TOKENS, None])
    lp = lp.squeeze(-1)
    (grad_h,) = torch.autograd.grad((lp * g_K[:CHECK_TOKENS].double()).sum(), [h])
    return lp.detach(), grad_h


def logprob_case(fn, hidden, weight, labels, g, repeats: int, exact) -> dict[str, float]:
    device = hidden.device
    times, peak_beyond = [], 0.0
    lp = None
    for i in range(repeats + 1):
        hidden.grad = weight.grad = None
        lp = None
        _sync()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with _Timer(device) as timer:
            lp = fn(hidden, weight, labels)
            (lp * g).sum().backward()
        if device.type == "cuda":
            returned = hidden.grad.nbytes + weight.grad.nbytes + lp.nbytes
            peak_beyond = (torch.cuda.max_memory_allocated() - base - returned) / GIB
        if i > 0:  # the first is the warm-up
            times.append(timer.seconds)
    assert lp is not None and hidden.grad is not None
    exact_lp, exact_dh = exact
    lp_err = float((lp[:CHECK_TOKENS].detach().double() - exact_lp).abs().max())
    dh = hidden.grad[:CHECK_TOKENS].double()
    dh_err = float((dh - exact_dh).norm() / exact_dh.norm())
    return {"ms": 1e3 * statistics.median(times), "beyond_gib": peak_beyond, "lp_err": lp_err, "dh_rel": dh_err}


def section_logprobs(
    device: torch.device, repeats: int, quick: bool, hidden_sizes: set[int], only: set[str]
) -> list[dict]:
    """The table; `hidden_sizes` / `only` (when not empty) keep those shapes' H / those variants (naive always)."""
    only = only | {"naive"} if only else only
    rows = []
    print("\n== log-probs: forward + backward of sum(g log p), naive vs fused")
    print(
        f"{'H':>5} {'V':>7} {'dtype':>9} {'K':>6} {'variant':>14} {'ms':>9} {'beyond GiB':>11} "
        f"{'x naive ms':>10} {'x naive mem':>11} {'|lp err|':>9} {'dh rel err':>10}"
    )
    for (hid, vocab), by_dtype in (QUICK_SHAPES if quick else LOGPROB_SHAPES).items():
        if hidden_sizes and hid not in hidden_sizes:
            continue
        for dtype, sizes in by_dtype.items():
            for k in sizes:
                gen = torch.Generator(device="cpu").manual_seed(k + hid)
                hidden = torch.randn(k, hid, generator=gen).to(device, dtype).requires_grad_()
                weight = (torch.randn(vocab, hid, generator=gen) * hid**-0.5 * 4).to(device, dtype).requires_grad_()
                labels = torch.randint(0, vocab, (k,), generator=gen).to(device)
                g = torch.randn(k, generator=gen).to(device)
                exact = _exact(hidden, weight, labels, g)
                variants = [("naive", _naive), ("fused", _fused(None))]
                if dtype != torch.float32:
                    variants.append(("fused-upcast", _fused(torch.float32)))
                variants.append(("triton", _fused(None, "triton") if _triton_available(device) else None))
                if dtype == torch.bfloat16 and _triton_available(device):
                    variants += [(name, _triton_forward(blocks)) for name, blocks in TRITON_FORWARDS.items()]
                    chained, split = _logit_errors(hidden, weight)
                    _, split128 = _logit_errors(hidden, weight, slice_h=128)
                    print(f"{hid:>5} {vocab:>7} {str(dtype)[6:]:>9} {k:>6} {'logits':>14}  max |error|: "
                          f"cuBLAS bf16 -> float32 {chained:.1e}, summed over H in slices of 64 {split:.1e}, "
                          f"of 128 {split128:.1e}")  # fmt: skip
                variants.append(("liger", _liger() if device.type == "cuda" else None))
                base = None
                for name, fn in variants:
                    if only and name not in only:
                        continue
                    if fn is None:
                        reason = "not installed" if device.type == "cuda" else "needs CUDA"
                        print(f"{hid:>5} {vocab:>7} {str(dtype)[6:]:>9} {k:>6} {name:>14}  {reason}")
                        continue
                    try:
                        r = logprob_case(fn, hidden, weight, labels, g, repeats, exact)
                    except torch.OutOfMemoryError:
                        print(f"{hid:>5} {vocab:>7} {str(dtype)[6:]:>9} {k:>6} {name:>14}  out of memory")
                        torch.cuda.empty_cache()
                        continue
                    except (
                        Exception
                    ) as e:  # a peer's API refusing the case, or a kernel failing to compile (triton's own errors)
                        print(f"{hid:>5} {vocab:>7} {str(dtype)[6:]:>9} {k:>6} {name:>14}  failed: {e!r:.120}")
                        continue
                    if name == "naive":
                        base = r
                    ratio_t = r["ms"] / base["ms"] if base else float("nan")
                    ratio_m = r["beyond_gib"] / base["beyond_gib"] if base and base["beyond_gib"] > 0 else float("nan")
                    print(
                        f"{hid:>5} {vocab:>7} {str(dtype)[6:]:>9} {k:>6} {name:>14} {r['ms']:9.2f} "
                        f"{r['beyond_gib']:11.3f} {ratio_t:10.2f} {ratio_m:11.3f} {r['lp_err']:9.1e} {r['dh_rel']:10.1e}",
                        flush=True,
                    )
                    rows.append({"H": hid, "V": vocab, "dtype": str(dtype), "K": k, "variant": name, **r})
                del hidden, weight, labels, g, exact
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- training steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(quick: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if quick:
        config = Qwen2Config(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        )  # fmt: skip
    else:  # Qwen2-0.5B's shape
        config = Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
        )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def _batch(vocab: int, samples: int, prompt: int, response: int, group: int):
    from rollouts.types import LossMask, RolloutBatch, Sample, Status

    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(samples):
        ids = torch.randint(0, vocab, (prompt + response,), generator=gen).tolist()
        lps = (-torch.rand(response, generator=gen) * 3).tolist()
        out.append(
            Sample(
                tokens=ids, num_prompt_tokens=prompt, loss_mask=LossMask.prompt_response(prompt, response),
                rollout_logprobs=lps, status=Status.COMPLETED, reward=float(torch.rand(1, generator=gen)),
                group_index=i // group,
            )
        )  # fmt: skip
    return RolloutBatch(samples=tuple(out), step=1)


def train_worker(variant: str, steps: int, quick: bool, profile: str = "", micro_tokens: int = 0) -> dict:
    """One variant in this process; returns its figures."""
    import dataclasses

    import rollouts.backends.train.step as train
    import rollouts.loops.rl.step as policy_update
    from rollouts.backends import build_components, build_optimizer, build_scheduler
    from rollouts.backends.train.components import TrainingComponents
    from rollouts.backends.train.distributed import shard_model, transformer_blocks
    from rollouts.backends.train.regional_compile import compile_layers
    from rollouts.loops.rl.step import rl_step
    from rollouts.types import AlgorithmConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams, TrainingState

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    prompt, response = (32, 96) if quick else (256, 768)
    samples, group, micro = (16, 4, 512) if quick else (64, 8, 8192)
    micro = micro_tokens or micro
    warmup = 2
    optimizer_config = OptimizerConfig(lr=1e-6, schedule="constant", max_grad_norm=1.0)
    config = RLConfig(
        num_steps=warmup + steps,
        optimizer=optimizer_config,
        rollout=RolloutConfig(
            batch_size=samples // group, samples_per_prompt=group, sampling=SamplingParams(max_new_tokens=response)
        ),
        algorithm=AlgorithmConfig(advantage_estimator="grpo"),
        max_tokens_per_micro_batch=micro,
    )
    model = _model(quick)
    num_params = sum(p.numel() for p in model.parameters())
    batch = _batch(model.config.vocab_size, samples, prompt, response, group)
    if variant in PEERS:  # the same model and batch through a peer library's step (train_peers.py)
        model = model.to(device, torch.bfloat16)
        ids_N_T, adv_N = batch_tensors(batch, device)
        try:
            peer = peer_step_fn(variant, model, optimizer_config)
        except ImportError as e:
            return {"variant": variant, "missing": str(e)}
        return _timed_steps(
            variant, lambda: peer(ids_N_T, adv_N, prompt, micro, _sync), warmup, steps, device,
            {"micro_tokens": micro, "params": num_params, "tokens": samples * (prompt + response)},
        )  # fmt: skip
    if variant.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = model.to(device)
        compile_layers(model, "layers" if "-compile" in variant else "none")  # before sharding
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if "bf16" in variant else None
        model = shard_model(model, mixed_precision=mp, gather_once_per_step="-gathered" in variant)
        opt = build_optimizer(model, optimizer_config)
        components = TrainingComponents(
            model=model, optimizer=opt, device=device,
            scheduler=build_scheduler(opt, optimizer_config, num_training_steps=warmup + steps),
        )  # fmt: skip
    else:
        components = build_components(
            model.to(torch.bfloat16), optimizer_config, num_training_steps=warmup + steps, device=str(device)
        )
        if variant.endswith("-graphs"):  # each layer's compiled forward and backward replayed as CUDA graphs
            for block in transformer_blocks(components.model):
                block.compile(mode="reduce-overhead")
        else:
            compile_layers(components.model, "layers" if "-compile" in variant else "none")
    for suffix, implementation in ADAMW_SUFFIXES.items():
        if variant.endswith(suffix):  # the same groups and hyperparameters, another implementation
            groups = [
                {"params": g["params"], "weight_decay": g["weight_decay"]} for g in components.optimizer.param_groups
            ]
            opt = torch.optim.AdamW(
                groups, lr=optimizer_config.lr, betas=optimizer_config.betas, eps=optimizer_config.eps, **implementation
            )
            scheduler = build_scheduler(opt, optimizer_config, num_training_steps=warmup + steps)
            components = dataclasses.replace(components, optimizer=opt, scheduler=scheduler)
    parts: dict[str, float] = {}

    def timed(module, name: str, key: str) -> None:
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - t0

        setattr(module, name, wrapper)

    for module in (train, policy_update):
        if hasattr(module, "forward_backward"):
            timed(module, "forward_backward", "forward_backward")
        if hasattr(module, "optim_step"):
            timed(module, "optim_step", "optimizer")
    state = TrainingState()

    def one_step() -> dict[str, float]:
        nonlocal state
        parts.clear()
        state, metrics = rl_step(components, state, dataclasses.replace(batch, step=state.step + 1), config)
        return {**parts, "loss": float(metrics.get("loss", float("nan")))}

    result = _timed_steps(
        variant, one_step, warmup, steps, device,
        {"micro_tokens": micro, "params": num_params, "tokens": samples * (prompt + response)},
    )  # fmt: skip
    if profile:  # one more step under the profiler: its busiest kernels and ops, to `profile`
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            rl_step(components, state, dataclasses.replace(batch, step=state.step + 1), config)
            _sync()
        table = prof.key_averages()
        with open(profile, "w") as f:
            for key in ("cuda_time_total", "cpu_time_total", "self_cpu_time_total"):
                f.write(f"== sorted by {key}\n{table.table(sort_by=key, row_limit=30, max_name_column_width=70)}\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


def _timed_steps(variant: str, one_step, warmup: int, steps: int, device: torch.device, info: dict) -> dict:
    """Median figures of `steps` steps after `warmup`; compile_s: the first step's time less the median."""
    records, first = [], 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(warmup + steps):
        _sync()
        t0 = time.perf_counter()
        parts = one_step()
        _sync()
        total = time.perf_counter() - t0
        first = first or total
        if step >= warmup:
            records.append({"total": total, **{k: v for k, v in parts.items() if k != "loss"}})
        if not (parts["loss"] == parts["loss"]):
            raise FloatingPointError(f"{variant}: step {step} loss {parts['loss']}")
    med = {key: statistics.median(r.get(key, 0.0) for r in records) for key in records[0]}
    peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else float("nan")
    return {
        "variant": variant, **info, "peak_gib": peak, **med, "compile_s": first - med["total"],
        "tokens_per_s": info["tokens"] / med["total"], "tflops": 6 * info["params"] * info["tokens"] / med["total"] / 1e12,
    }  # fmt: skip


def section_train(
    steps: int, quick: bool, variants: list[str], profile_dir: str, micro_tokens: int, variant_timeout_s: float = 900.0
) -> list[dict]:
    print("\n== training steps: rl_step on a Qwen2-0.5B-shaped model" + (" (quick sizes)" if quick else ""))
    print(
        f"{'variant':>22} {'step ms':>9} {'fwd+bwd ms':>10} {'optim ms':>9} {'other ms':>9} "
        f"{'tokens/s':>10} {'6N tok/s TF':>11} {'peak GiB':>9} {'compile s':>9}"
    )
    rows = []
    for variant in variants:
        cmd = [sys.executable, __file__, "--train-worker", variant, "--steps", str(steps)]
        cmd += ["--quick"] if quick else []
        cmd += ["--micro-tokens", str(micro_tokens)] if micro_tokens else []
        if profile_dir:
            cmd += ["--profile-dir", os.path.join(profile_dir, f"profile-{variant}.txt")]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=variant_timeout_s)
        except subprocess.TimeoutExpired:
            print(f"{variant:>22}  no result within {variant_timeout_s} s", flush=True)
            continue
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"{variant:>22}  failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}")
            continue
        r = json.loads(lines[-1])
        if "missing" in r:
            print(f"{variant:>22}  not installed ({r['missing']})")
            continue
        variant = f"{variant}@{r['micro_tokens']}" if micro_tokens else variant
        other = r["total"] - r.get("forward_backward", 0.0) - r.get("optimizer", 0.0)
        print(
            f"{variant:>22} {1e3 * r['total']:9.1f} {1e3 * r.get('forward_backward', 0):10.1f} "
            f"{1e3 * r.get('optimizer', 0):9.1f} {1e3 * other:9.1f} {r['tokens_per_s']:10.0f} "
            f"{r['tflops']:11.1f} {r['peak_gib']:9.2f} {r['compile_s']:9.1f}",
            flush=True,
        )
        rows.append(r)
    if rows:
        r = rows[0]
        print(f"({r['params'] / 1e6:.0f}M parameters, {r['tokens']} tokens per step, median of {steps} steps)")
    return rows


def section_grpo(steps: int, quick: bool) -> list[dict]:
    """Generate with the in-process sampler on the device, then train on what it generated."""
    import dataclasses

    import trio

    from rollouts.backends import InProcessEngine, build_components
    from rollouts.loops.rl.step import rl_step
    from rollouts.types import (
        AlgorithmConfig,
        OptimizerConfig,
        RLConfig,
        RolloutBatch,
        RolloutConfig,
        SamplingParams,
        TrainingState,
    )  # fmt: skip

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    prompts_n, group, prompt_len, new = (2, 4, 16, 16) if quick else (8, 8, 64, 128)
    print(f"\n== GRPO steps: in-process sampler + rl_step, {prompts_n} prompts x {group} x {new} new tokens")
    model = _model(quick).to(device, torch.bfloat16)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new, n=group)
    optimizer = OptimizerConfig(lr=1e-6, schedule="constant", max_grad_norm=1.0)
    config = RLConfig(
        num_steps=steps + 1,
        optimizer=optimizer,
        rollout=RolloutConfig(batch_size=prompts_n, samples_per_prompt=group, sampling=sampling),
        algorithm=AlgorithmConfig(advantage_estimator="grpo"),
    )
    components = build_components(model, optimizer, num_training_steps=steps + 1, device=str(device))
    engine = InProcessEngine(model, shares_training_model=True, eos_token_ids=(0,))
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(1, model.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(prompts_n)
    ]
    state, records = TrainingState(), []
    for step in range(steps + 1):
        _sync()
        t0 = time.perf_counter()
        samples = trio.run(engine.generate, prompts, dataclasses.replace(sampling, seed=step))
        _sync()
        t1 = time.perf_counter()
        rewards = torch.rand(len(samples), generator=gen).tolist()
        samples = [s.with_reward(r) for s, r in zip(samples, rewards, strict=True)]
        state, metrics = rl_step(components, state, RolloutBatch(samples=tuple(samples), step=state.step + 1), config)
        _sync()
        t2 = time.perf_counter()
        tokens = sum(len(s.tokens) - s.num_prompt_tokens for s in samples)
        if step > 0:
            records.append({"generate": t1 - t0, "train": t2 - t1, "new_tokens": tokens, "loss": metrics.get("loss")})
    med = {key: statistics.median(float(r[key]) for r in records) for key in ("generate", "train", "new_tokens")}
    print(
        f"generate {1e3 * med['generate']:.1f} ms ({med['new_tokens'] / med['generate']:.0f} new tokens/s), "
        f"train {1e3 * med['train']:.1f} ms, median of {steps} steps; losses {[r['loss'] for r in records]}"
    )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="logprobs,train,grpo")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="", help="write every figure to this file")
    parser.add_argument("--train-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(TRAIN_VARIANTS), help="training variants to run")
    parser.add_argument("--hidden", default="", help="logprobs: only these hidden sizes (e.g. 3584)")
    parser.add_argument("--logprob-variants", default="", help="logprobs: only these variants (and naive)")
    parser.add_argument("--micro-tokens", type=int, default=0, help="tokens per micro-batch (default 8192)")
    parser.add_argument("--variant-timeout", type=float, default=900.0, help="train: seconds per variant's process")
    parser.add_argument("--profile-dir", default="", help="write a torch.profiler table of one step per variant here")
    args = parser.parse_args()
    if args.train_worker:
        print(json.dumps(train_worker(args.train_worker, args.steps, args.quick, args.profile_dir, args.micro_tokens)))
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (no CUDA: figures say nothing of speed)"
    print(f"device: {name}; torch {torch.__version__}; load {os.getloadavg()[0]:.2f}")
    out: dict[str, list] = {}
    sections = args.sections.split(",")
    if "logprobs" in sections:
        hidden_sizes = {int(h) for h in args.hidden.split(",") if h}
        only = {v for v in args.logprob_variants.split(",") if v}
        out["logprobs"] = section_logprobs(device, args.repeats, args.quick, hidden_sizes, only)
    if "train" in sections:
        out["train"] = section_train(
            args.steps, args.quick, args.variants.split(","), args.profile_dir, args.micro_tokens, args.variant_timeout
        )
    if "grpo" in sections:
        out["grpo"] = section_grpo(args.steps, args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
