"""Metrics loggers implementing rollouts-types' MetricsLogger: JSONL, console, wandb, tensorboard."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from rollouts.types import MetricsLogger

log = logging.getLogger(__name__)

_CONSOLE_KEYS = ("loss", "reward_mean", "accuracy", "kl", "entropy", "grad_norm", "lr")
"""Metrics shown on the console progress line, when present (all go to the JSONL file)."""


def _scalar(value: Any) -> float | int | str | None:
    """A JSON-safe scalar: NaN and infinities become None (JSON has no NaN); text stays text."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


class JsonlLogger:
    """Appends one JSON object per step ({"step": n, **metrics, "time_s": ...}) to a file.

    Each line is flushed and fsynced, so a killed run keeps every step it logged. Opened in append
    mode: a resumed run continues the same file. Append-only, and repaired before appending:
    - a torn last line (a crash or a full disk mid-write) is cut off when the file is opened, so the
      next record starts on a line of its own; a write that fails is cut back the same way;
    - the first record a run logs drops the records of that step and later ones already in the file:
      they were logged after the checkpoint the run resumed from, and the run logs those steps again.
    So every step appears once, and `read_jsonl` reads the file whatever point a run was killed at.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_torn_tail(self.path)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._start = time.monotonic()
        self._first = True

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._file is None:
            raise ValueError(f"JsonlLogger({self.path}) is closed")
        if self._first:
            self._first = False
            self._drop_from(step)
        record = {**{k: _scalar(v) for k, v in metrics.items()}, "step": step}  # the step argument wins
        record.setdefault("time_s", round(time.monotonic() - self._start, 3))
        line = json.dumps(record) + "\n"
        end = self._file.tell()
        try:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError:  # e.g. ENOSPC mid-line: leave the file as it was, so the next append is whole
            self._file.close()
            self._file = None
            with self.path.open("r+b") as f:
                f.truncate(end)
            self._file = self.path.open("a", encoding="utf-8")
            raise

    def _drop_from(self, step: int) -> None:
        """Rewrite the file without records of `step` or later (left by a run that resumed earlier)."""
        assert self._file is not None
        records = read_jsonl(self.path)
        keep = [r for r in records if not (isinstance(r.get("step"), int) and r["step"] >= step)]
        if len(keep) == len(records):
            return
        log.info(
            "%s: dropping %d records of steps >= %d, logged after the checkpoint this run resumed from",
            self.path,
            len(records) - len(keep),
            step,
        )
        self._file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def repair_torn_tail(path: str | Path) -> int:
    """Cut an append-only JSONL file back to its last complete line; returns the bytes removed.

    A crash or a full disk mid-write leaves a last line without its newline, and appending to it
    would glue the next record onto it. A last line that is a whole JSON object only lacking its
    newline gets one instead.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        block, end = 1 << 16, size
        while end > 0:  # find the last newline, scanning back a block at a time
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        else:
            keep = 0
        f.seek(keep)
        tail = f.read()
        try:  # a whole record cut off just before its newline: keep it, end the line
            whole = isinstance(json.loads(tail.decode("utf-8")), dict)
        except (json.JSONDecodeError, UnicodeDecodeError):
            whole = False
        if whole:
            f.write(b"\n")
        else:
            f.truncate(keep)
        os.fsync(f.fileno())
    if whole:
        return 0
    log.warning("%s: removed a torn last line (%d bytes) left by an interrupted write", path, size - keep)
    return size - keep


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics JSONL file. A torn last line (an interrupted write) is skipped;
    any other line that is not a JSON object is an error naming the file and line."""
    records = []
    lines = Path(path).read_bytes().split(b"\n")
    torn_possible = len(lines) - 1  # index of the text after the last newline ("" when the file ends whole)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if i == torn_possible:
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON object: {raw[:80]!r}") from None
        if not isinstance(record, dict):
            if i == torn_possible:  # the start of a record cut off ("0", "[1"): torn, skipped
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON object: {raw[:80]!r}")
        records.append(record)
    return records


class ConsoleLogger:
    """A progress bar with ETA (tqdm) whose postfix shows the latest key metrics; on a stream that is
    not a terminal (a log file, CI), plain lines instead: one every `plain_every_s` and the last."""

    def __init__(
        self,
        total_steps: int,
        *,
        desc: str = "train",
        initial_step: int = 0,
        stream: TextIO | None = None,
        plain_every_s: float = 10.0,
    ) -> None:
        self._stream = stream or sys.stderr
        self._plain = not (hasattr(self._stream, "isatty") and self._stream.isatty())
        self._desc, self._total, self._every_s = desc, total_steps, plain_every_s
        self._start = self._last_line = time.monotonic()
        self._bar = (
            None
            if self._plain
            else tqdm(
                total=total_steps,
                initial=initial_step,
                desc=desc,
                file=self._stream,
                dynamic_ncols=True,
                mininterval=0.5,
            )
        )
        self._last_step = initial_step

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = {k: f"{metrics[k]:.4g}" for k in _CONSOLE_KEYS if isinstance(metrics.get(k), (int, float))}
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(0, step - self._last_step))
        elif step >= self._total or time.monotonic() - self._last_line >= self._every_s:
            elapsed = time.monotonic() - self._start
            fields = " ".join(f"{k}={v}" for k, v in shown.items())
            self._stream.write(f"{self._desc}: step {step}/{self._total} ({elapsed:.0f} s) {fields}\n")
            self._stream.flush()
            self._last_line = time.monotonic()
        self._last_step = max(self._last_step, step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class WandbLogger:
    """Logs to Weights & Biases (install the `wandb` extra: rollouts-loops[wandb])."""

    def __init__(self, *, project: str, config: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("WandbLogger needs wandb: pip install 'rollouts-loops[wandb]'") from e
        self._run = wandb.init(project=project, config=dict(config or {}), **kwargs)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class TensorboardLogger:
    """Writes TensorBoard scalars (install the `tensorboard` extra: rollouts-loops[tensorboard])."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("TensorboardLogger needs tensorboard: pip install 'rollouts-loops[tensorboard]'") from e
        self._writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MultiLogger:
    """Fans each call out to several loggers."""

    def __init__(self, loggers: Sequence[MetricsLogger]) -> None:
        self.loggers = tuple(loggers)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


class NullLogger:
    """Discards everything (for tests and library use)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass
