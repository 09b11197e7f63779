"""A run directory, shared by SFT and RL: where checkpoints and exported weights go, and resume.

  <run_dir>/checkpoints/step_<n>/   crash-safe checkpoints (rollouts.backends)
  <run_dir>/weights/                the newest exported weights, read by engines at each sync
  <run_dir>/metrics_<stage>.jsonl   one record per logged step
  <run_dir>/run_identity.json       the resolved config and input fingerprints the run started with
  <run_dir>/.lock                   held by the run using the directory (its pid inside)

Resume is a choice ("auto": continue if there is a checkpoint, "never": refuse a directory that has
one, "must": refuse one that has none) and is checked against `run_identity.json`: a run whose
config or inputs differ in anything that changes the run is refused with the differences, unless
the differing keys are ones that may change between sessions (`MAY_CHANGE`).
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import json
import logging
import os
import socket
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from rollouts.backends import TrainingComponents, has_optimizer_state, latest_checkpoint, load_checkpoint
from rollouts.types import TrainingState

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_DIR = "weights"
IDENTITY_FILE = "run_identity.json"
ResumeMode = Literal["auto", "never", "must"]
MAY_CHANGE = (
    "*.num_steps",
    "*.log_every",
    "eval.*",
    "log.*",
    "run.*",
    "*.checkpoint.every_steps",
    "*.checkpoint.keep_last",
    "engine.urls",
    "engine.timeout_s",
    "engine.sync_timeout_s",
    "engine.sync",
    "engine.max_retries",
)
"""Config keys (glob patterns over dotted paths) a resumed run may change: how long it runs, how it
logs, evaluates and checkpoints, where its engines are. Everything else changes the run itself."""
_HASH_BLOCK_BYTES = 16 * 1024**2


def resume_if_possible(
    components: TrainingComponents, run_dir: str | Path | None, *, resume: bool
) -> tuple[TrainingState, dict[str, Any], Path | None]:
    """(state, extra, checkpoint path) from the newest complete checkpoint under run_dir, or a fresh state."""
    if run_dir is None or not resume:
        return TrainingState(), {}, None
    path = latest_checkpoint(Path(run_dir) / CHECKPOINTS_DIR)
    if path is None:
        return TrainingState(), {}, None
    saved_optimizer = has_optimizer_state(path)
    if not saved_optimizer:
        warnings.warn(
            f"{path} holds no optimizer state (save_optimizer=False): resuming with fresh optimizer "
            "moments, so the run does not continue exactly as it would have",
            stacklevel=2,
        )
    state, extra = load_checkpoint(components, path, load_optimizer=saved_optimizer)
    log.info("resuming from step %d in %s", state.step, path.parent.parent)
    return state, extra, path


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes, or for a model directory of its config and weight files' bytes."""
    path = Path(path)
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors") and p.name != "state.json")
    )
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while block := f.read(_HASH_BLOCK_BYTES):
                digest.update(block)
    return digest.hexdigest()


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def identity_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, may_change: Sequence[str] = MAY_CHANGE
) -> list[str]:
    """'key: saved -> current' for every key that differs and may not change."""
    a, b = _flatten(saved), _flatten(current)
    lines = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key) and not any(fnmatch.fnmatchcase(key, p) for p in may_change):
            lines.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return lines


def check_resume(
    run_dir: str | Path, identity: Mapping[str, Any], *, mode: ResumeMode, may_change: Sequence[str] = MAY_CHANGE
) -> bool:
    """Whether the run in `run_dir` resumes; raises ValueError when `mode` or the identity forbid it.

    Writes `identity` to run_identity.json for a new run (a resumed one keeps the first).
    """
    if mode not in ("auto", "never", "must"):
        raise ValueError(f"resume must be 'auto', 'never' or 'must', got {mode!r}")
    run_dir = Path(run_dir)
    has_checkpoint = latest_checkpoint(run_dir / CHECKPOINTS_DIR) is not None
    if mode == "never" and has_checkpoint:
        raise ValueError(
            f"{run_dir} already holds a run's checkpoints and resume is 'never': starting over there "
            "would mix two runs; choose a new out_dir, or resume with 'auto'"
        )
    if mode == "must" and not has_checkpoint:
        raise ValueError(f"resume is 'must' but {run_dir / CHECKPOINTS_DIR} holds no complete checkpoint")
    identity_path = run_dir / IDENTITY_FILE
    current = json.loads(json.dumps(identity))
    if has_checkpoint and identity_path.is_file():
        differences = identity_differences(json.loads(identity_path.read_text()), current, may_change=may_change)
        if differences:
            raise ValueError(
                f"{run_dir} was started with a different config or inputs; resuming would not continue "
                "that run. Differences (saved -> now):\n  "
                + "\n  ".join(differences)
                + "\nUse a new out_dir, or put the saved values back."
            )
    if not has_checkpoint:
        run_dir.mkdir(parents=True, exist_ok=True)
        identity_path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    return has_checkpoint


# ---------------------------------------------------------------- one run per directory

LOCK_FILE = ".lock"
_held: dict[Path, tuple[int, int]] = {}
"""Run directories this process holds: resolved path -> (lock file descriptor, holders). An flock
belongs to the process (its open file), so the table mirrors the kernel's view: a second holder in
the same process shares the lock; another process is refused."""


class RunDirInUse(RuntimeError):
    """Another process holds the run directory."""


@contextlib.contextmanager
def lock_run_dir(run_dir: str | Path) -> Iterator[Path]:
    """Hold `run_dir` for one run: a second run on it, in another process, is refused with the
    holder's pid instead of interleaving metrics and checkpoints. The kernel drops the lock when the
    holder exits, killed or not, so a crashed run never leaves the directory locked.
    Re-entrant within a process."""
    path = Path(run_dir).resolve()
    acquire_run_dir(path)
    try:
        yield path
    finally:
        release_run_dir(path)


def acquire_run_dir(run_dir: str | Path) -> None:
    """Take the run directory's lock (see `lock_run_dir`); raises RunDirInUse naming the holder."""
    path = Path(run_dir).resolve()
    if path in _held:
        fd, count = _held[path]
        _held[path] = (fd, count + 1)
        return
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise RunDirInUse(
            f"{path} is in use by another run ({holder}); wait for it to finish, or choose another out_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held[path] = (fd, 1)


def release_run_dir(run_dir: str | Path) -> None:
    """Give back one hold on the run directory's lock (the last one unlocks it)."""
    path = Path(run_dir).resolve()
    fd, count = _held[path]
    if count > 1:
        _held[path] = (fd, count - 1)
        return
    del _held[path]
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
