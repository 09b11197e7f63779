"""The engine process's start and stop, on the parent's side: its pipes, the small shared file of
its abort flag, the shared file weight loads pass through, and the file its stderr goes to.

`start_process` starts `python -m <module>` with the ends it needs; the `EngineChild` it returns
holds everything open on this side, and `reap` releases all of it, once.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollouts.backends.engine_process.wire import encode_frame, write_frame

__all__ = ["CLOSE_TIMEOUT_S", "EngineChild", "exit_status", "start_process"]

CLOSE_TIMEOUT_S = 10.0  # a clean exit after "close" is instant; past this the process is killed
_REAP_TIMEOUT_S = 10.0  # after SIGKILL the kernel reaps at once; this only bounds the wait
_SHM_DIR = "/dev/shm"  # memory-backed where there is one: the abort flag never touches a disk


def exit_status(returncode: int | None) -> str:
    """How a process ended, its signal named: "killed by SIGKILL (exit code -9)", "exit code 1"."""
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name} (exit code {returncode})"
        except ValueError:  # a signal number this platform has no name for
            pass
    return f"exit code {returncode}"


@dataclasses.dataclass(slots=True)
class EngineChild:
    """What the engine process holds open on this side; `reap` releases all of it, once."""

    process: subprocess.Popen[bytes]
    requests_fd: int
    answers_fd: int
    control: mmap.mmap
    weights_file: Path
    """Shared memory for `load_weights`: the engine process maps it per load."""
    files: tuple[Path, ...]
    dirs: tuple[Path, ...]
    weights: mmap.mmap | None = None

    def map_weights(self, size: int) -> mmap.mmap:
        """The weights file mapped here, `size` bytes long (resized, and mapped again, when not)."""
        if self.weights is None or len(self.weights) != size:
            if self.weights is not None:
                self.weights.close()
                self.weights = None
            with open(self.weights_file, "r+b") as f:
                f.truncate(size)
                self.weights = mmap.mmap(f.fileno(), size)
        return self.weights

    def reap(self, *, kill: bool = False) -> int | None:
        """Stop the process (`kill`: at once; otherwise asked first), close and delete everything;
        its exit code."""
        if kill:
            self.process.kill()
        elif self.process.poll() is None and self.requests_fd >= 0:
            try:
                write_frame(self.requests_fd, encode_frame({"op": "close"}), deadline=time.monotonic() + 1.0)
            except (OSError, TimeoutError):  # ChildGone is an OSError
                pass  # killed below
        for fd in (self.requests_fd, self.answers_fd):
            if fd >= 0:
                os.close(fd)
        self.requests_fd = self.answers_fd = -1
        try:
            self.process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=_REAP_TIMEOUT_S)
        if not self.control.closed:
            self.control.close()
        if self.weights is not None:
            self.weights.close()
        for path in self.files:
            path.unlink(missing_ok=True)
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)
        return self.process.returncode


def start_process(model_dir: Path, args: list[str], *, owned_dir: Path | None, module: str) -> EngineChild:
    """Start the engine process (`python -m module`): its pipes, its abort flag file and its stderr file."""
    shm = _SHM_DIR if os.access(_SHM_DIR, os.W_OK) else None
    fd, control_name = tempfile.mkstemp(prefix="rollouts-engine-control-", dir=shm)
    os.write(fd, b"\0" * mmap.PAGESIZE)
    control = mmap.mmap(fd, mmap.PAGESIZE)
    os.close(fd)
    weights_fd, weights_name = tempfile.mkstemp(prefix="rollouts-engine-weights-", dir=shm)
    os.close(weights_fd)
    fd, stderr_name = tempfile.mkstemp(prefix="rollouts-engine-stderr-")
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    command = [sys.executable, "-m", module, "--model-dir", str(model_dir)]
    command += ["--requests-fd", str(requests_r), "--answers-fd", str(answers_w), "--control", control_name]
    command += ["--weights", weights_name, *args]
    # What the engine process removes itself if this process dies first (SIGTERM, SIGKILL: no reap here).
    command += ["--sweep", control_name, weights_name, stderr_name, *([] if owned_dir is None else [str(owned_dir)])]
    try:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, pass_fds=(requests_r, answers_w)
        )
    except BaseException:
        for f in (requests_r, requests_w, answers_r, answers_w, fd):
            os.close(f)
        control.close()
        for name in (control_name, stderr_name, weights_name):
            os.unlink(name)
        raise
    for f in (requests_r, answers_w, fd):  # the child's ends: its exit closes the pipes
        os.close(f)
    os.set_blocking(requests_w, False)
    os.set_blocking(answers_r, False)
    return EngineChild(
        process=process,
        requests_fd=requests_w,
        answers_fd=answers_r,
        control=control,
        weights_file=Path(weights_name),
        files=(Path(stderr_name), Path(control_name), Path(weights_name)),
        dirs=() if owned_dir is None else (owned_dir,),
    )
