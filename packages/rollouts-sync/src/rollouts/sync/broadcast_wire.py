"""The broadcast transport's torch-free half: its options, the bucket plan, and each engine's side
of the HTTP control calls (vLLM through the worker extension, SGLang through its native API).

A sync sends the model as buckets. Both sides agree on the plan before the bytes flow: the trainer
POSTs it to the engine, which then receives every bucket from the process group and loads only
after the last one arrived (all or nothing). vLLM receives one flat byte buffer per bucket (the
"flat" layout: each tensor's bytes at an aligned offset), filled piece by piece: a tensor of at
least SMALL_TENSOR_BYTES is a broadcast of its own, sent straight from the trainer's memory (no
copy), and each run of smaller neighbours one broadcast, packed; SGLang's
/update_weights_from_distributed receives one broadcast per tensor (the "tensors" layout), as its
own trainers send them.

The torch half, `rollouts.sync.broadcast.BroadcastSync`, runs the process group on the trainer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollouts.sync._common import check_seconds, check_weight_version
from rollouts.sync._http import EngineError, RetryPolicy
from rollouts.sync.sglang import SGLangEngine
from rollouts.sync.vllm import VLLMEngine

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Bytes per element of each dtype a plan may carry (torch's names, without "torch.")."""
ALIGN_BYTES = 16  # each tensor starts at a multiple of this in a flat bucket, so any dtype can view it
SMALL_TENSOR_BYTES = 1 << 20
"""Tensors under this many bytes travel packed with their small neighbours (one broadcast per run of
them); larger ones each in a broadcast of their own, from the trainer's memory as it is."""
_NO_RETRY = RetryPolicy(max_retries=0)  # a retried receive would join a broadcast already under way
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastOptions:
    """How the broadcast transport groups and bounds its work."""

    bucket_bytes: int = 512 * _MIB
    """Bytes per bucket (a tensor larger than this travels as a bucket of its own)."""
    setup_timeout_s: float = 120.0
    """Bound on joining the process group (the engines' workers and the trainer meeting)."""
    bucket_timeout_s: float = 120.0
    """Bound on each bucket's broadcast, on both sides (an engine that died fails within it)."""
    load_timeout_s: float = 600.0
    """Bound on the engine's load of the weights once every bucket arrived."""
    backend: str = "gloo"
    """"gloo" (tensors on the CPU) or "nccl" (tensors on the trainer's and the workers' GPUs)."""
    host: str | None = None
    """Address the engines reach the trainer at (None: this machine's address on the route to each engine)."""
    port: int = 0
    """Port of the trainer's rendezvous store (0: a free one)."""
    attest: bool = True
    """Check the checksums each vLLM worker reports of what it received against the trainer's own
    (rollouts.sync.fingerprint); a mismatch fails that engine before its version is set. SGLang
    reports none: its syncs go unattested."""

    def __post_init__(self) -> None:
        size = self.bucket_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"BroadcastOptions.bucket_bytes must be an int >= 1, got {size!r}")
        for name in ("setup_timeout_s", "bucket_timeout_s", "load_timeout_s"):
            check_seconds(f"BroadcastOptions.{name}", getattr(self, name))
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"BroadcastOptions.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"BroadcastOptions.port must be an int in [0, 65536), got {self.port!r}")


DEFAULT_BROADCAST = BroadcastOptions()
"""512 MiB buckets; 120 s to join and per bucket, 600 s to load; gloo; the store on a free port."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """One tensor of a plan: what the engine allocates to receive it."""

    name: str
    """The checkpoint (HF) name."""
    dtype: str
    """torch's dtype name without "torch." (a key of DTYPE_BYTES): the trainer's dtype, kept on the wire."""
    shape: tuple[int, ...]
    offset: int = 0
    """Byte offset in its bucket's flat buffer (a multiple of ALIGN_BYTES)."""

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastPlan:
    """Every bucket of one sync, in the order the trainer broadcasts them."""

    weight_version: int
    buckets: tuple[tuple[TensorSpec, ...], ...]
    """[K buckets][tensors in bucket] in broadcast order."""

    @property
    def num_bytes(self) -> int:
        """The weights' bytes (padding between tensors in a flat bucket not counted)."""
        return sum(t.num_bytes for bucket in self.buckets for t in bucket)

    def bucket_bytes(self, index: int) -> int:
        """Bytes of bucket `index`'s flat buffer (its last tensor's end)."""
        last = self.buckets[index][-1]
        return last.offset + last.num_bytes

    def to_json(self) -> str:
        """The plan as the engine reads it: per bucket its flat buffer's bytes, its tensors (name,
        dtype, shape, offset) and the [start, end) bytes of each broadcast that fills it."""
        buckets = [
            {
                "nbytes": self.bucket_bytes(i),
                "tensors": [[t.name, t.dtype, list(t.shape), t.offset] for t in bucket],
                "pieces": [[p[0].offset, p[-1].offset + p[-1].num_bytes] for p in bucket_pieces(bucket)],
            }
            for i, bucket in enumerate(self.buckets)
        ]
        return json.dumps({"version": self.weight_version, "buckets": buckets})

    def names(self) -> list[str]:
        return [t.name for bucket in self.buckets for t in bucket]


def bucket_pieces(bucket: Sequence[TensorSpec]) -> list[tuple[TensorSpec, ...]]:
    """A bucket's tensors grouped as they are broadcast, in order: each tensor of at least
    SMALL_TENSOR_BYTES alone, each run of smaller ones together."""
    out: list[tuple[TensorSpec, ...]] = []
    run: list[TensorSpec] = []
    for spec in bucket:
        if spec.num_bytes < SMALL_TENSOR_BYTES:
            run.append(spec)
            continue
        if run:
            out.append(tuple(run))
            run = []
        out.append((spec,))
    if run:
        out.append(tuple(run))
    return out


def plan_buckets(
    specs: Sequence[tuple[str, str, Sequence[int]]], *, bucket_bytes: int, weight_version: int
) -> BroadcastPlan:
    """(name, dtype, shape) of each tensor, in order, grouped into buckets of at most `bucket_bytes`
    (a larger tensor alone in its bucket); offsets aligned to ALIGN_BYTES within each bucket."""
    check_weight_version(weight_version)
    if not specs:
        raise ValueError("no tensors to broadcast: the plan would be empty")
    names = [name for name, _, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names must be unique, got duplicates in {sorted(names)[:10]}")
    buckets: list[list[TensorSpec]] = [[]]
    end = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}, not one of {sorted(DTYPE_BYTES)}")
        spec = TensorSpec(name=name, dtype=dtype, shape=tuple(int(s) for s in shape))
        offset = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        if buckets[-1] and offset + spec.num_bytes > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append(TensorSpec(name=name, dtype=dtype, shape=spec.shape, offset=offset))
        end = offset + spec.num_bytes
    return BroadcastPlan(weight_version=weight_version, buckets=tuple(tuple(b) for b in buckets))


class BroadcastReceiver(Protocol):
    """One engine's side of the control calls: how many workers join, the join, and a sync."""

    @property
    def name(self) -> str: ...

    layout: str
    """"flat" (one buffer per bucket) or "tensors" (one broadcast per tensor)."""

    async def num_workers(self) -> int: ...

    async def join(self, *, host: str, port: int, group: str, world_size: int, options: BroadcastOptions) -> None: ...

    def paused(self) -> Any:
        """An async context manager: generation paused for its body, resumed after it."""
        ...

    async def receive(self, plan: BroadcastPlan, options: BroadcastOptions) -> list[dict[str, int]] | None:
        """Receive `plan`'s buckets and load them (the caller broadcasts them meanwhile); under paused().
        Returns each worker's checksums of what it received (None: the engine reports none)."""
        ...

    async def finish(self, weight_version: int) -> None:
        """After a successful receive, under paused(): drop cached prefixes and record the version."""
        ...

    async def check_version(self, weight_version: int) -> None: ...


def receive_timeout_s(plan: BroadcastPlan, options: BroadcastOptions) -> float:
    """Bound on one receive call: every bucket at its bound, then the load at its own."""
    return len(plan.buckets) * options.bucket_timeout_s + options.load_timeout_s


class VLLMReceiver:
    """vLLM's side: the worker extension's rollouts_init_broadcast / rollouts_receive_broadcast
    methods, called over /collective_rpc (every worker of the server runs them)."""

    layout = "flat"

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine

    @property
    def name(self) -> str:
        return self.engine.name

    async def _rpc(self, method: str, kwargs: dict[str, str], timeout_s: float) -> list[Any]:
        body = {"method": method, "kwargs": kwargs, "timeout": timeout_s}
        response = await self.engine._call("POST", "/collective_rpc", json=body, timeout_s=timeout_s, retry=_NO_RETRY)
        data = self.engine._json_or_empty(response)
        results = data.get("results") or []
        for result in results:
            if isinstance(result, dict) and result.get("error"):
                raise EngineError(
                    f"{self.name}: {method} failed: {result['error']}",
                    engine=self.name,
                    url=f"{self.name}/collective_rpc",
                    status=200,
                    text=str(result["error"]),
                )
        return list(results)

    async def num_workers(self) -> int:
        return len(await self._rpc("rollouts_broadcast_rank", {}, self.engine.timeout_s))

    async def join(self, *, host: str, port: int, group: str, world_size: int, options: BroadcastOptions) -> None:
        kwargs = {
            "host": host,
            "port": str(port),
            "group": group,
            "rank_offset": "1",
            "world_size": str(world_size),
            "backend": options.backend,
            "setup_timeout_s": str(options.setup_timeout_s),
            "bucket_timeout_s": str(options.bucket_timeout_s),
        }
        await self._rpc("rollouts_init_broadcast", kwargs, options.setup_timeout_s)

    def paused(self) -> Any:
        return self.engine._paused("/pause", "/resume", params={"mode": self.engine.pause_mode})

    async def receive(self, plan: BroadcastPlan, options: BroadcastOptions) -> list[dict[str, int]] | None:
        results = await self._rpc(
            "rollouts_receive_broadcast", {"plan_json": plan.to_json()}, receive_timeout_s(plan, options)
        )
        return [dict(r.get("checksums") or {}) for r in results if isinstance(r, dict)]

    async def finish(self, weight_version: int) -> None:
        await self.engine.reset_prefix_cache()
        await self.engine._call("POST", "/update_weight_version", json={"new_version": str(weight_version)})
        self.engine._adapter = None  # full weights: the base model serves again

    async def check_version(self, weight_version: int) -> None:
        await self.engine._check_version(weight_version)


class SGLangReceiver:
    """SGLang's side: its native /init_weights_update_group and /update_weights_from_distributed
    (every tensor of the plan in one call, so SGLang loads only once all of them arrived)."""

    layout = "tensors"

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine
        self._group = ""

    @property
    def name(self) -> str:
        return self.engine.name

    async def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> None:
        data = (await self.engine._call("POST", path, json=body, timeout_s=timeout_s, retry=_NO_RETRY)).json()
        if not data.get("success", False):
            raise EngineError(
                f"{self.name}: {path} failed: {data.get('message')}",
                engine=self.name,
                url=f"{self.name}{path}",
                status=200,
                text=str(data.get("message")),
            )

    async def num_workers(self) -> int:
        info = (await self.engine._call("GET", "/get_server_info")).json()
        return int(info.get("tp_size") or 1)

    async def join(self, *, host: str, port: int, group: str, world_size: int, options: BroadcastOptions) -> None:
        body = {
            "master_address": host,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "group_name": group,
            "backend": options.backend,
        }
        await self._post("/init_weights_update_group", body, options.setup_timeout_s)
        self._group = group

    def paused(self) -> Any:
        return self.engine._paused("/pause_generation", "/continue_generation")

    async def receive(self, plan: BroadcastPlan, options: BroadcastOptions) -> list[dict[str, int]] | None:
        tensors = [t for bucket in plan.buckets for t in bucket]
        body = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self._group,
            "flush_cache": True,
            "weight_version": str(plan.weight_version),
        }
        await self._post("/update_weights_from_distributed", body, receive_timeout_s(plan, options))
        return None  # SGLang reports no checksums of what it loaded

    async def finish(self, weight_version: int) -> None:
        del weight_version  # SGLang records it and flushes its cache within the update itself

    async def check_version(self, weight_version: int) -> None:
        got = await self.engine.weight_version()
        if got != weight_version:
            raise EngineError(
                f"{self.name}: weight version reads {got!r} after setting {weight_version}",
                engine=self.name,
                url=f"{self.name}/get_weight_version",
                status=200,
                text=str(got),
            )


def receiver_for(engine: object) -> BroadcastReceiver:
    """The receiver for a VLLMEngine or an SGLangEngine (or a wrapper exposing one as `.engine`)."""
    inner = engine
    for _ in range(4):  # wrappers (BoundedSync, SendWeights, ...) hold the client as .engine
        if isinstance(inner, (VLLMEngine, SGLangEngine)):
            break
        inner = getattr(inner, "engine", None)
    if isinstance(inner, VLLMEngine):
        return VLLMReceiver(inner)
    if isinstance(inner, SGLangEngine):
        return SGLangReceiver(inner)
    raise TypeError(
        f"the broadcast transport reaches vLLM and SGLang servers only (VLLMEngine, SGLangEngine), "
        f"got {type(engine).__name__}"
    )
