"""rollouts-backends benchmarks: sampler vs model.generate, packed vs padded training, checkpoint save.

Run: OMP_NUM_THREADS=1 uv run python benchmarks/bench_backends.py [sampler|training|checkpoint ...]
Each figure is the median of several repeats; ours and the baseline run side by side.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollouts.backends import (
    CheckpointWriter,
    build_components,
    export_weights,
    forward_backward,
    generate,
    save_checkpoint,
)
from rollouts.losses import sft_loss_fn
from rollouts.types import MicroBatch, OptimizerConfig, SamplingParams, TrainingState

REPEATS = 5


def model_of(*, hidden: int, layers: int, vocab: int, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).float().eval()


def median_s(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_sampler() -> None:
    model = model_of(hidden=128, layers=2, vocab=512)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in rng.integers(8, 48, size=8)]
    n = 4
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    # Case 1: every row runs to max_new_tokens. Case 2: 12 of the 512 ids stop a response
    # (about 2.3% per token), so lengths are long-tailed as in RL rollouts.
    cases = [("fixed length", 64, []), ("with stop tokens", 192, list(range(500, 512)))]
    for label, new, stop in cases:
        produced = {}

        def ours():
            samples = generate(
                model,
                prompts,
                SamplingParams(n=n, max_new_tokens=new, temperature=1.0, seed=0, stop_token_ids=tuple(stop)),
            )
            produced["ours"] = sum(s.response_length for s in samples)

        def hf():
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    num_return_sequences=n,
                    max_new_tokens=new,
                    min_new_tokens=0 if stop else new,
                    pad_token_id=0,
                    eos_token_id=stop or None,
                )
            response = out[:, width:]
            done = torch.isin(response, torch.tensor(stop)) if stop else torch.zeros_like(response, dtype=torch.bool)
            # Tokens up to and including the first stop token count; later padding does not.
            first = torch.where(done.any(1), done.int().argmax(1) + 1, response.shape[1])
            produced["hf"] = int(first.sum())

        t_ours, t_hf = median_s(ours), median_s(hf)
        rate_ours, rate_hf = produced["ours"] / t_ours, produced["hf"] / t_hf
        print(f"sampler, {label} ({len(prompts)} prompts x n={n}, max_new_tokens {new}, hidden 128, 2 layers, V=512)")
        print(f"  ours generate():       {rate_ours:8.0f} tokens/s  ({produced['ours']} tokens, {t_ours * 1e3:.0f} ms)")
        print(f"  transformers generate: {rate_hf:8.0f} tokens/s  ({produced['hf']} tokens, {t_hf * 1e3:.0f} ms)")
        print(f"  speed-up: {rate_ours / rate_hf:.2f}x  (target 1.5x)")


def _packed(seqs):
    ids = np.concatenate(seqs)[None]
    pos = np.concatenate([np.arange(len(s)) for s in seqs])[None]
    seg = np.concatenate([np.full(len(s), i) for i, s in enumerate(seqs)])[None]
    loss = np.concatenate([np.r_[0.0, np.ones(len(s) - 1)] for s in seqs])[None].astype(np.float32)
    return MicroBatch(
        input_ids=ids.astype(np.int64),
        position_ids=pos.astype(np.int64),
        segment_ids=seg.astype(np.int64),
        attention_mask=np.ones_like(ids, dtype=np.int64),
        loss_mask=loss,
        sample_indices=np.arange(len(seqs)),
    )


def _padded(seqs):
    T, B = max(len(s) for s in seqs), len(seqs)
    out = {k: np.zeros((B, T), dtype=np.int64) for k in ("input_ids", "position_ids", "attention_mask")}
    out["segment_ids"] = np.full((B, T), -1, dtype=np.int64)
    out["loss_mask"] = np.zeros((B, T), dtype=np.float32)
    for i, s in enumerate(seqs):
        out["input_ids"][i, : len(s)] = s
        out["position_ids"][i, : len(s)] = np.arange(len(s))
        out["segment_ids"][i, : len(s)] = i
        out["attention_mask"][i, : len(s)] = 1
        out["loss_mask"][i, 1 : len(s)] = 1.0
    return MicroBatch(sample_indices=np.arange(B), **out)


def bench_training() -> None:
    rng = np.random.default_rng(0)
    # Long-tailed lengths (log-normal, like chat/RL responses): most short, a few near the cap.
    lengths = np.clip(rng.lognormal(mean=4.0, sigma=1.1, size=64), 8, 1024).astype(int)
    seqs = [rng.integers(2, 512, size=int(n)) for n in lengths]
    # The budget is the longest sequence: on CPU attention runs a dense masked T x T product per
    # row, so a row much longer than any sequence would spend compute on masked-out blocks.
    budget = int(lengths.max())
    packed, current = [], []
    for s in sorted(seqs, key=len, reverse=True):  # first-fit decreasing into a token budget
        if current and sum(map(len, current)) + len(s) > budget:
            packed.append(_packed(current))
            current = []
        current.append(s)
    packed.append(_packed(current))
    rows = 8
    padded = [_padded(seqs[i : i + rows]) for i in range(0, len(seqs), rows)]
    real = int(lengths.sum())
    num_tokens = int(sum((mb.loss_mask > 0).sum() for mb in packed))
    components = build_components(model_of(hidden=256, layers=2, vocab=512), OptimizerConfig(), num_training_steps=10)

    def run(mbs):
        def step():
            forward_backward(components, mbs, sft_loss_fn(), num_tokens=num_tokens, num_sequences=len(seqs))
            components.optimizer.zero_grad(set_to_none=True)

        return step

    t_packed, t_padded = median_s(run(packed), 3), median_s(run(padded), 3)
    padded_slots = sum(mb.input_ids.size for mb in padded)
    print(
        f"training ({len(seqs)} sequences, lengths {lengths.min()}..{lengths.max()} median {int(np.median(lengths))}, "
        f"{real} real tokens; padded: {rows} rows/micro-batch = {padded_slots} slots; packed: {len(packed)} rows of <= {budget})"
    )
    print(f"  packed: {real / t_packed:9.0f} real tokens/s  ({t_packed * 1e3:.0f} ms per step)")
    print(f"  padded: {real / t_padded:9.0f} real tokens/s  ({t_padded * 1e3:.0f} ms per step)")
    print(f"  speed-up: {t_padded / t_packed:.2f}x  (target 2x)")


def bench_checkpoint() -> None:
    model = model_of(hidden=512, layers=8, vocab=32000)
    components = build_components(model, OptimizerConfig(), num_training_steps=10)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    size = sum(t.numel() * t.element_size() for t in weights.values())
    tmp = Path(tempfile.mkdtemp())
    step = [0]
    writer = CheckpointWriter()
    try:

        def bare():
            safetensors.torch.save_file(weights, str(tmp / "bare.safetensors"))

        def bare_durable():
            bare()
            fd = os.open(tmp / "bare.safetensors", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        def ours(background):
            # A new step each time, keep_last=1: retention deletes the previous one, as in training.
            step[0] += 1
            save_checkpoint(
                components,
                TrainingState(step=step[0]),
                tmp / "ckpt",
                keep_last=1,
                save_optimizer=False,
                writer=writer if background else None,
            )

        # Interleave them so that disk write-back from one does not land on another only. After
        # a background save, its flush is waited for outside the timed region (and timed apart).
        times = {
            "ours": [],
            "ours_background": [],
            "ours_background_durable": [],
            "bare": [],
            "durable": [],
            "export": [],
            "export_durable": [],
        }
        fns = {
            "ours": lambda: ours(False),
            "ours_background": lambda: ours(True),
            "bare": bare,
            "durable": bare_durable,
            "export": lambda: export_weights(components, tmp / "export", writer=writer),
            "export_durable": lambda: export_weights(components, tmp / "export", durable=True),
        }
        for fn in fns.values():
            fn()
            writer.wait()
        for _ in range(REPEATS):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                returned = time.perf_counter()
                writer.wait()
                times[name].append(returned - start)
                if name == "ours_background":
                    times["ours_background_durable"].append(time.perf_counter() - start)
        t = {k: statistics.median(v) for k, v in times.items()}

        def line(label, key):
            print(f"  {label:<44}{size / t[key] / 1e6:7.0f} MB/s  ({t[key] * 1e3:.0f} ms)")

        print(
            f"checkpoint ({size / 1e6:.0f} MB of float32 weights; ours adds config, state.json, CRC-32, fsync, rename, retention)"
        )
        line("save_checkpoint, durable on return", "ours")
        line("save_checkpoint(writer=), until it returns", "ours_background")
        line("  ... and until durable and published", "ours_background_durable")
        line("safetensors save_file (not durable)", "bare")
        line("safetensors save_file + fsync", "durable")
        line("export_weights (weight sync, page cache)", "export")
        line("export_weights(durable=True)", "export_durable")
        print(
            f"  durable on return: {t['bare'] / t['ours']:.2f}x of bare save_file, {t['durable'] / t['ours']:.2f}x of save_file + fsync"
        )
        print(
            f"  with a writer: {t['bare'] / t['ours_background']:.2f}x of bare save_file (training stalls only this long; target >= 0.8x)"
        )
        print(f"  export_weights: {t['bare'] / t['export']:.2f}x of bare save_file")
    finally:
        writer.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    chosen = sys.argv[1:] or ["sampler", "training", "checkpoint"]
    for name in chosen:
        {"sampler": bench_sampler, "training": bench_training, "checkpoint": bench_checkpoint}[name]()
