"""On a CUDA GPU: one packed row through the model, the dense [1, 1, T, T] mask under SDPA against
DOCUMENT_SDPA's FlexAttention BlockMask (rollouts.backends.train.attention).

Workload: a random-init model of Qwen2-0.5B's shape in bf16, one packed row of `--tokens` tokens
(8192) holding sequences of random lengths from 64 to 2048, forward + backward of the summed
last hidden state (the output layer left out: it is the same in both). Reports the median of
`--repeats` after two warm-ups (the first compiles FlexAttention), peak memory beyond the model,
and the largest difference of each hidden state from the dense mask's (bf16: a few units in their
last place).

A third row, `varlen`, runs torch's variable-length FlashAttention (`torch.nn.attention.varlen.
varlen_attn`, where this torch has it) on the same row, the sequences' boundaries given as
cumulative lengths: the candidate for packed rows beside FlexAttention. It is registered here for
the benchmark only (the dense mask is still built, and ignored).

Run: python benchmarks/bench_packed_attention.py [--tokens 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rollouts.backends.train.attention import DOCUMENT_SDPA
from rollouts.backends.train.inputs import micro_batch_to_torch, model_inputs
from rollouts.types import MicroBatch


def packed_row(tokens: int, vocab: int, seed: int = 0) -> MicroBatch[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(min(rng.integers(64, 2049), tokens - sum(lengths))))
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])[None]
    pos = np.concatenate([np.arange(n) for n in lengths])[None]
    ids = rng.integers(0, vocab, size=(1, tokens))
    return MicroBatch(
        input_ids=ids, position_ids=pos, segment_ids=seg, attention_mask=np.ones_like(ids),
        loss_mask=np.ones(ids.shape, dtype=np.float32), sample_indices=np.arange(len(lengths)),
    )  # fmt: skip


VARLEN = "sdpa_varlen"


def varlen_attention(lengths: list[int]) -> Any:
    """A transformers attention function running varlen_attn over one packed row of `lengths`, or the
    reason it cannot run here (a string)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return f"unavailable: {e}"
    params = inspect.signature(varlen_attn).parameters
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    longest = max(lengths)

    def forward(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [1, H, T, D] -> [T, H, D]
        if "enable_gqa" in params:
            extra = {"enable_gqa": q.shape[1] != k.shape[1]}
        else:  # an older varlen_attn: the key / value heads repeated
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
            extra = {}
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        cu_dev = cu.to(q.device)
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_dev, cu_dev, longest, longest,
                          scale=scaling, **causal, **extra)  # fmt: skip
        return out[None], None  # [1, T, H, D]

    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
    )  # fmt: skip
    torch.manual_seed(0)
    with device:  # initialized on the GPU: 494M parameters initialized on the CPU take longer than the timings
        model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    row = packed_row(args.tokens, config.vocab_size)
    batch = micro_batch_to_torch(row, device)
    varlen = varlen_attention(np.bincount(row.segment_ids[0]).tolist())
    if not isinstance(varlen, str):
        AttentionInterface.register(VARLEN, varlen)
        AttentionMaskInterface.register(VARLEN, sdpa_mask)
    print(f"{'attention':>14} {'ms':>8} {'peak GiB':>9}   (one packed row of {args.tokens} tokens)")
    hidden = {}
    for impl in ("sdpa", DOCUMENT_SDPA, VARLEN):
        if impl == VARLEN and isinstance(varlen, str):
            print(f"{impl:>14} {varlen}")
            continue
        model.set_attn_implementation(impl)
        times = []
        for i in range(args.repeats + 2):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = model.model(**model_inputs(model, batch), use_cache=False).last_hidden_state
            out.float().sum().backward()
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        hidden[impl] = out.detach()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"{impl:>14} {statistics.median(times):8.1f} {peak:9.2f}", flush=True)
    for impl in hidden:
        if impl != "sdpa":
            print(
                f"{impl}: max |difference| from the dense mask's last hidden state {(hidden['sdpa'] - hidden[impl]).abs().max():.3g}"
            )


if __name__ == "__main__":
    main()
