"""vLLM worker extension: load weights sent as safetensors bytes, fetched raw from the trainer or in
a /collective_rpc body.

Start the server with `--worker-extension-cls rollouts.sync.worker_extension.SafetensorsWeightLoader`
(this module runs inside vLLM's worker process: standard library, torch and
rollouts.sync.fingerprint_torch; in rollouts.sync only the broadcast transport's torch half imports it,
for the process-group helpers both sides share).

Partial updates: a request may name only some checkpoint tensors. vLLM reloads a layer as a whole
(on CPU it repacks linear weights and drops the originals, and a fused qkv_proj is built from
q/k/v together), so the extension keeps the full checkpoint-format weights in host memory:
loaded once from the model directory the server last loaded, updated by each request, and fed
whole to vLLM's in-place `reload_weights`. Cost: one extra copy of the weights in host memory.

Raw fetch: `rollouts_fetch_weights` GETs one safetensors payload from a one-off URL the trainer
serves (rollouts.sync.raw_server) into one buffer, the tensors being views of it: the bytes on the
wire are the tensors' own, no base64, no JSON, no copy through vLLM's API process.

Each call answers "seconds": its own steps' durations (receive, checksum, load), for profiles.

Attestation: each load answers the checksums (rollouts.sync.fingerprint) of the tensors this worker
received, and `rollouts_fingerprint` those of the checkpoint files a disk reload read, computed here
in the worker. ROLLOUTS_SYNC_FAULT (see rollouts.sync.fingerprint) flips a bit of the named tensor
after receipt, for tests of the check.

Broadcast: `rollouts_init_broadcast` joins a process group made for the sync (a TCPStore client
of the trainer's store and a gloo or NCCL group on it; vLLM's own groups are never touched), and
`rollouts_receive_broadcast` receives a plan's flat buckets from the trainer (rank 0), then reloads
through the same path as `rollouts_load_weights`, only once every bucket arrived.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

try:
    from rollouts.sync.fingerprint_torch import fingerprint_torch, flip_bit_torch, sync_fault_target
except ModuleNotFoundError:  # in a server started by rollouts.sync.launch: its copy beside this one's
    from rollouts_fingerprint_torch import fingerprint_torch, flip_bit_torch, sync_fault_target  # type: ignore[no-redef,import-not-found]

_SAFETENSORS_SUFFIX = ".safetensors"
_TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}
"""torch's name of each safetensors dtype."""


def _files_signature(model_dir: str) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of each safetensors file: changes when the directory is rewritten."""
    out = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(_SAFETENSORS_SUFFIX):
            st = os.stat(os.path.join(model_dir, name))
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _received(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` as received, with the fault ROLLOUTS_SYNC_FAULT asks for injected (a test hook)."""
    target = sync_fault_target()
    if target is not None and target in tensors:
        flip_bit_torch(tensors[target])
    return tensors


def _checksums(tensors: dict[str, Any]) -> dict[str, int]:
    return fingerprint_torch(tensors)  # one wait for the device per load


def _read_dir(path: str) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(_SAFETENSORS_SUFFIX):
            tensors.update(load_file(os.path.join(path, name), device="cpu"))
    return tensors


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
) -> Any:
    """A process group of its own on `store` (never the default group). Blocks until all `world_size`
    ranks joined, at most `setup_timeout_s`; each collective on it is then bounded by `bucket_timeout_s`."""
    group_ = _new_group(dist.PrefixStore(f"{group}/", store), rank, world_size, backend, address, setup_timeout_s)  # type: ignore[attr-defined]
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


def receive_flat_buckets(group: Any, plan: dict[str, Any], device: Any) -> Iterator[dict[str, Any]]:
    """The tensors of each of a plan's flat buckets as it arrives, views into one buffer per bucket,
    filled by the bucket's "pieces" ([start, end) bytes, one broadcast each; the whole buffer in one
    when the plan names none)."""
    for bucket in plan["buckets"]:
        num_bytes = int(bucket["nbytes"])
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        for start, end in bucket.get("pieces") or [[0, num_bytes]]:
            broadcast_from_trainer(group, buffer[int(start) : int(end)])
        out: dict[str, Any] = {}
        for name, dtype, shape, offset in bucket["tensors"]:
            kind = getattr(torch, dtype)
            size = torch.Size(shape).numel() * torch.empty((), dtype=kind).element_size()
            out[name] = buffer[offset : offset + size].view(kind).view(shape)
        yield out


def receive_tensor_list(group: Any, specs: list[tuple[str, str, list[int]]], device: Any) -> dict[str, Any]:
    """(name, dtype, shape) tensors received one broadcast each, in order (SGLang's layout)."""
    out: dict[str, Any] = {}
    for name, dtype, shape in specs:
        out[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        broadcast_from_trainer(group, out[name])
    return out


def fetch_bytes(url: str, num_bytes: int, timeout_s: float) -> Any:
    """The `num_bytes` bytes GET `url` answers, read into one uint8 tensor, all within `timeout_s`."""
    parts = urllib.parse.urlsplit(url)
    where = f"{parts.hostname}:{parts.port}"  # the path holds the token: never in a message
    deadline = time.monotonic() + timeout_s
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path)
        response = conn.getresponse()
        length = response.getheader("Content-Length")
        if response.status != 200 or length != str(num_bytes):
            raise RuntimeError(
                f"fetching weights from {where}: answered {response.status} with Content-Length {length}, "
                f"expected 200 with {num_bytes}"
            )
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        view = buffer.numpy().data
        received = 0
        while received < num_bytes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fetching weights from {where}: {received} of {num_bytes} bytes in {timeout_s} s")
            got = response.readinto(view[received:])
            if not got:
                raise RuntimeError(f"fetching weights from {where}: closed after {received} of {num_bytes} bytes")
            received += got
        return buffer
    finally:
        conn.close()


def tensors_of_safetensors(buffer: Any) -> dict[str, Any]:
    """The tensors of a safetensors payload in uint8 tensor `buffer`, as views of it (a copy only for
    a tensor whose offset its dtype cannot view at)."""
    head = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
    header = json.loads(buffer[8 : 8 + head].numpy().tobytes())
    body = buffer[8 + head :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = (int(x) for x in entry["data_offsets"])
        kind = getattr(torch, _TORCH_DTYPES[entry["dtype"]])
        data = body[start:end]
        if data.storage_offset() % kind.itemsize:
            data = data.clone()
        out[name] = data.view(kind).view(entry["shape"])
    return out


class SafetensorsWeightLoader:
    """Mixed into vLLM's Worker class; its methods are called through POST /collective_rpc."""

    def _rollouts_base_weights(self) -> dict[str, Any]:
        model_dir = str(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        signature = (model_dir, _files_signature(model_dir))
        cache = getattr(self, "_rollouts_weights", None)
        if cache is None or getattr(self, "_rollouts_signature", None) != signature:
            cache = {}
            for name, _, _ in signature[1]:
                cache.update(load_file(os.path.join(model_dir, name), device="cpu"))
            self._rollouts_weights = cache
            self._rollouts_signature = signature
        return cache

    def rollouts_broadcast_rank(self) -> dict[str, Any]:
        """This worker's rank among the server's workers (one answer per worker: their count sizes the group)."""
        return {"rank": int(self.rank)}  # type: ignore[attr-defined]

    def rollouts_init_broadcast(
        self,
        host: str,
        port: str,
        group: str,
        rank_offset: str,
        world_size: str,
        backend: str,
        setup_timeout_s: str,
        bucket_timeout_s: str,
    ) -> dict[str, Any]:
        """Join the trainer's process group for weight broadcasts as rank `rank_offset` + this worker's rank."""
        rank = int(rank_offset) + int(self.rank)  # type: ignore[attr-defined]
        self._rollouts_group_device = self.device if backend == "nccl" else torch.device("cpu")  # type: ignore[attr-defined]
        self._rollouts_group = connect_to_trainer(
            host,
            int(port),
            group=group,
            rank=rank,
            world_size=int(world_size),
            backend=backend,
            setup_timeout_s=float(setup_timeout_s),
            bucket_timeout_s=float(bucket_timeout_s),
        )
        return {"rank": rank}

    def rollouts_receive_broadcast(self, plan_json: str) -> dict[str, Any]:
        """Receive every bucket of the plan, then reload with them (all or nothing: a failure before the
        last bucket, or in the load, leaves the weights as they were). Answers the checksums of the
        tensors as received, for the trainer's attestation."""
        group = getattr(self, "_rollouts_group", None)
        if group is None:
            raise RuntimeError("no broadcast group: call rollouts_init_broadcast first")
        plan = json.loads(plan_json)
        start = time.perf_counter()
        incoming: dict[str, Any] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="rollouts-checksum") as pool:
            pending = []  # each bucket's checksums, computed while the next one arrives
            for tensors in receive_flat_buckets(group, plan, self._rollouts_group_device):
                incoming.update(_received(tensors))
                pending.append(pool.submit(_checksums, tensors))
            seconds = {"receive": time.perf_counter() - start}
            checksums = {name: value for done in pending for name, value in done.result().items()}
        seconds["checksum"] = time.perf_counter() - start - seconds["receive"]  # what was left after the last bucket
        answer = self._rollouts_apply(incoming, seconds, checksums=checksums)
        return {**answer, "num_bytes": sum(int(b["nbytes"]) for b in plan["buckets"])}

    def rollouts_fetch_weights(self, url: str, num_bytes: str, timeout_s: str) -> dict[str, Any]:
        """Fetch one safetensors payload of `num_bytes` bytes from `url` (raw bytes, within `timeout_s`),
        then reload with its tensors (all or nothing). Answers their checksums as received."""
        start = time.perf_counter()
        incoming = _received(tensors_of_safetensors(fetch_bytes(url, int(num_bytes), float(timeout_s))))
        return self._rollouts_apply(incoming, {"receive": time.perf_counter() - start})

    def rollouts_load_dir(self, weights_path: str) -> dict[str, Any]:
        """Reload from the checkpoint files at `weights_path` (as vLLM's reload_weights does from a path),
        reading them once: answers the checksums of what it read, for the trainer's attestation."""
        start = time.perf_counter()
        incoming = _received(_read_dir(weights_path))
        return self._rollouts_apply(incoming, {"read": time.perf_counter() - start}, known_only=False)

    def _rollouts_apply(
        self,
        incoming: dict[str, Any],
        seconds: dict[str, float],
        *,
        known_only: bool = True,
        checksums: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """Reload with the base weights updated by `incoming` (checked first: with `known_only` every name
        must be a checkpoint tensor's, and each shape must match); the cache takes them once the reload
        succeeded. Answers the checksums of `incoming` (computed here unless given) and each step's seconds."""
        weights = self._rollouts_base_weights()
        if known_only:
            unknown = sorted(set(incoming) - set(weights))
            if unknown:
                raise ValueError(f"tensors not in the model's checkpoint: {unknown[:10]} ({len(unknown)} in all)")
        for name, tensor in incoming.items():
            if name in weights and tuple(tensor.shape) != tuple(weights[name].shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the checkpoint has {tuple(weights[name].shape)}"
                )
        if checksums is None:
            start = time.perf_counter()
            checksums = _checksums(incoming)
            seconds["checksum"] = time.perf_counter() - start
        start = time.perf_counter()
        # vLLM's parameters do not require grad, so no autograd graph is built here.
        self.reload_weights(weights_iterator=iter(list({**weights, **incoming}.items())))  # type: ignore[attr-defined]
        seconds["load"] = time.perf_counter() - start
        # the cache is host memory: GPU buffers are copied out, CPU ones kept (they outlive the bucket)
        weights.update({name: tensor.to("cpu") for name, tensor in incoming.items()})
        return {"num_tensors": len(incoming), "checksums": checksums, "seconds": seconds}

    def rollouts_load_weights(self, data_b64: str, apply: str = "1", first: str = "1") -> dict[str, Any]:
        """Stage the tensors in `data_b64` (base64 safetensors); with apply="1" reload the model with them.

        An update is a run of chunks: the first has first="1" (it drops whatever a failed earlier
        update left staged), the last apply="1". The staged tensors join the cached weights only
        once the reload succeeds, and any error drops them, so a failed update never leaks into a
        later one. Each request is checked whole before anything is staged. Returns
        {"num_tensors": tensors in this request, "applied": bool, "checksums": {name: checksum of
        the tensor as received}}. Unknown tensor names are an error (named), so a typo cannot
        silently leave a weight stale.
        """
        if first == "1" or not hasattr(self, "_rollouts_staged"):
            self._rollouts_staged: dict[str, Any] = {}
        try:
            weights = self._rollouts_base_weights()
            incoming = _received(load_bytes(base64.b64decode(data_b64)))
            unknown = sorted(set(incoming) - set(weights))
            if unknown:
                raise ValueError(f"tensors not in the model's checkpoint: {unknown[:10]} ({len(unknown)} in all)")
            for name, tensor in incoming.items():
                if tuple(tensor.shape) != tuple(weights[name].shape):
                    raise ValueError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, the checkpoint has {tuple(weights[name].shape)}"
                    )
            self._rollouts_staged.update(incoming)
            applied = apply == "1"
            if applied:
                staged, self._rollouts_staged = self._rollouts_staged, {}
                # vLLM's parameters do not require grad, so no autograd graph is built here.
                self.reload_weights(weights_iterator=iter(list({**weights, **staged}.items())))  # type: ignore[attr-defined]
                weights.update(staged)
        except BaseException:
            self._rollouts_staged = {}
            raise
        return {"num_tensors": len(incoming), "applied": applied, "checksums": _checksums(incoming)}

    def rollouts_fingerprint(self, weights_path: str) -> dict[str, Any]:
        """{"checksums": {name: checksum}} of the checkpoint tensors at `weights_path` as this worker
        reads them (the files a disk reload from there loaded)."""
        return {"checksums": _checksums(_received(_read_dir(weights_path)))}
