"""The broadcast transport's torch-free half: its options and the bucket plan.

A sync sends the model as buckets. Both sides agree on the plan before the bytes flow: the trainer
POSTs it to the engine, which then receives every bucket from the process group and loads only
after the last one arrived (all or nothing). vLLM receives one flat byte buffer per bucket (the
"flat" layout: each tensor's bytes at an aligned offset), filled piece by piece: a tensor of at
least SMALL_TENSOR_BYTES is a broadcast of its own, sent straight from the trainer's memory (no
copy), and each run of smaller neighbours one broadcast, packed; SGLang's
/update_weights_from_distributed receives one broadcast per tensor (the "tensors" layout), as its
own trainers send them.

The torch half, `rollouts.sync.broadcast.BroadcastSync`, runs the process group on the trainer;
each engine's side of the HTTP control calls is in rollouts.sync.broadcast_receivers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollouts.sync._common import check_seconds, check_weight_version

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
    stage: str = "auto"
    """Where a vLLM worker holds an NCCL sync's buckets until the load (all or nothing): "device" (on
    its GPU: the model's size beside vLLM's own memory), "host" (each bucket copied out to host memory
    as it arrives: one bucket's room on the GPU, a copy out and back in), or "auto" (the GPU when it
    has room for them all, else the host). A gloo sync's buckets arrive in host memory."""

    def __post_init__(self) -> None:
        size = self.bucket_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"BroadcastOptions.bucket_bytes must be an int >= 1, got {size!r}")
        for name in ("setup_timeout_s", "bucket_timeout_s", "load_timeout_s"):
            check_seconds(f"BroadcastOptions.{name}", getattr(self, name))
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"BroadcastOptions.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.stage not in ("auto", "device", "host"):
            raise ValueError(f"BroadcastOptions.stage must be 'auto', 'device' or 'host', got {self.stage!r}")
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

    def to_json(self, *, checksums: bool = True, stage: str = "auto") -> str:
        """The plan as the engine reads it: per bucket its flat buffer's bytes, its tensors (name,
        dtype, shape, offset) and the [start, end) bytes of each broadcast that fills it; with
        `checksums` False, "checksums": false (the engine sums nothing: the sync is not attested);
        `stage` other than "auto" (BroadcastOptions.stage) as "stage"."""
        buckets = [
            {
                "nbytes": self.bucket_bytes(i),
                "tensors": [[t.name, t.dtype, list(t.shape), t.offset] for t in bucket],
                "pieces": [[p[0].offset, p[-1].offset + p[-1].num_bytes] for p in bucket_pieces(bucket)],
            }
            for i, bucket in enumerate(self.buckets)
        ]
        plan: dict[str, Any] = {"version": self.weight_version, "buckets": buckets}
        if not checksums:
            plan["checksums"] = False
        if stage != "auto":
            plan["stage"] = stage
        return json.dumps(plan)

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


def adapter_config_json(config: Mapping[str, Any]) -> str:
    """`config` as adapter_config.json's text; ValueError unless it is a JSON object with PEFT's
    `r` (the rank) and `target_modules`."""
    if not isinstance(config, Mapping) or "r" not in config or "target_modules" not in config:
        raise ValueError(
            f"adapter_config must be PEFT's adapter_config.json as a dict (with 'r' and 'target_modules'), "
            f"got {config!r:.200}"
        )
    try:
        return json.dumps(dict(config))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"adapter_config is not JSON: {exc}") from exc


def sglang_prefixes(group: str, backend: str) -> tuple[str, ...]:
    """Where an SGLang server's worker keeps group `group`'s keys: its /init_weights_update_group
    wraps the store in PrefixStore(group) (sglang.srt.utils init_custom_process_group), and torch's
    group helper then in f"{group}/" and in the backend's device ("cpu/" for gloo, "cuda/" for NCCL)."""
    return (group, f"{group}/", "cuda/" if backend == "nccl" else "cpu/")
