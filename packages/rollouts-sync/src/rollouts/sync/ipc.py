"""The IPC wire of vLLM's worker extension, the trainer's side (needs torch): a server on this
machine takes the weights from buckets of the trainer's own memory, not through a socket.

    engine = VLLMEngine(url, tensor_wire="ipc")
    await engine.update_weights_from_tensors(model.state_dict(), version)

Weights on a CUDA device go as CUDA IPC handles: each bucket is one device-to-device copy of its
tensors into a flat buffer on the trainer's GPU, whose handle the workers map (the engine on the
same GPU, or another of this machine's), copying it out device to device; no byte crosses the
host. Weights in host memory go through a file in /dev/shm per bucket. Either way the bytes stay
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
from collections.abc import Generator, Mapping
from typing import Any

import torch

from rollouts.sync.broadcast_wire import DTYPE_BYTES, BroadcastPlan, plan_buckets
from rollouts.sync.fingerprint_torch import fingerprint_torch
from rollouts.sync.ipc_handles import ShmFile, share
from rollouts.sync.raw import RawTensor, as_raw
from rollouts.sync.tensor_rpc import TensorUpload, body_bytes
from rollouts.sync.worker_receive import TORCH_DTYPE_NAMES

__all__ = ["IpcUpdate"]


class IpcUpdate:
    """One sync of `tensors` (torch tensors all on one device, numpy arrays or RawTensors: the host's)
    by IPC, in buckets of at most `bucket_bytes` (a larger tensor alone in its bucket)."""

    def __init__(self, tensors: Mapping[str, Any], *, bucket_bytes: int, weight_version: int, checksums: bool) -> None:
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the trainer's writes, on any stream, end before staging reads
        for k, bucket in enumerate(self.plan.buckets):
            size = self.plan.bucket_bytes(k)
            shm, flat = ShmFile.create(size) if self.device.type == "cpu" else (None, None)
            try:
                if flat is None:
                    flat = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)  # no bytes, no handle
                for spec in bucket:
                    target = flat[spec.offset : spec.offset + spec.num_bytes]
                    target.view(getattr(torch, spec.dtype)).view(spec.shape).copy_(self.tensors[spec.name])
                kwargs = {"token": token, "index": str(k), "handle_json": json.dumps(share(flat, shm))}
                if k == 0:
                    kwargs["plan_json"] = plan_json
                rpc = {"method": "rollouts_receive_ipc", "kwargs": kwargs}
                self.body_bytes += body_bytes(rpc)
                yield rpc
            finally:
                del flat  # the workers answered (or the sync failed): the bucket goes
                if shm is not None:
                    shm.remove()

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
