"""FSDP2 step time with the layers gathered per micro-batch (the default) and once per step
(`shard_model(gather_once_per_step=True)`), side by side in one run on two ranks.

Workload: a random-init Qwen2 of `--layers` layers (hidden 256, 4 heads, 2 KV heads, vocabulary
512), float32, `forward_backward` of the SFT loss over `--micro-batches` packed micro-batches of
`--tokens` tokens each, then `optim_step`; median of `--repeats` steps after one warm-up, the two
modes alternating. On CPU the ranks talk over gloo: the figures say how much of a step the
collectives and their bookkeeping take there, not what NCCL on GPUs gives (bench_cuda.py's
fsdp2-bf16-gathered row).

Run: OMP_NUM_THREADS=1 uv run torchrun --nproc-per-node 2 benchmarks/bench_fsdp_collectives.py
     [--layers 6] [--micro-batches 8] [--tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollouts.backends import build_components, forward_backward, optim_step, shard_model
from rollouts.backends.train.distributed import close_process_group
from rollouts.losses import sft_loss_fn
from rollouts.types import MicroBatch, OptimizerConfig, TrainingState


def micro_batch(tokens: int, vocab: int, rng: np.random.Generator) -> MicroBatch[np.ndarray]:
    """One packed row of `tokens` tokens: two sequences, every token a loss token."""
    half = tokens // 2
    ids = rng.integers(0, vocab, size=(1, tokens))
    return MicroBatch(
        input_ids=ids, position_ids=np.concatenate([np.arange(half), np.arange(tokens - half)])[None],
        segment_ids=np.repeat([0, 1], [half, tokens - half])[None], attention_mask=np.ones_like(ids),
        loss_mask=np.ones(ids.shape, dtype=np.float32), sample_indices=np.arange(2),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * args.tokens,
    )  # fmt: skip
    optimizer = OptimizerConfig(lr=1e-5)
    runs = {}
    for gather_once in (False, True):
        torch.manual_seed(0)
        model = shard_model(Qwen2ForCausalLM(config), gather_once_per_step=gather_once)
        runs[gather_once] = [build_components(model, optimizer, num_training_steps=args.repeats + 1), TrainingState()]
    rng = np.random.default_rng(rank)
    batches = [micro_batch(args.tokens, config.vocab_size, rng) for _ in range(args.micro_batches)]
    num_tokens = world * args.micro_batches * args.tokens
    times: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(args.repeats + 1):
        for gather_once, run in runs.items():
            components, state = run
            dist.barrier()
            start = time.perf_counter()
            forward_backward(components, batches, sft_loss_fn(), num_tokens=num_tokens, num_sequences=2 * world)
            run[1], _ = optim_step(components, state, optimizer, num_tokens=num_tokens, num_samples=2 * world)
            dist.barrier()
            if repeat > 0:  # the first is the warm-up
                times[gather_once].append(time.perf_counter() - start)
    if rank == 0:
        each, once = statistics.median(times[False]), statistics.median(times[True])
        print(f"FSDP2 on {world} gloo ranks, {args.layers} layers, {args.micro_batches} micro-batches of {args.tokens} "
              f"tokens, median of {args.repeats} steps")  # fmt: skip
        print(f"  gathered per micro-batch: {each * 1e3:8.1f} ms")
        print(f"  gathered once per step:   {once * 1e3:8.1f} ms   ({each / once:.2f}x faster)")
    close_process_group()


if __name__ == "__main__":
    main()
