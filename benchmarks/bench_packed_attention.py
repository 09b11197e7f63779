"""On a CUDA GPU: one packed row through the model, the dense [1, 1, T, T] mask under SDPA against
DOCUMENT_SDPA's FlexAttention BlockMask (rollouts.backends.train.attention).

Workload: a random-init model of Qwen2-0.5B's shape in bf16, one packed row of `--tokens` tokens
(8192) holding sequences of random lengths from 64 to 2048, forward + backward of the summed
last hidden state (the output layer left out: it is the same in both). Reports the median of
`--repeats` after two warm-ups (the first compiles FlexAttention), peak memory beyond the model,
and the largest difference of the two hidden states (bf16: a few units in their last place).

Run: python benchmarks/bench_packed_attention.py [--tokens 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

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
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).to(device)
    batch = micro_batch_to_torch(packed_row(args.tokens, config.vocab_size), device)
    print(f"{'attention':>14} {'ms':>8} {'peak GiB':>9}   (one packed row of {args.tokens} tokens)")
    hidden = {}
    for impl in ("sdpa", DOCUMENT_SDPA):
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
    print(f"max |difference| of the last hidden states: {(hidden['sdpa'] - hidden[DOCUMENT_SDPA]).abs().max():.3g}")


if __name__ == "__main__":
    main()
