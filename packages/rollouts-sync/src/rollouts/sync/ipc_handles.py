"""Memory one process shares with another on the same machine, named in JSON (standard library and
torch only): a bucket of CUDA memory by its IPC handle (`IpcStorage`), or a bucket of host memory in
a file of /dev/shm (`ShmFile`). The trainer fills the bucket and sends `share(flat)`; the other side
maps it with `mapped(handle)`, copies out what it needs and drops the mapping.

rollouts.sync.ipc (a vLLM server's weights, sent as such buckets), vLLM's worker extension
(rollouts.sync.worker_ipc, which a server started by rollouts.sync.launch gets as a copy beside it,
rollouts_ipc_handles) and rollouts-backends' engine process use it.

CUDA IPC: `UntypedStorage._share_cuda_` gives the handle of the allocation holding the storage,
its offset there, torch's shared reference counter and an event recorded on the sharing stream;
`_new_shared_cuda` maps it in another process, whose streams wait for that event before reading.
A handle cannot be mapped in the process that made it. The GPU is named by its UUID, not its index:
processes with different CUDA_VISIBLE_DEVICES number the same GPU differently.

Shared memory: the trainer creates a file of its own (mode 0600, named "rollouts-ipc-<its pid>-<16
random hex digits>") in /dev/shm (the temporary directory where there is none), maps it and fills
it; the reader maps it (no copy) after checking the name and that the file has the size named (a
shorter file would fault on read). Its pages are reserved when it is made (`posix_fallocate`): a
/dev/shm too small for the bucket (a container's default is 64 MiB) is then an OSError naming the
size, not a SIGBUS killing the trainer at its first write. The trainer keeps such a file from one sync to the next
(rollouts.sync.ipc.ShmBuckets): a fresh file's pages are allocated and zeroed on first touch, about
as slow as the copy itself. Files of processes no longer alive are removed when a new one is made
(`ShmFile.create`: the creator holds a lock on its file while it lives), so a trainer killed
mid-run leaves its file only until the next one starts.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import errno
import fcntl
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "IpcStorage",
    "ShmFile",
    "bytes_field",
    "count_field",
    "counts_field",
    "flag_field",
    "mapped",
    "object_fields",
    "remove_orphans",
    "share",
    "shm_dir",
    "visible_cuda_index",
]

_SHM_NAME = re.compile(r"rollouts-ipc-[0-9]+-[0-9a-f]{16}")
_UUID = re.compile(
    r"[0-9A-Za-z-]{1,64}"
)  # a GPU's UUID as torch writes it  # the creator's process id, 16 random hex digits
_LOCKS: dict[str, int] = {}  # path -> the descriptor holding this process's lock on a file it made


def shm_dir() -> str:
    """Where shared-memory buckets live: /dev/shm, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IpcStorage:
    """One CUDA storage of the trainer's process, as `UntypedStorage._share_cuda_` describes it."""

    device: int
    """CUDA device index the storage lives on, as the sharing process numbers it (for messages)."""
    device_uuid: str
    """The UUID of that GPU: how the mapping process finds it among the GPUs it sees."""
    handle: bytes
    """The IPC handle of the allocation (segment) holding the storage."""
    size_bytes: int
    offset_bytes: int
    """Where the storage starts in its allocation."""
    ref_counter_handle: bytes
    """Name of torch's shared reference counter, which keeps the memory alive while it is mapped."""
    ref_counter_offset: int
    event_handle: bytes
    """IPC handle of the event recorded on the trainer's stream when the storage was shared."""
    event_sync_required: bool

    @classmethod
    def of(cls, storage: torch.UntypedStorage) -> IpcStorage:
        """Share `storage` (a CUDA storage with data) by IPC; the caller keeps it alive until the
        other process has mapped, read and dropped it."""
        device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()  # type: ignore[no-untyped-call]
        return cls(
            device=int(device),
            device_uuid=str(torch.cuda.get_device_properties(int(device)).uuid),
            handle=bytes(handle),
            size_bytes=int(size),
            offset_bytes=int(offset),
            ref_counter_handle=bytes(counter),
            ref_counter_offset=int(counter_offset),
            event_handle=bytes(event),
            event_sync_required=bool(sync),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "device_uuid": self.device_uuid,
            "handle": _b64(self.handle),
            "size_bytes": self.size_bytes,
            "offset_bytes": self.offset_bytes,
            "ref_counter_handle": _b64(self.ref_counter_handle),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": _b64(self.event_handle),
            "event_sync_required": self.event_sync_required,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "storage") -> IpcStorage:
        """The storage `to_json` wrote; ValueError naming `where` and the field for anything else."""
        fields = object_fields(data, where, {f.name for f in dataclasses.fields(cls)})
        uuid = fields["device_uuid"]
        if not isinstance(uuid, str) or not _UUID.fullmatch(uuid):
            raise ValueError(f"{where}.device_uuid must be a GPU's UUID (1-64 letters, digits or -), got {uuid!r:.80}")
        return cls(
            device=count_field(fields, "device", where),
            device_uuid=uuid,
            handle=bytes_field(fields, "handle", where),
            size_bytes=count_field(fields, "size_bytes", where),
            offset_bytes=count_field(fields, "offset_bytes", where),
            ref_counter_handle=bytes_field(fields, "ref_counter_handle", where),
            ref_counter_offset=count_field(fields, "ref_counter_offset", where),
            event_handle=bytes_field(fields, "event_handle", where),
            event_sync_required=flag_field(fields, "event_sync_required", where),
        )

    def mapped(self) -> torch.Tensor:
        """This process's view of the storage, as flat bytes on its device; streams here wait for the
        trainer's event before they read it. Drop it once read: the trainer's memory stays pinned
        while it lives. ValueError when this process does not see the GPU the storage lives on."""
        index = visible_cuda_index(self.device_uuid, f"the bucket's GPU (the sharer's cuda:{self.device})")
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            self.handle,
            self.size_bytes,
            self.offset_bytes,
            self.ref_counter_handle,
            self.ref_counter_offset,
            self.event_handle,
            self.event_sync_required,
        )
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage)


def visible_cuda_index(uuid: str, what: str = "GPU") -> int:
    """This process's index of the GPU of `uuid`; ValueError naming it when this process does not see it."""
    count = torch.cuda.device_count()
    for index in range(count):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise ValueError(
        f"{what}, {uuid}, is not among the {count} GPU(s) this process sees (CUDA_VISIBLE_DEVICES={visible!r}): "
        "the process mapping a CUDA IPC bucket must see the GPU it lives on"
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShmFile:
    """A bucket of host memory: a file of `size_bytes` in `shm_dir()`, named "rollouts-ipc-<16 hex>"."""

    path: str
    size_bytes: int

    @classmethod
    def create(cls, size_bytes: int) -> tuple[ShmFile, torch.Tensor]:
        """A new file of `size_bytes` (at least 1) and this process's shared mapping of it, as flat
        bytes to fill; the caller removes the file (`remove`) once done with it. This process holds
        a shared lock on it until then, which tells `remove_orphans` (run first) that it is in use."""
        remove_orphans()
        size = max(int(size_bytes), 1)
        path = os.path.join(shm_dir(), f"rollouts-ipc-{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            _reserve(fd, size, path)
            flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        _LOCKS[path] = fd
        return cls(path=path, size_bytes=size), flat

    def remove(self) -> None:
        """Remove the file and release its lock (a mapping of it lives on until dropped); gone already is fine."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        fd = _LOCKS.pop(self.path, None)
        if fd is not None:
            os.close(fd)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size_bytes": self.size_bytes}

    @classmethod
    def from_json(cls, data: Any, where: str = "shm") -> ShmFile:
        fields = object_fields(data, where, {"path", "size_bytes"})
        path = fields["path"]
        if (
            not isinstance(path, str)
            or os.path.dirname(path) != shm_dir()
            or not _SHM_NAME.fullmatch(os.path.basename(path))
        ):
            raise ValueError(f"{where}.path must be {shm_dir()}/rollouts-ipc-<pid>-<16 hex digits>, got {path!r:.120}")
        return cls(path=path, size_bytes=count_field(fields, "size_bytes", where))

    def mapped(self) -> torch.Tensor:
        """This process's shared mapping of the file as flat bytes (no copy: what the trainer writes
        there later shows through it); ValueError when the file is not of the size named."""
        found = os.stat(self.path).st_size
        if found != self.size_bytes:
            raise ValueError(f"{self.path} holds {found} bytes, the bucket names {self.size_bytes}")
        return torch.from_file(self.path, shared=True, size=self.size_bytes, dtype=torch.uint8)


def _reserve(fd: int, size: int, path: str) -> None:
    """Give the file `size` bytes of pages now. A file only truncated to its size holds no pages on
    tmpfs: a write into a mapping of it with /dev/shm full kills the process (SIGBUS)."""
    if not hasattr(os, "posix_fallocate"):  # not Linux: no /dev/shm either; the temporary directory's file
        os.ftruncate(fd, size)
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = os.statvfs(os.path.dirname(path))
        raise OSError(
            e.errno,
            f"{os.path.dirname(path)} has no room for an IPC bucket of {size} bytes "
            f"({free.f_bavail * free.f_frsize} bytes free): give it more (docker run --shm-size, a Kubernetes "
            "emptyDir of medium Memory), send smaller buckets (chunk_bytes) or sync by another wire",
        ) from e


def remove_orphans(min_age_s: float = 10.0) -> list[str]:
    """Remove the shared-memory buckets no process holds any more (a trainer killed before it could
    remove its own: its lock went with it), of this user's and at least `min_age_s` old (a file is
    locked just after it is made); the paths removed. A lock, not a process id, says whether a file
    is in use: processes sharing /dev/shm may not share process ids (containers)."""
    removed = []
    directory = shm_dir()
    for name in os.listdir(directory):
        if _SHM_NAME.fullmatch(name) is None:
            continue
        path = os.path.join(directory, name)
        try:  # never a link followed, never a wait on a FIFO's writer: only our own regular files count
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # gone meanwhile, a link, or not this user's to read
            continue
        try:
            found = os.fstat(fd)
            if (
                not stat.S_ISREG(found.st_mode)
                or found.st_uid != os.getuid()
                or time.time() - found.st_ctime < min_age_s
            ):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # locked: its process is alive
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:  # gone meanwhile, or not ours to remove: left as it is
            pass
        finally:
            os.close(fd)
    return removed


def share(flat: torch.Tensor, shm: ShmFile | None = None) -> dict[str, Any]:
    """The JSON naming bucket `flat` for another process: `shm` where `flat` maps that file, else its
    CUDA IPC handle (`flat` on a CUDA device; kept alive by the caller until the reader dropped it)."""
    if shm is not None:
        return {"shm": shm.to_json()}
    if flat.device.type != "cuda":
        raise ValueError(f"a bucket on {flat.device} can be shared only as a file in shared memory")
    return {"cuda_ipc": IpcStorage.of(flat.untyped_storage()).to_json()}


def mapped(handle: Any, where: str = "handle") -> torch.Tensor:
    """The bucket `share` named, mapped here as flat bytes (on the sharer's GPU, or in host memory)."""
    fields = handle if isinstance(handle, Mapping) else {}
    if len(fields) != 1 or not set(fields) <= {"shm", "cuda_ipc"}:
        raise ValueError(f"{where} must be an object of one key, 'shm' or 'cuda_ipc', got {handle!r:.200}")
    if "shm" in fields:
        return ShmFile.from_json(fields["shm"], f"{where}.shm").mapped()
    return IpcStorage.from_json(fields["cuda_ipc"], f"{where}.cuda_ipc").mapped()


def object_fields(data: Any, where: str, names: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    missing, unknown = sorted(names - data.keys()), sorted(data.keys() - names)
    if missing or unknown:
        raise ValueError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    return data


def count_field(fields: Mapping[str, Any], key: str, where: str) -> int:
    value = fields[key]
    if type(value) is not int or value < 0:  # bool is an int subclass: refused too
        raise ValueError(f"{where}.{key} must be an integer >= 0, got {value!r:.80}")
    return value


def counts_field(fields: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    value = fields[key]
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{where}.{key} must be a list of integers >= 0, got {value!r:.80}")
    return tuple(value)


def flag_field(fields: Mapping[str, Any], key: str, where: str) -> bool:
    value = fields[key]
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be true or false, got {value!r:.80}")
    return value


def bytes_field(fields: Mapping[str, Any], key: str, where: str) -> bytes:
    value = fields[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a base64 string, got {value!r:.80}")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where}.{key} is not base64 ({e})") from e


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
