"""Colocated weight-sync benchmark (needs a CUDA GPU): a ProcessEngine on the trainer's GPU takes
Qwen2-0.5B-shaped bf16 weights (random init, built here) by CUDA IPC, and through host shared
memory, beside a bare device-to-device `copy_` of the same bytes. Median of 5 syncs each, after one
warm-up.

Measured 2026-11-27 on one NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130), 290 tensors, 0.988 GB bf16:
path                         seconds      GB/s    x bare    host bytes
bare copy_ (d2d)              0.0021     481.2       1.0             0
ProcessEngine cuda_ipc        0.1602       6.2      78.0             0
ProcessEngine shared_mem      0.4279       2.3     208.4     988065536
CUDA IPC moves no host bytes and is 2.7x the shared-memory path, but 78x a bare copy: a sync is a
request to the engine process and its reply, the handles opened there, the copies into the engine's
model and (on by default) attestation's checksums on both sides, which then waited for the GPU once
per tensor on each side (now once per sync). The attest=False rows, added after this run, split
attestation's share out.

The "vLLM extension, IPC wire" rows: `VLLMEngine(tensor_wire="ipc")`'s requests (rollouts.sync.ipc,
256 MiB buckets staged on the trainer's GPU, one CUDA IPC handle each) answered by vLLM's worker
extension in a process of its own (rollouts.sync.worker_process.StandInWorker: vLLM's load stood in
for by copies into the worker's own tensors; no HTTP), attested and not.

Run (on a CUDA machine; needs torch, transformers, safetensors, numpy, httpx, anyio):
  PYTHONPATH=packages/rollouts-types/src:packages/rollouts-losses/src:packages/rollouts-sync/src:packages/rollouts-backends/src \
    python3 benchmarks/bench_ipc.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollouts.backends import EngineProcessOptions, ProcessEngine
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.sync.ipc import IpcUpdate
from rollouts.sync.worker_process import StandInWorker

NUM_REPEATS = 5


def qwen2_05b_shape() -> Qwen2Config:
    """Qwen2-0.5B's shapes (tied embeddings), random weights."""
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )


def median_s(run: Callable[[], None]) -> float:
    """Median seconds of NUM_REPEATS calls of `run` after one warm-up (each ends synchronized)."""
    run()
    times = []
    for _ in range(NUM_REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_now(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine that never suspends (ProcessEngine.load_weights), with no event loop's cost."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    raise RuntimeError("the coroutine suspended: it needs an event loop")


def engine_sync(
    model_dir: Path, tensors: Mapping[str, torch.Tensor], transport: str, attest: bool = True
) -> tuple[float, int]:
    """Median seconds of a `load_weights` of `tensors` into an engine process on cuda:0 by `transport`,
    attested or not, and the bytes its shared-memory file holds afterwards."""
    options = EngineProcessOptions(
        device="cuda:0", dtype="bfloat16", weights_transport=transport, timeout_s=300.0, attest=attest
    )
    with ProcessEngine(model_dir, options) as engine:
        versions = iter(range(1, 100))
        seconds = median_s(lambda: run_now(engine.load_weights(tensors, next(versions))))
        return seconds, engine._child.weights_file.stat().st_size


def extension_sync(model_dir: Path, tensors: Mapping[str, torch.Tensor], attest: bool = True) -> float:
    """Median seconds of an IPC-wire sync (rollouts.sync.ipc, VLLMEngine(tensor_wire="ipc")'s requests)
    of `tensors` into vLLM's worker extension run by a stand-in worker process on cuda:0 (no vLLM: its
    load stood in for by copies into tensors of the worker's own), attested or not: 256 MiB buckets
    staged on the trainer's GPU, one request each, the trainer's checksums compared as VLLMEngine does."""
    with StandInWorker(model_dir, device="cuda:0") as worker:
        versions = iter(range(1, 100))

        def once() -> None:
            update = IpcUpdate(tensors, bucket_bytes=256 << 20, weight_version=next(versions), checksums=attest)
            answer = {}
            for rpc in update.rpcs():
                answer = worker.call(rpc["kwargs"], timeout_s=300.0)
            if attest and answer["checksums"] != update.expected():
                raise RuntimeError("the worker's checksums differ from the trainer's")

        return median_s(once)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_ipc: needs a CUDA GPU")
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = Qwen2ForCausalLM(qwen2_05b_shape()).to(torch.bfloat16)
    tensors = model_tensors(model, keep_device=True)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}

    def bare() -> None:
        for name, t in tensors.items():
            targets[name].copy_(t)

    bare_s = median_s(bare)
    gpu = torch.cuda.get_device_name(0)
    print(f"colocated sync on {gpu}: {len(tensors)} tensors, {num_bytes / 1e9:.3f} GB bf16, median of {NUM_REPEATS}")
    print(f"{'path':<26}{'seconds':>10}{'GB/s':>10}{'x bare':>10}{'host bytes':>14}", flush=True)

    def row(name: str, seconds: float, host: int) -> None:  # printed as measured: a cut-off run keeps its rows
        print(
            f"{name:<26}{seconds:>10.4f}{num_bytes / seconds / 1e9:>10.1f}{seconds / bare_s:>10.1f}{host:>14}",
            flush=True,
        )

    row("bare copy_ (d2d)", bare_s, 0)
    with tempfile.TemporaryDirectory(prefix="bench-ipc-") as tmp:
        model.config.save_pretrained(tmp)
        cpu = model_tensors(model)
        safetensors.torch.save_file(cpu, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        del cpu
        row("vLLM extension, IPC wire", extension_sync(Path(tmp), tensors), 0)  # never yet measured: first
        row("  attest=False", extension_sync(Path(tmp), tensors, attest=False), 0)
        for transport, name in (("cuda_ipc", "ProcessEngine cuda_ipc"), ("shared_memory", "ProcessEngine shared_mem")):
            row(name, *engine_sync(Path(tmp), tensors, transport))
            row("  attest=False", *engine_sync(Path(tmp), tensors, transport, attest=False))


if __name__ == "__main__":
    main()
