"""The IPC wire of vLLM's worker extension, the trainer's side (needs torch): a server on this
machine takes the weights from buckets of the trainer's own memory, not through a socket.

    engine = VLLMEngine(url, tensor_wire="ipc")
    await engine.update_weights_from_tensors(model.state_dict(), version)

Weights on a CUDA device go as CUDA IPC handles: each bucket is one device-to-device copy of its
tensors into a flat buffer on the trainer's GPU, whose handle the workers map (the engine on the
same GPU, or another of this machine's), copying it out device to device; no byte crosses the
host. Weights in host memory go through one file in /dev/shm (`ShmBuckets`: the engine's client
keeps it from bucket to bucket and sync to sync, so its pages are allocated once). Either way the bytes stay
in the tensors' own dtype, laid out as a broadcast plan's flat buckets (rollouts.sync.broadcast_wire),
and one /collective_rpc call per bucket (`IpcUpdate.rpcs`) carries its handle: the trainer stages
bucket k, the workers copy it out and answer, the trainer frees it and stages bucket k + 1, so no
more than one bucket of memory is held beyond the weights. The workers reload once the last bucket
arrived (all or nothing; rollouts.sync.worker_ipc).

Why buckets staged rather than handles to the weights' own storages: the trainer changes its
weights in place at its next step, and a handle to a parameter's storage keeps a reference-counted
record alive for the whole run (see rollouts-backends' engine_process.cuda_ipc).
"""

from __future__ import annotations

import json
import secrets
import warnings
import weakref
from collections.abc import Generator, Mapping
from typing import Any

import torch

from rollouts.sync.broadcast_wire import DTYPE_BYTES, BroadcastPlan, plan_buckets
from rollouts.sync.fingerprint_torch import fingerprint_torch
from rollouts.sync.ipc_handles import ShmFile, share
from rollouts.sync.raw import RawTensor, as_raw
from rollouts.sync.tensor_rpc import TensorUpload, body_bytes
from rollouts.sync.worker_receive import TORCH_DTYPE_NAMES

__all__ = ["IpcUpdate", "ShmBuckets"]


class ShmBuckets:
    """The file in /dev/shm that carries a trainer's buckets in host memory to one server, kept from
    bucket to bucket and sync to sync (a fresh file's pages are allocated and zeroed on first touch:
    on a CPU here about 0.5 s per GB, as slow as the copy itself) and grown when a bucket needs more;
    `close()` removes it (so does the interpreter's exit; a killed process's file goes when the next
    one is made: rollouts.sync.ipc_handles.remove_orphans)."""

    def __init__(self) -> None:
        self._file: ShmFile | None = None
        self._flat: torch.Tensor | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def take(self, size_bytes: int) -> tuple[ShmFile, torch.Tensor]:
        """The file (at least `size_bytes`) and this process's mapping of its first `size_bytes`."""
        if self._file is None or self._file.size_bytes < size_bytes:
            self.close()
            self._file, self._flat = ShmFile.create(size_bytes)
            self._finalizer = weakref.finalize(self, self._file.remove)
        assert self._flat is not None
        return self._file, self._flat[:size_bytes]

    def close(self) -> None:
        self._flat = None
        if self._finalizer is not None:
            self._finalizer()  # removes the file, once
        self._file = self._finalizer = None


class IpcUpdate:
    """One sync of `tensors` (torch tensors all on one device, numpy arrays or RawTensors: the host's)
    by IPC, in buckets of at most `bucket_bytes` (a larger tensor alone in its bucket); tensors in host
    memory through `shm` (None: a file of this sync's own, removed when it ends)."""

    def __init__(
        self,
        tensors: Mapping[str, Any],
        *,
        bucket_bytes: int,
        weight_version: int,
        checksums: bool,
        shm: ShmBuckets | None = None,
    ) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes (chunk_bytes) must be an int >= 1, got {bucket_bytes!r}")
        if not isinstance(tensors, Mapping) or not tensors:
            raise ValueError("tensors must be a non-empty mapping of name -> torch tensor, numpy array or RawTensor")
        self.tensors = {name: _as_torch(value, name) for name, value in tensors.items()}
        devices = sorted({str(t.device) for t in self.tensors.values()})
        if len(devices) != 1 or (devices[0] != "cpu" and not devices[0].startswith("cuda")):
            raise ValueError(f"an IPC sync takes tensors all on one CUDA device or all on the CPU, got {devices}")
        self.device = torch.device(devices[0])
        specs = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in self.tensors.items()]
        self.plan: BroadcastPlan = plan_buckets(specs, bucket_bytes=bucket_bytes, weight_version=weight_version)
        self.checksums = checksums
        self.shm = shm
        self.body_bytes = 0
        """The /collective_rpc bodies' bytes sent so far (handles and the plan, no tensor bytes)."""

    def expected(self) -> dict[str, int]:
        """The trainer's checksums of the tensors (rollouts.sync.fingerprint), computed where they live."""
        return fingerprint_torch(self.tensors)

    def rpcs(self) -> Generator[dict[str, Any], None, None]:
        """The /collective_rpc body of each bucket, in order; bucket k is staged when its body is asked
        for and freed when the next one is (or when the iterator is closed): ask for the next only once
        the workers answered."""
        token = secrets.token_hex(8)
        plan_json = self.plan.to_json(checksums=self.checksums)
        on_host = self.device.type == "cpu"
        buckets = (self.shm or ShmBuckets()) if on_host else None
        if not on_host:
            torch.cuda.synchronize(self.device)  # the trainer's writes, on any stream, end before staging reads
        sizes = [max(self.plan.bucket_bytes(k), 1) for k in range(len(self.plan.buckets))]  # no bytes, no handle
        try:
            for k in range(len(self.plan.buckets)):
                shm, flat = self._stage(k, buckets, sizes)
                kwargs = {"token": token, "index": str(k), "handle_json": json.dumps(share(flat, shm))}
                if k == 0:
                    kwargs["plan_json"] = plan_json
                rpc = {"method": "rollouts_receive_ipc", "kwargs": kwargs}
                self.body_bytes += body_bytes(rpc)
                yield rpc
                del flat  # the workers answered: the bucket is free (on a GPU, back to torch's allocator)
        finally:
            if buckets is not None and buckets is not self.shm:
                buckets.close()

    def _stage(self, k: int, buckets: ShmBuckets | None, sizes: list[int]) -> tuple[ShmFile | None, torch.Tensor]:
        """Bucket k filled: in the file of `buckets` (host memory), else a fresh buffer on the device.
        No view of it outlives this call but the one returned, so dropping that frees the bucket."""
        if buckets is not None:
            shm, file_flat = buckets.take(max(sizes))
            flat = file_flat[: sizes[k]]
        else:
            shm, flat = None, torch.empty(sizes[k], dtype=torch.uint8, device=self.device)
        for spec in self.plan.buckets[k]:
            view = flat[spec.offset : spec.offset + spec.num_bytes].view(getattr(torch, spec.dtype))
            view.view(spec.shape).copy_(self.tensors[spec.name])
        return shm, flat

    def upload(self) -> TensorUpload:
        """What the sync moved: the tensors' own bytes, shared bucket by bucket; no tensor byte in a body."""
        return TensorUpload(
            num_tensors=len(self.tensors),
            tensor_bytes=self.plan.num_bytes,
            body_bytes=self.body_bytes,
            num_requests=len(self.plan.buckets),
            shared_bytes=sum(self.plan.bucket_bytes(k) for k in range(len(self.plan.buckets))),
        )


def _as_torch(value: Any, name: str) -> torch.Tensor:
    """`value` as a contiguous torch tensor of a dtype a plan carries (a RawTensor or numpy array as a
    view of its bytes, no copy)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().contiguous()
    else:
        raw: RawTensor = as_raw(value, name=f"tensors[{name!r}]")
        with warnings.catch_warnings():  # a read-only buffer (a memory-mapped file): only read here
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(raw.data)
        tensor = flat.view(getattr(torch, TORCH_DTYPE_NAMES[raw.dtype])).view(raw.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise TypeError(f"tensors[{name!r}]: dtype {dtype} cannot travel by IPC; takes {sorted(DTYPE_BYTES)}")
    return tensor
