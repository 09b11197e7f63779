"""Weight-sync benchmark.

1. Fan-out: sync to 4 fake engines (fixed reload delay) concurrently vs to 1; target <= 1.3x.
2. Transports to a real vLLM CPU server for a model of Qwen2-0.5B's shape (random bf16 weights,
   988 MB; `--quick`: a small one): seconds and bytes per sync for disk, http and broadcast, each
   beside its bare transport in the same run (a file write+read, a POST to a local sink, a plain
   gloo broadcast between two processes, of the same bytes); target <= 1.3x. Skipped with a
   message when the vLLM venv is absent.
3. Attestation (`--attest`: this section alone): seconds to checksum Qwen2-0.5B-shaped random bf16
   weights (rollouts.sync.fingerprint), numpy and torch on CPU, torch on CUDA where there is a GPU.

Run: OMP_NUM_THREADS=1 uv run python benchmarks/bench_sync.py [--quick] [--no-vllm] [--attest]
"""

from __future__ import annotations

import http.server
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import numpy as np
import torch
import trio
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch_file

from rollouts.sync import BroadcastOptions, HTTPOptions, VLLMEngine, fingerprint, sync_weights_to_engines
from rollouts.sync.broadcast import BroadcastSync
from rollouts.sync.broadcast_wire import plan_buckets
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.sync.fingerprint import fingerprint_torch
from rollouts.sync.launch import VLLMServeOptions, free_port
from rollouts.sync.launch import launch_vllm_server as launch_server
from rollouts.sync.testing import build_tiny_model, find_vllm_python, vllm_unavailable_reason

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


QWEN2_0_5B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936}
"""Qwen2-0.5B's shape: 494 M parameters, 988 MB in bf16 (tied embeddings)."""
QUICK = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 1024}


def qwen2_shapes(shape: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Qwen2's checkpoint tensors for `shape` (tied lm_head, so none of its own)."""
    h, kv = shape["hidden"], shape["kv_heads"] * (shape["hidden"] // shape["heads"])
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (h, h),
        "self_attn.q_proj.bias": (h,),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (shape["intermediate"], h),
        "mlp.up_proj.weight": (shape["intermediate"], h),
        "mlp.down_proj.weight": (h, shape["intermediate"]),
    }
    shapes = {"model.embed_tokens.weight": (shape["vocab"], h), "model.norm.weight": (h,)}
    for i in range(shape["layers"]):
        shapes |= {f"model.layers.{i}.{n}": s for n, s in per_layer.items()}
    return shapes


def qwen2_tensors(shape: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 weights under Qwen2's checkpoint names."""
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).bfloat16() for n, s in qwen2_shapes(shape).items()}


def write_model(out: Path, shape: dict[str, int], tokenizer_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config

    out.mkdir(parents=True)
    heads = shape["heads"]
    Qwen2Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=heads,
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=512,
        tie_word_embeddings=True,
        dtype="bfloat16",
    ).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    tensors = qwen2_tensors(shape, seed=0)
    save_torch_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bare_file(num_bytes: int, tmp: Path) -> None:
    blob = os.urandom(1 << 20) * (num_bytes >> 20) + os.urandom(num_bytes % (1 << 20))
    path = tmp / "bare.bin"
    path.write_bytes(blob)
    assert len(path.read_bytes()) == num_bytes


class _Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        remaining = int(self.headers["Content-Length"])
        while remaining:
            remaining -= len(self.rfile.read(min(remaining, 1 << 22)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def bare_gloo_s(bucket_sizes: list[int], repeats: int) -> float:
    """Median seconds of a plain gloo broadcast of buffers of `bucket_sizes` bytes to a second process."""
    port = free_port()
    code = (
        "import sys, datetime as dt, torch, torch.distributed as d\n"
        "d.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{sys.argv[1]}', rank=1, world_size=2,"
        " timeout=dt.timedelta(seconds=120))\n"
        f"for _ in range({repeats}):\n"
        f"    for n in {bucket_sizes}: d.broadcast(torch.empty(n, dtype=torch.uint8), src=0)\n"
        "d.destroy_process_group()\n"
    )
    peer = subprocess.Popen([sys.executable, "-c", code, str(port)])
    script = (
        "import sys, time, statistics, datetime as dt, torch, torch.distributed as d\n"
        "d.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{sys.argv[1]}', rank=0, world_size=2,"
        " timeout=dt.timedelta(seconds=120))\n"
        f"bufs = [torch.ones(n, dtype=torch.uint8) for n in {bucket_sizes}]\n"
        "times = []\n"
        f"for _ in range({repeats}):\n"
        "    t = time.perf_counter()\n"
        "    for b in bufs: d.broadcast(b, src=0)\n"
        "    times.append(time.perf_counter() - t)\n"
        "print(statistics.median(times))\n"
        "d.destroy_process_group()\n"
    )
    root = subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True, text=True, timeout=600)
    peer.wait(timeout=60)
    return float(root.stdout.strip().splitlines()[-1])


async def transports(url: str, tensors: dict[str, torch.Tensor], tmp: Path, repeats: int) -> list[tuple]:
    """(name, seconds, bytes) per transport, medians of `repeats` syncs, each beside its bare transport."""
    rows = []
    async with VLLMEngine(url, http=HTTPOptions(timeout_s=600.0)) as engine:
        version = (await engine.weight_version() or 0) + 1
        times = []
        for _ in range(repeats):  # disk: the trainer writes its bf16 weights, the engine reads them
            out = tmp / f"disk_v{version}"
            shutil.copytree(tmp / "model", out)
            start = time.perf_counter()
            save_torch_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
            await engine.update_weights_from_disk(str(out), version)
            times.append(time.perf_counter() - start)
            version += 1
        disk_bytes = os.path.getsize(tmp / "model" / "model.safetensors")
        rows.append(
            ("disk", statistics.median(times), disk_bytes, median_s(lambda: bare_file(disk_bytes, tmp), repeats))
        )

        times = []
        for _ in range(repeats):  # http: the tensors in their own dtype, base64 safetensors in JSON bodies
            start = time.perf_counter()
            upload = await engine.update_weights_from_tensors(tensors, version)
            times.append(time.perf_counter() - start)
            version += 1
        body_bytes = upload.body_bytes
        sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=sink.serve_forever, daemon=True).start()
        blob = b"x" * body_bytes
        with httpx.Client(timeout=600.0, trust_env=False) as client:
            bare = median_s(lambda: client.post(f"http://127.0.0.1:{sink.server_port}/", content=blob), repeats)
        sink.shutdown()
        rows.append(("http", statistics.median(times), body_bytes, bare))

        sync = BroadcastSync(BroadcastOptions(bucket_timeout_s=300.0, load_timeout_s=600.0))
        await sync.connect([engine])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            await sync.push(tensors, version)
            times.append(time.perf_counter() - start)
            version += 1
        plan = plan_buckets(
            [(n, "bfloat16", tuple(t.shape)) for n, t in tensors.items()],
            bucket_bytes=sync.options.bucket_bytes,
            weight_version=0,
        )
        sizes = [plan.bucket_bytes(k) for k in range(len(plan.buckets))]
        rows.append(("broadcast", statistics.median(times), sync.last_num_bytes, bare_gloo_s(sizes, repeats)))
    return rows


def bench_transports(tmp: Path, quick: bool) -> None:
    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"transports against vLLM: SKIPPED ({reason})")
        return
    python = find_vllm_python()
    shape = QUICK if quick else QWEN2_0_5B
    tokenizer_dir = build_tiny_model(tmp / "tokenizer_source", python=python)
    tensors = write_model(tmp / "model", shape, tokenizer_dir)
    options = VLLMServeOptions(dtype="bfloat16", max_model_len=256, enforce_eager=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    repeats = 3 if quick else NUM_REPEATS
    start = time.perf_counter()
    with launch_server(tmp / "model", options=options, python=python, env=env, log_path=tmp / "server.log") as server:
        print(
            f"transports to vLLM CPU ({'quick model' if quick else 'Qwen2-0.5B shape'}, bf16, "
            f"{sum(t.numel() for t in tensors.values()) / 1e6:.0f} M parameters; server start-up "
            f"{time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs), "
            f"median of {repeats}:"
        )
        rows = trio.run(transports, server.url, tensors, tmp, repeats)
    print(f"  {'transport':<10} {'s/sync':>8} {'MB/sync':>9} {'bare s':>8} {'ratio':>6}  bare transport")
    bare_names = {"disk": "file write+read", "http": "POST to a local sink", "broadcast": "gloo broadcast, 2 processes"}
    for name, seconds, num_bytes, bare in rows:
        print(
            f"  {name:<10} {seconds:>8.3f} {num_bytes / 1e6:>9.1f} {bare:>8.3f} {seconds / bare:>6.2f}x  "
            f"{bare_names[name]}"
        )
    print("  (http's bytes are its request bodies: base64 safetensors of the bf16 tensors, in JSON)")


def bench_attest() -> None:
    """Checksum seconds per sync of Qwen2-0.5B-shaped bf16 weights: what attestation adds (the sender's
    fingerprint plus the engine's, each computed once per sync)."""
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(torch.bfloat16)
        for name, shape in qwen2_shapes(QWEN2_0_5B).items()
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
            bench_transports(Path(tmp), quick="--quick" in sys.argv)


if __name__ == "__main__":
    main()
