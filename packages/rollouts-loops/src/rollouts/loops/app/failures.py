"""How the `rollouts` command reports a run that failed or was interrupted: one paragraph on the
screen (what failed, the user's own frame when the failure is in their code, the run's last
checkpoint, the command that resumes), the full traceback in a log file.

Light on purpose (the standard library only): the command line imports it before any command.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
import traceback
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import rollouts

ERROR_LOG = "error.log"
"""Where a run directory keeps the tracebacks of its failures (appended, one block per failure)."""

_MESSAGE_CHARS = 500  # a message longer than this is cut on screen; the log keeps it whole

# Frames in these directories are the library's, Python's or a dependency's, never the user's:
# every directory of the rollouts namespace (one per installed package), the standard library, site-packages.
_NOT_USER = tuple(
    sorted(
        {str(Path(p).resolve()) for p in rollouts.__path__}
        | {str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    )
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunState:
    """Where a failed run stands, for the paragraph that reports it."""

    command: str
    """The command that ran: sft, rl, pipeline."""
    source: str
    """The run file it ran from."""
    out_dir: Path
    """The run directory."""
    checkpoint: Path | None
    """The newest complete checkpoint, None before the first."""
    step: int | None = None
    """The last step the run logged, if any."""


class RunFailed(Exception):
    """A run-time failure already reported as one paragraph (`str(self)`); `exit_code` is the
    command's exit status (130 for an interrupt, as a shell reports Ctrl-C)."""

    def __init__(self, paragraph: str, *, exit_code: int) -> None:
        super().__init__(paragraph)
        self.exit_code = exit_code


def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code in `error`'s traceback or its causes' (a plug-in
    that raised is often wrapped: its exception is the cause), or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    found = None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame in traceback.extract_tb(current.__traceback__):
            if not str(Path(frame.filename).resolve()).startswith(_NOT_USER) and not frame.filename.startswith("<"):
                found = frame
        current = current.__cause__ or current.__context__
    return found


def write_log(error: BaseException, log: Path | None) -> Path:
    """Append `error`'s whole traceback to `log` (a temporary file when None, or when `log` cannot be
    written); returns where it went."""
    text = f"== {datetime.now().isoformat(timespec='seconds')}\n" + "".join(traceback.format_exception(error))
    if log is not None:
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a", encoding="utf-8") as f:
                f.write(text)
            return log
        except OSError:
            pass
    fd, name = tempfile.mkstemp(prefix="rollouts-error-", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(name)


def _what(error: BaseException) -> str:
    message = str(error).strip() or "(no message)"
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + " ..."
    return f"{type(error).__name__}: {message}"


def _resume(state: RunState) -> str:
    command = f"rollouts {state.command} --config {state.source} --set run.out_dir='{state.out_dir}'"
    if state.checkpoint is None:
        return f"no checkpoint was written yet; run again with: {command}"
    return f"last checkpoint {state.checkpoint}; resume with: {command} --resume must"


def paragraph(error: BaseException, state: RunState | None, log: Path) -> str:
    """The paragraph the command prints for `error` (a KeyboardInterrupt reads as an interrupt)."""
    command = state.command if state is not None else "run"
    if isinstance(error, KeyboardInterrupt):
        at = f" after step {state.step}" if state is not None and state.step is not None else ""
        head = f"rollouts {command}: interrupted{at}"
    else:
        head = f"rollouts {command} failed: {_what(error)}"
    parts = [head]
    frame = None if isinstance(error, KeyboardInterrupt) else user_frame(error)
    if frame is not None:
        line = f": {frame.line.strip()}" if frame.line else ""
        parts.append(f"in your code at {frame.filename}:{frame.lineno}, in {frame.name}{line}")
    if state is not None:
        parts.append(_resume(state))
    parts.append(f"the traceback is in {log}")
    return ".\n  ".join(parts) + "."


def report(error: BaseException, state: RunState | None) -> RunFailed:
    """`error` logged (to the run directory's error.log when there is one) and turned into the
    RunFailed that the command line prints."""
    log = write_log(error, None if state is None else state.out_dir / ERROR_LOG)
    return RunFailed(paragraph(error, state, log), exit_code=130 if isinstance(error, KeyboardInterrupt) else 1)


def print_failure(failure: RunFailed) -> int:
    print(str(failure), file=sys.stderr)
    return failure.exit_code
