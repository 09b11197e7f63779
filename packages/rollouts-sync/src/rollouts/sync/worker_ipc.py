"""vLLM worker extension, the IPC wire: weights in buckets of memory the trainer shares on this
machine, one /collective_rpc call per bucket (rollouts.sync.ipc is the trainer's side).

A bucket is named by rollouts.sync.ipc_handles: a CUDA IPC handle (the trainer's GPU memory: the
worker copies device to device, no byte crosses the host) or a file in /dev/shm (a trainer on the
CPU). Its layout is a broadcast plan's flat bucket (rollouts.sync.broadcast_wire), sent with bucket 0.

Each call maps its bucket, copies it out whole (one copy: into the worker's GPU when it has room
for every bucket, else into the host buffer kept between syncs, as a broadcast stages them), drops
a CUDA mapping and answers; the trainer frees the bucket then and fills the next one. The trainer's
file in /dev/shm is one file for every bucket and sync: it stays mapped here while it is the same
file (a bucket's size of host memory, held until the trainer makes another or this process ends). The copies'
checksums are summed in a thread while the next bucket comes. The reload runs only once the last
bucket arrived (all or nothing: a failure on the way, or a bucket of another sync, drops what was
staged and leaves the weights as they were), through the same path as every other load.

Standard library and torch only, with of rollouts.sync ipc_handles, broadcast_group,
fingerprint_torch and worker_receive (copies beside it in a server started by rollouts.sync.launch).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

try:
    from rollouts.sync.broadcast_group import flat_views, read_plan
    from rollouts.sync.fingerprint_torch import fingerprint_torch, with_sync_fault
    from rollouts.sync.ipc_handles import ShmFile, mapped
    from rollouts.sync.worker_receive import HeldLoads, stage_on_host
except ModuleNotFoundError:  # in a server started by rollouts.sync.launch: their copies beside this one
    from rollouts_broadcast_group import flat_views, read_plan  # type: ignore[no-redef,import-not-found]
    from rollouts_fingerprint_torch import fingerprint_torch, with_sync_fault  # type: ignore[no-redef,import-not-found]
    from rollouts_ipc_handles import ShmFile, mapped  # type: ignore[no-redef,import-not-found]
    from rollouts_worker_receive import HeldLoads, stage_on_host  # type: ignore[no-redef,import-not-found]

__all__ = ["IpcReceive", "IpcWeightReceiver"]


class IpcReceive:
    """One sync's buckets as they arrive: copied into `buffers` (one per bucket, on the worker's GPU
    or in host memory), their checksums summed in a thread of its own."""

    def __init__(self, token: str, plan: dict[str, Any], buffers: list[torch.Tensor]) -> None:
        if len(buffers) != len(plan["buckets"]):
            raise ValueError(f"{len(buffers)} buffers for a plan of {len(plan['buckets'])} buckets")
        self.token, self.plan, self.buffers = token, plan, buffers
        self.next = 0
        self.incoming: dict[str, Any] = {}
        self.summing = plan.get("checksums", True) is not False  # false: an unattested sync
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-checksum")
        self._pending: list[Future[dict[str, int]]] = []
        self._start = time.perf_counter()

    def take(self, index: int, flat: torch.Tensor) -> None:
        """Bucket `index` (the next one) from its mapping `flat`, copied out before this returns."""
        if index != self.next:
            raise ValueError(f"bucket {index} of sync {self.token} arrived, expected bucket {self.next}")
        bucket = self.plan["buckets"][index]
        size, buffer = int(bucket["nbytes"]), self.buffers[index]
        if flat.numel() < size:
            raise ValueError(f"bucket {index} of sync {self.token} maps {flat.numel()} bytes, its plan names {size}")
        buffer.copy_(flat[:size], non_blocking=flat.device.type == "cuda" or buffer.device.type == "cuda")
        for device in {flat.device, buffer.device}:
            if device.type == "cuda":  # done before the answer: the trainer frees or reuses the bucket then
                torch.cuda.current_stream(device).synchronize()
        tensors = with_sync_fault(flat_views(buffer, bucket))
        if self.summing:
            self._pending.append(self._pool.submit(fingerprint_torch, tensors))
        self.incoming.update(tensors)
        self.next += 1

    @property
    def complete(self) -> bool:
        return self.next == len(self.plan["buckets"])

    def finish(self) -> tuple[dict[str, Any], dict[str, int], dict[str, float]]:
        """Every tensor received, their checksums and the seconds of each step."""
        seconds = {"receive": time.perf_counter() - self._start}
        try:
            checksums = {name: value for done in self._pending for name, value in done.result().items()}
        finally:
            self.close()
        seconds["checksum"] = time.perf_counter() - self._start - seconds["receive"]  # what was left after the last
        return self.incoming, checksums, seconds

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class IpcWeightReceiver(HeldLoads):
    """Mixed into the worker extension (rollouts.sync.worker_extension.SafetensorsWeightLoader), whose
    `_rollouts_host_buffers` and `_rollouts_apply` it uses."""

    _rollouts_ipc: IpcReceive | None = None
    """The sync whose buckets are arriving."""
    _rollouts_shm: tuple[tuple[str, int, int, int], torch.Tensor] | None = None
    """The trainer's file in /dev/shm last mapped, by (path, size, device, inode), and its mapping."""

    def rollouts_receive_ipc(
        self, token: str, index: str, handle_json: str, plan_json: str = "", hold: str = "0"
    ) -> dict[str, Any]:
        """Bucket `index` of sync `token` (bucket 0 carries the plan and starts the sync, dropping any
        other left unfinished, and anything held), mapped from `handle_json` (rollouts.sync.ipc_handles.share)
        and copied out; the last bucket reloads with them all (hold=<token>: holds them, see HeldLoads)
        and answers the checksums of what was received."""
        k = int(index)
        try:
            if k == 0:
                self._rollouts_held = None
                self._rollouts_ipc_drop()
                self._rollouts_ipc = self._rollouts_ipc_begin(token, read_plan(plan_json))
            receive = self._rollouts_ipc
            if receive is None or receive.token != token:
                expected = "bucket 0 of a sync" if receive is None else f"bucket {receive.next} of sync {receive.token}"
                raise ValueError(f"bucket {k} of sync {token} arrived, expected {expected}")
            flat = self._rollouts_ipc_map(json.loads(handle_json), f"bucket {k}")
            try:
                receive.take(k, flat)
            finally:
                del flat  # a CUDA mapping ends here, before the answer (a file's is kept: see _rollouts_ipc_map)
            if not receive.complete:
                return {"bucket": k}
            self._rollouts_ipc = None
            incoming, checksums, seconds = receive.finish()
            answer = self._rollouts_apply(incoming, seconds, checksums=checksums, hold=hold)  # type: ignore[attr-defined]
            return {**answer, "num_bytes": sum(int(b["nbytes"]) for b in receive.plan["buckets"])}
        except BaseException:
            self._rollouts_ipc_drop()
            raise

    def _rollouts_ipc_map(self, handle: Any, where: str) -> torch.Tensor:
        """The bucket `handle` names, mapped; a trainer's file in /dev/shm stays mapped from one call
        to the next while it is the same file (the trainer keeps it: no page is mapped twice)."""
        if not isinstance(handle, dict) or set(handle) != {"shm"}:
            return mapped(handle, where)
        shm = ShmFile.from_json(handle["shm"], f"{where}.shm")
        found = os.stat(shm.path)
        key = (shm.path, shm.size_bytes, found.st_dev, found.st_ino)
        kept = self._rollouts_shm
        if kept is None or kept[0] != key:
            self._rollouts_shm = None  # the old mapping goes before the new one is made
            kept = self._rollouts_shm = (key, shm.mapped())
        return kept[1]

    def _rollouts_ipc_begin(self, token: str, plan: dict[str, Any]) -> IpcReceive:
        """A sync's receive: its buckets staged on this worker's GPU when it has room for them all
        (rollouts.sync.worker_receive.stage_on_host), else in the host buffer kept between syncs."""
        if len(token) != 16 or any(c not in "0123456789abcdef" for c in token):
            raise ValueError(f"token must be 16 lowercase hex digits, got {token[:40]!r}")
        sizes = [int(b["nbytes"]) for b in plan["buckets"]]
        device = getattr(self, "device", None)
        device = device if isinstance(device, torch.device) else torch.device("cpu")
        if device.type == "cuda" and not stage_on_host(device, str(plan.get("stage", "auto")), sum(sizes)):
            buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        else:
            buffers = self._rollouts_host_buffers(sizes)  # type: ignore[attr-defined]
        return IpcReceive(token, plan, buffers)

    def _rollouts_ipc_drop(self) -> None:
        receive, self._rollouts_ipc = self._rollouts_ipc, None
        if receive is not None:
            receive.close()
