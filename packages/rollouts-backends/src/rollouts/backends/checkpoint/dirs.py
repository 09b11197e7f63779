"""A checkpoint root's step directories: which are complete (state.json and every file it records,
with their sizes and CRC-32s), which retention deletes, and the leftovers of interrupted saves.
Readers see only published checkpoints: a save writes under a temporary name and renames it whole.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollouts.backends.checkpoint.durable import TMP_PREFIX, TRASH_PREFIX, file_matches
from rollouts.backends.checkpoint.lora_files import ADAPTER_WEIGHTS
from rollouts.backends.train.components import TrainingComponents
from rollouts.backends.train.distributed import is_distributed, on_all_ranks

__all__ = [
    "FORMAT_VERSION",
    "has_optimizer_state",
    "latest_checkpoint",
    "read_record",
    "retired",
    "step_checkpoints",
    "step_dirs",
    "sweep_temporary",
    "verify_checkpoint",
    "verify_files",
    "weights_file",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


_STEP_DIR = re.compile(r"^step_(\d+)$")


def retired(root: Path, final: Path, keep_last: int) -> list[Path]:
    """The step directories retention deletes after publishing `final`: the oldest beyond
    `keep_last` (counting `final`, never deleted), skipping any whose record is unreadable or whose
    files are missing or of another size than recorded (a full CRC check is the loader's): a
    checkpoint that fails its check is left for the user to look at, with a warning."""
    others = [d for d in step_dirs(root) if d != final]
    excess = others[: max(0, len(others) - (keep_last - 1))]
    out = []
    for path in excess:
        problems = _cheap_problems(path)
        if problems:
            log.warning(
                "retention keeps %s: it failed its check (%s); delete it yourself if it is not needed",
                path,
                "; ".join(problems),
            )
        else:
            out.append(path)
    return out


def _cheap_problems(path: Path) -> list[str]:
    """What is wrong with a checkpoint directory short of reading its files: record and sizes."""
    record = read_record(path)
    if record is None:
        return ["state.json missing, unreadable or of another format"]
    problems = []
    for name, entry in record.get("files", {}).items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if not isinstance(entry, Mapping) or size != entry.get("bytes"):
            problems.append(
                f"{name} is {size} bytes, recorded {entry.get('bytes') if isinstance(entry, Mapping) else entry!r}"
            )
    return problems


def verify_checkpoint(path: str | Path, *, full: bool = True) -> list[str]:
    """What is wrong with the checkpoint at `path` (empty: nothing): its record (state.json) must be
    readable and every file it lists present with the recorded size and (`full`: reading every
    byte) CRC-32. load_checkpoint runs the full check itself."""
    path = Path(path)
    problems = _cheap_problems(path)
    if problems or not full:
        return problems
    record = read_record(path)
    assert record is not None
    files = record.get("files", {})
    if not weights_file(files):
        return ["state.json lists no model.safetensors (nor adapter_model.safetensors)"]
    return [
        f"{n} does not match its recorded CRC-32 (damaged)" for n, r in files.items() if not file_matches(path / n, r)
    ]


def step_checkpoints(root: str | Path) -> list[Path]:
    """Every step_<n> directory under `root`, newest first, verified or not (see verify_checkpoint).

    A checkpoint a CheckpointWriter is still finishing is not among them yet."""
    return list(reversed(step_dirs(Path(root))))


def sweep_temporary(directory: str | Path) -> list[Path]:
    """Delete what interrupted saves and exports left in `directory` (half-written checkpoints and
    weights, renamed-away old ones); returns what was removed. Only safe while nothing saves into it:
    no other process (the loops hold the run directory's lock) and no writer of this one."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def step_dirs(root: Path) -> list[Path]:
    """step_<n> directories under root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        return None
    return record


def weights_file(files: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's record lists its weights: the full model or (LoRA) the adapter."""
    return "model.safetensors" in files or ADAPTER_WEIGHTS in files


def has_optimizer_state(path: str | Path) -> bool:
    """Whether the checkpoint at `path` holds optimizer state (it was saved with save_optimizer=True)."""
    record = read_record(Path(path))
    files = record.get("files", {}) if record is not None else {}
    return any(n == "optimizer.safetensors" or n.startswith("optimizer-rank") for n in files)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (every file matches state.json), or None.

    A checkpoint a CheckpointWriter is still finishing is not seen yet: call `writer.wait()` (on
    every rank under torch.distributed) first to see it.
    """
    for path in reversed(step_dirs(Path(root))):
        record = read_record(path)
        if record is None:
            continue
        files = record.get("files", {})
        if weights_file(files) and all(file_matches(path / n, r) for n, r in files.items()):
            return path
    return None


def verify_files(components: TrainingComponents, path: Path, files: Mapping[str, Any], names: list[str]) -> None:
    """Raise ValueError naming every file in `names` whose size or CRC-32 differs from state.json's record
    (on every rank under FSDP2, so none waits in a collective for a rank that refused)."""

    def check() -> None:
        bad = [n for n in names if not file_matches(path / n, files[n])]
        if bad:
            raise ValueError(
                f"checkpoint {str(path)!r}: {bad} do not match the size and CRC-32 recorded in state.json "
                "(corrupt or truncated)"
            )

    if is_distributed(components.model):
        on_all_ranks(check)
    else:
        check()
