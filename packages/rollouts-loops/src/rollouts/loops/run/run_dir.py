"""A run directory, shared by SFT and RL: where checkpoints and exported weights go, and resume.

  <run_dir>/checkpoints/step_<n>/   crash-safe checkpoints (rollouts.backends)
  <run_dir>/weights/                the newest exported weights, read by engines at each sync
  <run_dir>/metrics_<stage>.jsonl   one record per logged step
  <run_dir>/run_identity.json       the resolved config and input fingerprints the run started with
  <run_dir>/.lock                   held by the run using the directory (its pid inside)

A run's saved state beside its models is a dict of parts, each `Stateful`: `parts_state` gives
what a checkpoint's `extra` holds, `load_parts` gives each part its own entry back. `due` is the
one cadence rule of the loops (logging, syncs, evaluation, checkpoints).

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
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rollouts.backends import (
    TrainingComponents,
    has_optimizer_state,
    load_checkpoint,
    step_checkpoints,
    sweep_temporary,
    verify_checkpoint,
)
from rollouts.backends.train.distributed import rank_world
from rollouts.loops.errors import DamagedCheckpointError
from rollouts.types import TrainingState

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
ABANDONED_DIR = "abandoned"
WEIGHTS_DIR = "weights"
ADAPTER_DIR = "adapter"
"""Where a LoRA run exports its adapter for engines that load it at run time (model.lora.sync = 'adapter')."""
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
    "engine.attest",
    "engine.max_retries",
)
"""Config keys (glob patterns over dotted paths) a resumed run may change: how long it runs, how it
logs, evaluates and checkpoints, where its engines are. Everything else changes the run itself."""
_HASH_BLOCK_BYTES = 16 * 1024**2


def due(step: int, every: int, total: int) -> bool:
    """Whether something done every `every` steps (0: never) falls at step `step`; everything falls
    at the last step, so a run ends synced, evaluated, logged and checkpointed."""
    return (every > 0 and step % every == 0) or step >= total


class Stateful(Protocol):
    """One part of a run's saved state (a DataBuffer, a rollout manager, ...): JSON-ready state out,
    and the same state back in."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


def parts_state(parts: Mapping[str, Stateful]) -> dict[str, Any]:
    """The checkpoint's `extra`: each part's state under its name."""
    return {name: part.state_dict() for name, part in parts.items()}


def load_parts(parts: Mapping[str, Stateful], extra: Mapping[str, Any]) -> None:
    """Give each part its state from a checkpoint's `extra`, in the dict's order; a part the
    checkpoint has no entry for (a fresh run, an older checkpoint) keeps its starting state."""
    for name, part in parts.items():
        if name in extra:
            part.load_state_dict(extra[name])


def resume_if_possible(
    components: TrainingComponents,
    run_dir: str | Path | None,
    *,
    resume: bool,
    resume_from: str | Path | None = None,
    models: Mapping[str, torch.nn.Module] | None = None,
) -> tuple[TrainingState, dict[str, Any], Path | None]:
    """(state, extra, checkpoint path) from run_dir's newest checkpoint, or a fresh state. `models`:
    further models saved with the checkpoint (save_checkpoint(models=)) to load too.

    The newest checkpoint must pass its check (verify_checkpoint): one that does not stops the run
    with the damaged files named, and nothing is loaded or deleted; an older one is used only when
    the user names it (`resume_from`). Resuming from an older checkpoint than the newest moves the
    newer ones to checkpoints/abandoned/ (kept, but no longer resumed from or retained).
    """
    if run_dir is None or not resume:
        return TrainingState(), {}, None
    root = Path(run_dir) / CHECKPOINTS_DIR
    steps = step_checkpoints(root)
    if resume_from is not None:
        path = Path(resume_from)
        problems = verify_checkpoint(path)
        if problems:
            raise ValueError(f"resume_from {str(path)!r} failed its check: {'; '.join(problems)}")
        newer = [p for p in steps if _step_of(p) > _step_of(path)] if path.parent.resolve() == root.resolve() else []
        for later in newer if rank_world()[0] == 0 else []:
            (root / ABANDONED_DIR).mkdir(exist_ok=True)
            moved = root / ABANDONED_DIR / f"{later.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            os.rename(later, moved)
            log.warning("resuming from %s: the newer %s is moved to %s", path, later.name, moved)
    elif not steps:
        return TrainingState(), {}, None
    else:
        path = steps[0]
        problems = verify_checkpoint(path, full=False)  # the rest of the check is load_checkpoint's
        if problems:
            raise damaged_checkpoint_error(steps, problems)
    saved_optimizer = has_optimizer_state(path)
    if not saved_optimizer:
        warnings.warn(
            f"{path} holds no optimizer state (save_optimizer=False): resuming with fresh optimizer "
            "moments, so the run does not continue exactly as it would have",
            stacklevel=2,
        )
    try:
        state, extra = load_checkpoint(components, path, load_optimizer=saved_optimizer, models=models)
    except ValueError as e:
        if resume_from is not None or "CRC-32" not in str(e):
            raise
        raise damaged_checkpoint_error(steps, [str(e)]) from e
    log.info("resuming from step %d in %s", state.step, path.parent.parent)
    return state, extra, path


def damaged_checkpoint_error(steps: Sequence[Path], problems: Sequence[str]) -> DamagedCheckpointError:
    """The error for a newest checkpoint (steps[0]) that failed its check, naming its damaged files
    and an earlier checkpoint that passes the quick check, to resume from by choice."""
    fallback = next((p for p in steps[1:] if not verify_checkpoint(p, full=False)), None)
    return DamagedCheckpointError(
        f"the newest checkpoint {str(steps[0])!r} failed its check: {'; '.join(problems)}. Nothing was "
        "deleted. Replace the damaged files with intact copies and run again, or "
        + (f"resume from an earlier checkpoint (--resume-from {fallback}), or " if fallback else "")
        + "start over in a new out_dir"
    )


def _step_of(path: Path) -> int:
    name = path.name
    return int(name.removeprefix("step_")) if name.startswith("step_") and name[5:].isdigit() else -1


def sweep_run_dir(run_dir: str | Path) -> None:
    """Remove what killed runs left half-written in the run directory (temporary checkpoints and
    exported weights); call it holding the directory's lock, so no live run's files are touched."""
    run_dir = Path(run_dir)
    removed = sweep_temporary(run_dir) + sweep_temporary(run_dir / CHECKPOINTS_DIR)
    if removed:
        log.info("removed %d temporary entries left by an interrupted run in %s", len(removed), run_dir)


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
    run_dir: str | Path,
    identity: Mapping[str, Any],
    *,
    mode: ResumeMode,
    may_change: Sequence[str] = MAY_CHANGE,
    check_newest: bool = True,
) -> bool:
    """Whether the run in `run_dir` resumes; raises ValueError when `mode` or the identity forbid it,
    or (with `check_newest`) when the newest checkpoint fails its check.

    Writes `identity` to run_identity.json for a new run (a resumed one keeps the first).
    """
    if mode not in ("auto", "never", "must"):
        raise ValueError(f"resume must be 'auto', 'never' or 'must', got {mode!r}")
    run_dir = Path(run_dir)
    has_checkpoint = bool(step_checkpoints(run_dir / CHECKPOINTS_DIR))  # verified or not: it is the run's
    if mode == "never" and has_checkpoint:
        raise ValueError(
            f"{run_dir} already holds a run's checkpoints and resume is 'never': starting over there "
            "would mix two runs; choose a new out_dir, or resume with 'auto'"
        )
    if mode == "must" and not has_checkpoint:
        raise ValueError(f"resume is 'must' but {run_dir / CHECKPOINTS_DIR} holds no complete checkpoint")
    if has_checkpoint and mode != "never" and check_newest:  # a damaged newest one stops the run here, named
        steps = step_checkpoints(run_dir / CHECKPOINTS_DIR)
        problems = verify_checkpoint(steps[0], full=False)  # missing or cut files; CRCs when it loads
        if problems:
            raise damaged_checkpoint_error(steps, problems)
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
