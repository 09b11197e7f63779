"""Metrics loggers implementing rollouts-types' MetricsLogger: JSONL, console, wandb, tensorboard."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rollouts.types import MetricsLogger

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
    mode: a resumed run continues the same file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._start = time.monotonic()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._file is None:
            raise ValueError(f"JsonlLogger({self.path}) is closed")
        record = {**{k: _scalar(v) for k, v in metrics.items()}, "step": step}  # the step argument wins
        record.setdefault("time_s", round(time.monotonic() - self._start, 3))
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics JSONL file (a torn last line from a crash is skipped)."""
    records = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}:{i + 1}: not a JSON object: {line[:80]!r}") from None
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
        from tqdm import tqdm

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
