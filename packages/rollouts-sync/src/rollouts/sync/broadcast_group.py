"""The process group a broadcast sync runs on, both sides of it (needs torch: the `broadcast`
extra): joining a group of its own on the trainer's TCPStore (gloo or NCCL; never the default group,
so it lives beside FSDP's), each collective bounded, and the engine's receive of a plan's buckets.

The trainer's side (rollouts.sync.broadcast) and vLLM's worker extension both use it; a server
started by rollouts.sync.launch gets a copy beside the extension (standard library and torch only).
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def local_address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP connect only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 1))
        address: str = s.getsockname()[0]
        return address


def join_group(
    store: Any,
    *,
    group: str,
    rank: int,
    world_size: int,
    backend: str,
    address: str,
    setup_timeout_s: float,
    bucket_timeout_s: float,
    prefixes: tuple[str, ...] | None = None,
) -> Any:
    """A process group of its own on `store` (never the default group). Blocks until all `world_size`
    ranks joined, at most `setup_timeout_s`; each collective on it is then bounded by `bucket_timeout_s`.
    `prefixes`: where in the store its keys live, outermost first (None: f"{group}/", as this module's
    own engines join; an engine that joins its own way names its layout: see broadcast_wire.sglang_prefixes)."""
    for prefix in prefixes if prefixes is not None else (f"{group}/",):
        store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    group_ = _new_group(store, rank, world_size, backend, address, setup_timeout_s)
    group_._set_default_timeout(timedelta(seconds=bucket_timeout_s))
    return group_


def _new_group(store: Any, rank: int, world_size: int, backend: str, address: str, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend != "gloo":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def close_group(group: Any) -> None:
    """Release a group of join_group's now, not when it is collected: its connections, and on NCCL its
    communicator's GPU memory (a reconnect after a failed sync would otherwise leave one per attempt).
    Best effort: a group broken already may refuse to shut down cleanly, and is aborted instead."""
    if group is None:
        return
    for how in ("shutdown", "abort"):
        close = getattr(group, how, None)
        if close is None:
            continue
        try:
            close()
            return
        except Exception:  # noqa: BLE001, S112 - a broken group: try the next way, else leave it to the collector
            continue


def connect_to_trainer(
    host: str,
    port: int,
    *,
    group: str,
    rank: int,
    world_size: int,
    backend: str,
    setup_timeout_s: float,
    bucket_timeout_s: float,
) -> Any:
    """Join group `group` of the trainer's store at host:port as `rank` (an engine's side)."""
    timeout = timedelta(seconds=setup_timeout_s)
    store = dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)  # type: ignore[attr-defined]
    return join_group(
        store,
        group=group,
        rank=rank,
        world_size=world_size,
        backend=backend,
        address=local_address_toward(host),
        setup_timeout_s=setup_timeout_s,
        bucket_timeout_s=bucket_timeout_s,
    )


def broadcast_from_trainer(group: Any, tensor: Any) -> None:
    """Broadcast `tensor` from rank 0 (the trainer) in place; raises once the group's timeout passes."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


def receive_flat_buckets(
    group: Any, plan: dict[str, Any], device: Any, *, buffers: list[Any] | None = None
) -> Iterator[dict[str, Any]]:
    """The tensors of each of a plan's flat buckets as it arrives, views into one buffer per bucket,
    filled by the bucket's "pieces" ([start, end) bytes, one broadcast each; the whole buffer in one
    when the plan names none). `buffers`: one uint8 tensor of each bucket's size on `device` to
    receive into (None: new ones)."""
    if buffers is not None and len(buffers) != len(plan["buckets"]):
        raise ValueError(f"{len(buffers)} buffers for a plan of {len(plan['buckets'])} buckets")
    for k, bucket in enumerate(plan["buckets"]):
        num_bytes = int(bucket["nbytes"])
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device) if buffers is None else buffers[k]
        if buffer.numel() != num_bytes or buffer.dtype != torch.uint8:
            raise ValueError(
                f"bucket {k} needs a uint8 buffer of {num_bytes} bytes, got {buffer.dtype} of {buffer.numel()}"
            )
        for start, end in bucket.get("pieces") or [[0, num_bytes]]:
            broadcast_from_trainer(group, buffer[int(start) : int(end)])
        yield flat_views(buffer, bucket)


def read_plan(plan_json: str) -> dict[str, Any]:
    """The plan rollouts.sync.broadcast_wire.BroadcastPlan.to_json wrote, checked before any byte is
    received against it: ValueError naming the field and the value for anything that would read a
    tensor outside its bucket, overlap another, repeat a name or not be a dtype torch knows."""
    plan = json.loads(plan_json)
    if not isinstance(plan, dict) or not isinstance(plan.get("buckets"), list) or not plan["buckets"]:
        raise ValueError(f"plan must be an object with a non-empty list 'buckets', got {plan_json[:120]!r}")
    _natural(plan.get("version"), "plan.version")
    if not isinstance(plan.get("checksums", True), bool) or not isinstance(plan.get("stage", "auto"), str):
        raise ValueError(f"plan.checksums must be true or false and plan.stage a string, got {plan_json[:120]!r}")
    names: set[str] = set()
    for k, bucket in enumerate(plan["buckets"]):
        where = f"plan.buckets[{k}]"
        if not isinstance(bucket, dict) or not isinstance(bucket.get("tensors"), list):
            raise ValueError(f"{where} must be an object with a list 'tensors', got {str(bucket)[:120]!r}")
        size = _natural(bucket.get("nbytes"), f"{where}.nbytes")
        end = 0
        spans: list[tuple[int, int]] = []
        for j, tensor in sorted(enumerate(bucket["tensors"]), key=lambda item: _offset_of(item[1])):
            what = f"{where}.tensors[{j}] {str(tensor)[:120]}"
            if not isinstance(tensor, list) or len(tensor) != 4 or not isinstance(tensor[0], str):
                raise ValueError(f"{what} must be [name, dtype, shape, offset]")
            name, dtype, shape, offset = tensor
            kind = getattr(torch, dtype, None) if isinstance(dtype, str) else None
            if dtype not in _WIRE_DTYPES or not isinstance(kind, torch.dtype) or not isinstance(shape, list):
                raise ValueError(f"{what}: the dtype must be one of {sorted(_WIRE_DTYPES)} and the shape a list")
            dims = [_natural(n, f"{what}: shape") for n in shape]
            element = torch.empty((), dtype=kind).element_size()
            start = _natural(offset, f"{what}: offset")
            num_bytes = math.prod(dims) * element  # Python's ints: torch.Size's numel wraps past 2^63
            if start % element or start < end or start + num_bytes > size:
                raise ValueError(
                    f"{what}: must start at a multiple of {element} bytes after the tensor before it "
                    f"(which ends at {end}) and end within the bucket's {size} bytes"
                )
            if name in names:
                raise ValueError(f"{what}: the name {name!r} comes twice in the plan")
            names.add(name)
            spans.append((start, start + num_bytes))
            end = start + num_bytes
        previous = 0
        for piece in bucket.get("pieces") or []:
            start, stop = piece if isinstance(piece, list) and len(piece) == 2 else (-1, -1)
            if type(start) is not int or type(stop) is not int or not previous <= start <= stop <= size:
                raise ValueError(f"{where}.pieces: {str(piece)[:60]} must be [start, end] in order within {size} bytes")
            previous = stop
        pieces = bucket.get("pieces") or [[0, size]]
        for start, stop in spans:  # every tensor's bytes are received (a buffer kept between syncs holds old ones)
            if stop > start and not any(a <= start and stop <= b for a, b in pieces):
                raise ValueError(f"{where}: bytes [{start}, {stop}) of a tensor are in none of its pieces")
    return plan


_WIRE_DTYPES = frozenset(
    {"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}
    | {"int64", "int32", "int16", "int8", "uint8", "bool"}
)
"""The dtypes a plan's tensor may have: rollouts.sync.broadcast_wire.DTYPE_BYTES's (this module
travels without it)."""


def _natural(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, got {value!r:.80}")
    return value


def _offset_of(tensor: Any) -> int:
    """Where a plan's tensor starts, for sorting before it is checked (anything malformed first)."""
    return tensor[3] if isinstance(tensor, list) and len(tensor) == 4 and type(tensor[3]) is int else -1


def flat_views(buffer: Any, bucket: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a plan's flat `bucket` as views of its uint8 `buffer`."""
    out: dict[str, Any] = {}
    for name, dtype, shape, offset in bucket["tensors"]:
        kind = getattr(torch, dtype)
        size = torch.Size(shape).numel() * torch.empty((), dtype=kind).element_size()
        out[name] = buffer[offset : offset + size].view(kind).view(shape)
    return out


def receive_tensor_list(group: Any, specs: list[tuple[str, str, list[int]]], device: Any) -> dict[str, Any]:
    """(name, dtype, shape) tensors received one broadcast each, in order (SGLang's layout)."""
    out: dict[str, Any] = {}
    for name, dtype, shape in specs:
        out[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        broadcast_from_trainer(group, out[name])
    return out


def join_as_sglang(
    host: str, port: int, *, group: str, rank: int, world_size: int, backend: str, timeout_s: float
) -> Any:
    """Join the trainer's group as an SGLang worker's /init_weights_update_group does (sglang.srt.utils
    init_custom_process_group): a rendezvous at tcp://host:port, the store wrapped in
    PrefixStore(group), then torch's own group helper, which wraps it in f"{group}/" and the device's
    prefix (broadcast_wire.sglang_prefixes). For the fake SGLang server: its keys are where a real
    SGLang worker's are, so a test meets the layout the trainer must use."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(c10d.rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))  # type: ignore[attr-defined]
    store.set_timeout(timeout)
    group_, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group, store),
        group_name=group,  # type: ignore[arg-type]
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group_] = {i: i for i in range(world_size)}  # as SGLang registers it
    return group_


def destroy_sglang_group(group: Any) -> None:
    """Destroy a group `join_as_sglang` made, as SGLang's /destroy_weights_update_group does."""
    dist.destroy_process_group(group)
