"""Weight-sync benchmark.

1. Fan-out: sync to 4 fake engines (fixed reload delay) concurrently vs to 1; target <= 1.3x.
2. End-to-end disk sync to a real vLLM CPU server for the tiny model, split into
   write (safetensors to disk) / reload (pause + collective_rpc reload_weights) / cache reset
   seconds (skipped with a message when the vLLM venv is absent).

3. Attestation (`--attest`: this section alone): seconds to checksum Qwen2-0.5B-shaped random bf16
   weights (rollouts.sync.fingerprint), numpy and torch on CPU, torch on CUDA where there is a GPU.

Run: OMP_NUM_THREADS=1 uv run python benchmarks/bench_sync.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import trio
from safetensors.numpy import load_file, save_file

from rollouts.sync import HTTPOptions, VLLMEngine, fingerprint, sync_weights_to_engines
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.sync.fingerprint import fingerprint_torch
from rollouts.sync.testing import build_tiny_model, find_vllm_python, launch_vllm_server, vllm_unavailable_reason

RELOAD_DELAY_S = 0.5
NUM_REPEATS = 5
TARGET_RATIO = 1.3


async def fanout(ckpt: str, num_engines: int) -> list[float]:
    """Seconds per sync (NUM_REPEATS of them) to `num_engines` fake engines at once."""
    times = []
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(serve_fake_engine(FakeEngineState(reload_delay_s=RELOAD_DELAY_S)))
            for _ in range(num_engines)
        ]
        engines = [await stack.enter_async_context(VLLMEngine(s.url)) for s in servers]
        for version in range(NUM_REPEATS):
            start = time.perf_counter()
            await sync_weights_to_engines(engines, ckpt, version, timeout_s=30.0)
            times.append(time.perf_counter() - start)
    return times


def bench_fanout(tmp: Path) -> None:
    ckpt = tmp / "fake_ckpt"
    ckpt.mkdir()
    save_file({"w": np.zeros((256, 256), np.float32)}, str(ckpt / "model.safetensors"))
    one = statistics.median(trio.run(fanout, str(ckpt), 1))
    four = statistics.median(trio.run(fanout, str(ckpt), 4))
    ratio = four / one
    print(f"fan-out (fake engines, reload delay {RELOAD_DELAY_S} s, median of {NUM_REPEATS}):")
    print(f"  1 engine : {one:.3f} s")
    print(
        f"  4 engines: {four:.3f} s   ratio {ratio:.3f}x (target <= {TARGET_RATIO}x) "
        f"{'OK' if ratio <= TARGET_RATIO else 'MISSED'}"
    )
    print(f"  sequential baseline would be ~{4 * one:.3f} s")


async def e2e(url: str, model_dir: Path, tmp: Path) -> list[tuple[float, float, float]]:
    weights = load_file(str(model_dir / "model.safetensors"))
    rng = np.random.default_rng(0)
    rows = []
    async with VLLMEngine(url, http=HTTPOptions(timeout_s=120.0)) as engine:
        for version in range(1, NUM_REPEATS + 1):
            out = tmp / f"v{version}"
            t0 = time.perf_counter()
            out.mkdir()
            for f in model_dir.iterdir():
                if f.suffix != ".safetensors" and f.is_file():
                    (out / f.name).write_bytes(f.read_bytes())
            new = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.01) for k, v in weights.items()}
            save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
            t1 = time.perf_counter()
            await engine._call("POST", "/pause", params={"mode": "wait"})
            await engine._call(
                "POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(out)}}
            )
            t2 = time.perf_counter()
            await engine.reset_prefix_cache()
            t3 = time.perf_counter()
            await engine._call("POST", "/update_weight_version", json={"new_version": str(version)})
            await engine._call("POST", "/resume")
            rows.append((t1 - t0, t2 - t1, t3 - t2))
        start = time.perf_counter()
        await sync_weights_to_engines([engine], str(tmp / f"v{NUM_REPEATS}"), NUM_REPEATS + 1, timeout_s=120.0)
        print(
            f"  full sync_weights_to_engines call (pause..resume + version check): {time.perf_counter() - start:.3f} s"
        )
    return rows


def bench_e2e(tmp: Path) -> None:
    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"end-to-end vLLM disk sync: SKIPPED ({reason})")
        return
    python = find_vllm_python()
    model_dir = build_tiny_model(tmp / "model", python=python)
    start = time.perf_counter()
    with launch_vllm_server(model_dir, python=python, log_path=tmp / "server.log") as server:
        print(
            f"end-to-end disk sync to vLLM CPU (tiny Qwen2, {os.path.getsize(model_dir / 'model.safetensors')} bytes; "
            f"server start-up {time.perf_counter() - start:.1f} s), median of {NUM_REPEATS}:"
        )
        rows = trio.run(e2e, server.url, model_dir, tmp)
    write, reload, reset = (statistics.median(col) for col in zip(*rows, strict=True))
    print(
        f"  write {write:.4f} s | reload {reload:.4f} s | cache reset {reset:.4f} s | total {write + reload + reset:.4f} s"
    )


def qwen2_05b_shapes() -> dict[str, tuple[int, ...]]:
    """Qwen2-0.5B's checkpoint tensors (tied embeddings: 494M parameters, 0.99 GB in bf16)."""
    hidden, inter, kv, vocab = 896, 4864, 128, 151936
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(24):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,)}
        shapes |= {p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,)}
        shapes |= {p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,)}
        shapes |= {p + "self_attn.o_proj.weight": (hidden, hidden), p + "mlp.down_proj.weight": (hidden, inter)}
        shapes |= {p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden)}
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
    return shapes


def bench_attest() -> None:
    """Checksum seconds per sync of Qwen2-0.5B-shaped bf16 weights: what attestation adds (the sender's
    fingerprint plus the engine's, each computed once per sync)."""
    import torch  # this section only: the rest of the benchmark runs without torch

    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(torch.bfloat16)
        for name, shape in qwen2_05b_shapes().items()
    }
    gigabytes = sum(t.numel() * 2 for t in weights.values()) / 1e9
    rows = [("numpy, CPU", lambda: fingerprint(weights)), ("torch, CPU", lambda: fingerprint_torch(weights))]
    if torch.cuda.is_available():
        on_gpu = {name: t.cuda() for name, t in weights.items()}
        rows.append((f"torch, {torch.cuda.get_device_name()}", lambda: fingerprint_torch(on_gpu)))
    results = {}
    print(f"attestation: checksums of Qwen2-0.5B-shaped bf16 weights ({len(weights)} tensors, {gigabytes:.2f} GB)")
    print(f"  {'implementation':<34} {'seconds (median of 3)':>22} {'GB/s':>8}")
    for label, run in rows:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            results[label] = run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        print(f"  {label:<34} {seconds:>22.3f} {gigabytes / seconds:>8.2f}")
    assert len({tuple(sorted(r.items())) for r in results.values()}) == 1, "implementations disagree"


def main() -> None:
    if "--attest" in sys.argv:
        bench_attest()
        return
    with tempfile.TemporaryDirectory() as tmp:
        bench_fanout(Path(tmp))
        if "--no-vllm" not in sys.argv:
            bench_e2e(Path(tmp))


if __name__ == "__main__":
    main()
