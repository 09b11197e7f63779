"""LoRA benchmark: adapter sync vs full-weight sync to a real vLLM CPU server, and training step time.

1. Sync: the same model (a Qwen2 of ~25M parameters, float32) synced to one vLLM CPU server as
   (a) full weights (export_weights + reload_weights, the full-fine-tuning path) and (b) a rank-8
   LoRA adapter on every projection (save_adapter + /v1/load_lora_adapter). Bytes written per sync
   and seconds per sync (median of NUM_REPEATS), and the ratios.
2. Training: one optimizer step (forward_backward + optim_step, 4 x 128 tokens; the two alternate) with every weight
   training vs a rank-8 adapter: median seconds.

Run: OMP_NUM_THREADS=2 ROLLOUTS_VLLM_VENV=.vllm-venv uv run python benchmarks/bench_lora.py
(part 1 is skipped with a message when the vLLM venv is absent).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import trio
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollouts.backends import build_components, forward_backward, optim_step
from rollouts.loops.rl.generation import sync_engine
from rollouts.losses import sft_loss_fn
from rollouts.sync import HTTPOptions, VLLMEngine
from rollouts.sync.launch import VLLMServeOptions, launch_vllm_server
from rollouts.sync.testing import build_tiny_model, find_vllm_python, vllm_unavailable_reason
from rollouts.types import LoraConfig, MicroBatch, OptimizerConfig, TrainingState

NUM_REPEATS = 5
LORA = LoraConfig(rank=8, alpha=16.0)
SEQ_LEN, NUM_SEQS = 128, 4


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).float()


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _batch() -> MicroBatch[np.ndarray]:
    rng = np.random.default_rng(0)
    n = SEQ_LEN * NUM_SEQS
    return MicroBatch(
        input_ids=rng.integers(2, 8192, size=(1, n)),
        position_ids=np.tile(np.arange(SEQ_LEN), NUM_SEQS)[None],
        segment_ids=np.repeat(np.arange(NUM_SEQS), SEQ_LEN)[None],
        attention_mask=np.ones((1, n), dtype=np.int64),
        loss_mask=np.ones((1, n), dtype=np.float32),
        sample_indices=np.arange(NUM_SEQS),
    )


def step_seconds() -> tuple[float, float]:
    """Median seconds of one optimizer step with every weight training and with a rank-8 adapter.

    The two alternate step by step, so a load that comes and goes on the machine hits both alike."""
    runs = {
        name: build_components(_model(), OptimizerConfig(lr=1e-4), num_training_steps=100, lora=lora)
        for name, lora in (("full", None), ("lora", LORA))
    }
    batch = _batch()
    n = int(batch.loss_mask.sum())
    states = {name: TrainingState() for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(NUM_REPEATS + 1):
        for name, components in runs.items():
            start = time.perf_counter()
            forward_backward(components, [batch], sft_loss_fn(), num_tokens=n, num_sequences=NUM_SEQS)
            states[name], _ = optim_step(
                components, states[name], OptimizerConfig(lr=1e-4), num_tokens=n, num_samples=NUM_SEQS
            )
            if i > 0:  # the first step allocates optimizer state
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["full"]), statistics.median(times["lora"])


def sync_costs(model_dir: Path, url: str, lora: LoraConfig, work: Path, *, first_version: int) -> tuple[int, float]:
    """(bytes written per sync, median seconds per sync) for `lora.sync` ('adapter' or 'merged')."""
    components = build_components(model_dir, OptimizerConfig(), num_training_steps=1, lora=lora)
    engine = VLLMEngine(url, http=HTTPOptions(timeout_s=300.0))
    state, times = TrainingState(weight_version=first_version - 1), []

    async def one(state: TrainingState) -> TrainingState:
        state, _ = await sync_engine(components, engine, state, work, shares_model=False, lock=trio.Lock())
        return state

    for _ in range(NUM_REPEATS):
        start = time.perf_counter()
        state = trio.run(one, state)
        times.append(time.perf_counter() - start)
    written = work / ("adapter" if lora.sync == "adapter" else "weights")
    return _dir_bytes(written), statistics.median(times)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    full_step, lora_step = step_seconds()
    print(f"training step ({NUM_SEQS} x {SEQ_LEN} tokens, 25M-parameter Qwen2, float32, CPU):")
    print(f"  full fine-tuning {full_step * 1e3:8.1f} ms")
    print(f"  LoRA rank 8      {lora_step * 1e3:8.1f} ms   (full / LoRA = {full_step / lora_step:.2f})")
    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"sync to vLLM: skipped ({reason})")
        return
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        tmp = Path(tmp)
        python = find_vllm_python()
        model_dir = build_tiny_model(tmp / "model", python=python)  # its tokenizer; weights replaced below
        _model().save_pretrained(str(model_dir), safe_serialization=True)
        with launch_vllm_server(
            model_dir,
            options=VLLMServeOptions(dtype="float32", max_model_len=256, enforce_eager=True, max_lora_rank=LORA.rank),
            python=python,
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        ) as server:
            full_bytes, full_s = sync_costs(
                model_dir, server.url, LoraConfig(rank=8, sync="merged"), tmp / "full", first_version=1
            )
            lora_bytes, lora_s = sync_costs(model_dir, server.url, LORA, tmp / "lora", first_version=NUM_REPEATS + 1)
    print(f"sync to one vLLM CPU server (median of {NUM_REPEATS}):")
    print(f"  full weights     {full_bytes / 1e6:8.2f} MB  {full_s:6.3f} s")
    print(f"  LoRA adapter     {lora_bytes / 1e6:8.2f} MB  {lora_s:6.3f} s")
    print(f"  ratio            {full_bytes / lora_bytes:8.1f}x bytes  {full_s / lora_s:5.1f}x seconds")


if __name__ == "__main__":
    sys.exit(main())
