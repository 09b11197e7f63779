"""Weight-sync benchmark.

1. Fan-out: sync to 4 fake engines (fixed reload delay) concurrently vs to 1; target <= 1.3x.
2. Transports to a real vLLM CPU server for a model of Qwen2-0.5B's shape (random bf16 weights,
   988 MB; `--quick`: a small one): seconds and bytes per sync for disk, http (the fetch wire), the
   IPC wire (/dev/shm buckets here, on the CPU) and broadcast, each run alternately with its bare
   transport (a file write+read; a POST of the tensor bytes to a sink in another process; a write
   into a /dev/shm file another process copies out of, both keeping their mappings between syncs, as
   the IPC wire's two sides do; a plain gloo broadcast of the same buckets
   between two processes); target
   <= 1.3x. Each transport twice: attested (the default) and with attestation off (no checksum on
   either side), so the difference is what attestation costs a sync. Beside it, vLLM's own reload within each sync (its worker's "load" seconds: on CPU it
   repacks every linear weight, which no bare transport does) and the ratio without it, what the
   transport itself adds. Disk writes with the project's streaming writer (as export_weights does); http's bytes
   are those on the wire (request bodies and what the engine fetched). `--phases` adds, per
   transport, the median seconds of each HTTP call, each step the worker extension reports and
   the trainer-side steps (benchmarks/sync_phases.py). Skipped with a message when the vLLM venv is
   absent.
3. Attestation (`--attest`: this section alone): seconds to checksum Qwen2-0.5B-shaped random bf16
   weights (rollouts.sync.fingerprint), numpy and torch on CPU, torch on CUDA where there is a GPU.

Run: OMP_NUM_THREADS=1 uv run python benchmarks/bench_sync.py [--quick] [--no-vllm] [--transports]
[--phases] [--attest]   (--transports: section 2 alone)
"""

from __future__ import annotations

import http.client
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch
import trio
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch_file
from sync_phases import Phases

from rollouts.backends.checkpoint.durable import write_tensors
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
IPC_BUCKET_BYTES = 256 << 20  # VLLMEngine's default chunk_bytes
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


def bare_file(blob: bytes, tmp: Path) -> None:
    path = tmp / "bare.bin"
    path.write_bytes(blob)
    assert len(path.read_bytes()) == len(blob)


_SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        remaining = int(self.headers["Content-Length"])
        buffer = bytearray(1 << 22)
        while remaining:
            got = self.rfile.readinto(memoryview(buffer)[: min(remaining, len(buffer))])
            if not got:
                break
            remaining -= got
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Sink)
print(server.server_port, flush=True)
server.serve_forever()
"""


@contextmanager
def bare_post(num_bytes: int) -> Iterator:
    """A function that POSTs `num_bytes` to a sink in another process (what an HTTP sync moves, bare).
    With the standard library's client: httpx's sync transport re-slices the unsent rest of a body
    after every send(), quadratic in a body of this size."""
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        blob = b"x" * num_bytes

        def post() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600.0)
            try:
                conn.request("POST", "/", body=blob)
                assert conn.getresponse().status == 200
            finally:
                conn.close()

        yield post
    finally:
        sink.kill()
        sink.wait(timeout=30)


_GLOO = """
import sys, time, datetime as dt, torch, torch.distributed as d
rank, port, sizes = int(sys.argv[1]), sys.argv[2], [int(n) for n in sys.argv[3].split(",")]
d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                     timeout=dt.timedelta(seconds=300))
bufs = [torch.ones(n, dtype=torch.uint8) if rank == 0 else torch.empty(n, dtype=torch.uint8) for n in sizes]
go = torch.zeros(1, dtype=torch.int64)
while True:
    if rank == 0:
        go[0] = int(sys.stdin.readline().strip() == "go")
    d.broadcast(go, src=0)
    if not go[0]:
        break
    start = time.perf_counter()
    for b in bufs:
        d.broadcast(b, src=0)
    if rank == 0:
        print(time.perf_counter() - start, flush=True)
d.destroy_process_group()
"""


@contextmanager
def bare_gloo(bucket_sizes: list[int]) -> Iterator:
    """A function that times one plain gloo broadcast of buffers of `bucket_sizes` bytes to a second process."""
    port, sizes = str(free_port()), ",".join(map(str, bucket_sizes))
    peer = subprocess.Popen([sys.executable, "-c", _GLOO, "1", port, sizes])
    root = subprocess.Popen(
        [sys.executable, "-c", _GLOO, "0", port, sizes], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def once() -> float:
        root.stdin.write("go\n")
        root.stdin.flush()
        return float(root.stdout.readline())

    try:
        yield once
    finally:
        root.stdin.write("stop\n")
        root.stdin.flush()
        root.wait(timeout=60)
        peer.wait(timeout=60)


_SHM_PEER = """
import sys, numpy as np
path, size = sys.argv[1], int(sys.argv[2])
shared = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,))
into = np.empty(size, dtype=np.uint8)
for _ in sys.stdin:
    np.copyto(into, shared)
    print("ok", flush=True)
"""


@contextmanager
def bare_shm(num_bytes: int) -> Iterator:
    """A function that writes `num_bytes` into a file in /dev/shm and has another process copy them out
    of it, both keeping their mappings (what an IPC sync moves on the CPU, bare: one copy in, one out)."""
    path = f"/dev/shm/bench-sync-{os.getpid()}"
    shared = np.memmap(path, dtype=np.uint8, mode="w+", shape=(num_bytes,))
    blob = np.ones(num_bytes, dtype=np.uint8)
    peer = subprocess.Popen(
        [sys.executable, "-c", _SHM_PEER, path, str(num_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def once() -> None:
        np.copyto(shared, blob)
        peer.stdin.write("go\n")
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == "ok"

    try:
        yield once
    finally:
        peer.stdin.close()
        peer.wait(timeout=60)
        os.unlink(path)


async def timed_syncs(
    name: str, sync, bare, repeats: int, phases: Phases, engine, *, profile: bool
) -> tuple[float, float, float]:
    """Median seconds of `sync()` (awaited), of `bare()` (a float it returns, or its wall time), run
    alternately `repeats` times, and of the engine's own load within each sync (as its worker reports)."""
    ours, theirs = [], []
    with phases.installed(engine):
        for _ in range(repeats):
            with phases.sync():
                start = time.perf_counter()
                await sync()
                ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            result = await trio.to_thread.run_sync(bare)
            theirs.append(result if isinstance(result, float) else time.perf_counter() - start)
    if profile:
        print(phases.table(name), flush=True)
    reported = [row["  worker load"] for row in phases.syncs if "  worker load" in row]
    load = statistics.median(reported) if reported else None  # vLLM's own reload from a path reports none
    return statistics.median(ours), statistics.median(theirs), load


async def transports(url: str, tensors: dict[str, torch.Tensor], tmp: Path, repeats: int, profile: bool) -> list[tuple]:
    """(name, seconds, bytes, bare seconds, load seconds) per transport, attested (the default) and not:
    medians of `repeats` syncs, each run alternately with its bare transport."""
    rows = []
    version = 0
    for attest in (True, False):
        label = "" if attest else ", attest off"
        async with VLLMEngine(url, http=HTTPOptions(timeout_s=600.0), attest=attest) as engine:
            version = max(version, (await engine.weight_version() or 0) + 1)
            disk_phases = Phases()

            async def disk(engine=engine, disk_phases=disk_phases) -> None:  # the trainer writes, the engine reads
                nonlocal version
                out = tmp / f"disk_v{version}"
                shutil.copytree(tmp / "model", out, ignore=shutil.ignore_patterns("*.safetensors"))
                with disk_phases.step("trainer write_tensors"):
                    write_tensors(out / "model.safetensors", tensors, {"format": "pt"}, sync=False)  # as export_weights
                await engine.update_weights_from_disk(str(out), version)
                version += 1
                shutil.rmtree(tmp / f"disk_v{version - 2}", ignore_errors=True)

            disk_bytes = os.path.getsize(tmp / "model" / "model.safetensors")
            blob = os.urandom(1 << 20) * (disk_bytes >> 20) + os.urandom(disk_bytes % (1 << 20))
            seconds, bare, load = await timed_syncs(
                "disk" + label, disk, lambda: bare_file(blob, tmp), repeats, disk_phases, engine, profile=profile
            )
            rows.append(("disk" + label, seconds, disk_bytes, bare, load))

            async def http(engine=engine) -> None:  # the tensors in their own dtype as safetensors
                nonlocal version
                await engine.update_weights_from_tensors(tensors, version)
                version += 1

            tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            with bare_post(tensor_bytes) as post:
                seconds, bare, load = await timed_syncs(
                    "http" + label, http, post, repeats, Phases(), engine, profile=profile
                )
            rows.append(("http" + label, seconds, wire_bytes(engine.last_upload), bare, load))

            async with VLLMEngine(url, http=HTTPOptions(timeout_s=600.0), attest=attest, tensor_wire="ipc") as mapped:

                async def ipc(engine=mapped) -> None:  # the worker copies buckets out of /dev/shm files
                    nonlocal version
                    await engine.update_weights_from_tensors(tensors, version, chunk_bytes=IPC_BUCKET_BYTES)
                    version += 1

                with bare_shm(tensor_bytes) as shm:
                    seconds, bare, load = await timed_syncs(
                        "ipc" + label, ipc, shm, repeats, Phases(), mapped, profile=profile
                    )
                rows.append(("ipc" + label, seconds, wire_bytes(mapped.last_upload), bare, load))

            sync = BroadcastSync(BroadcastOptions(bucket_timeout_s=300.0, load_timeout_s=600.0, attest=attest))
            await sync.connect([engine])  # a group of its own: the worker leaves the last connect's

            async def broadcast(sync=sync) -> None:
                nonlocal version
                await sync.push(tensors, version)
                version += 1

            plan = plan_buckets(
                [(n, "bfloat16", tuple(t.shape)) for n, t in tensors.items()],
                bucket_bytes=sync.options.bucket_bytes,
                weight_version=0,
            )
            with bare_gloo([plan.bucket_bytes(k) for k in range(len(plan.buckets))]) as gloo:
                seconds, bare, load = await timed_syncs(
                    "broadcast" + label, broadcast, gloo, repeats, Phases(), engine, profile=profile
                )
            rows.append(("broadcast" + label, seconds, sync.last_num_bytes, bare, load))
    return rows


def wire_bytes(upload) -> int:
    """Bytes an HTTP sync moved: its request bodies, what the engine fetched where it fetches, and the
    buckets its workers copied out of this process's memory where it shares them (the IPC wire)."""
    return upload.body_bytes + getattr(upload, "fetched_bytes", 0) + getattr(upload, "shared_bytes", 0)


def bench_transports(tmp: Path, quick: bool, profile: bool) -> None:
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
        rows = trio.run(transports, server.url, tensors, tmp, repeats, profile)
    print(
        f"  {'transport':<22} {'s/sync':>8} {'MB/sync':>9} {'bare s':>8} {'ratio':>6} {'load s':>7} "
        f"{'ratio w/o load':>14}  bare transport"
    )
    bare_names = {
        "disk": "file write+read",
        "http": "POST to a sink process",
        "broadcast": "gloo broadcast, 2 processes",
        "ipc": "/dev/shm write, copy out by another process",
    }
    for name, seconds, num_bytes, bare, load in rows:
        print(
            f"  {name:<22} {seconds:>8.3f} {num_bytes / 1e6:>9.1f} {bare:>8.3f} {seconds / bare:>6.2f}x "
            + (f"{load:>7.3f} {(seconds - load) / bare:>13.2f}x" if load is not None else f"{'-':>7} {'-':>14}")
            + f"  {bare_names[name.split(',')[0]]}"
        )
    print("  (http's bytes are those on the wire: request bodies plus the payload the engine fetched;")
    print("   load s: vLLM's own reload_weights within the sync, as its worker reports it, which no bare")
    print("   transport includes; ratio w/o load: (s/sync - load s) / bare s, what the transport adds;")
    print("   '-': an unattested disk sync is vLLM's own reload from the path, which reports no steps)")


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
        if "--transports" not in sys.argv:
            bench_fanout(Path(tmp))
        if "--no-vllm" not in sys.argv:
            bench_transports(Path(tmp), quick="--quick" in sys.argv, profile="--phases" in sys.argv)


if __name__ == "__main__":
    main()
