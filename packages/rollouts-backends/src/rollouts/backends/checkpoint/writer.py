"""CheckpointWriter: the background thread that finishes checkpoints (fsync, publish, retention) and
deletes renamed-away directories while training goes on. The caller owns it and closes it, as a
training loop owns its other resources:

    with CheckpointWriter() as writer:
        for step in ...:
            save_checkpoint(components, state, root, writer=writer)  # returns once the bytes are written
    # closed: the last checkpoint is published, or its error was raised

At most one job runs at a time and jobs run in submission order: a new job waits for the one in
flight, so checkpoints are published in step order and a slow disk holds training back by at
most one checkpoint. A job's error is raised by the writer's next call (`submit`, `wait`, `close`),
once. The thread is not a daemon: an interpreter that exits without closing the writer still
finishes the job in flight rather than leaving half a checkpoint behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from rollouts.backends.train.distributed import distributed_ready, on_all_ranks

__all__ = ["CheckpointWriter"]


class CheckpointWriter:
    """One background job at a time, in order; errors surface on the next call. Not thread-safe:
    one training loop (one thread) drives it."""

    def __init__(self, *, name: str = "rollouts-checkpoint-writer") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False

    def submit(self, job: Callable[[], object]) -> None:
        """Run `job` on the writer's thread once the job in flight is done (raising that one's error)."""
        if self._closed:
            raise RuntimeError(f"{self._name} is closed: no more checkpoints can be written through it")
        self._join(None)

        def run() -> None:
            try:
                job()
            except BaseException as error:  # handed to whoever calls next
                self._error = error

        self._thread = threading.Thread(target=run, name=self._name)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the job in flight is done; raise its error, if it had one.

        Under torch.distributed every rank must call it together: rank 0 finishes the checkpoints
        and the other ranks learn from it that they are published (or that publishing failed)."""
        if distributed_ready():
            on_all_ranks(lambda: self._join(timeout))
        else:
            self._join(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the job in flight (on every rank together, as `wait`), then refuse new ones;
        idempotent. Raises the job's error."""
        if self._closed:
            return
        self._closed = True
        self.wait(timeout)

    @property
    def busy(self) -> bool:
        """Whether a job is still running."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        self._closed = True  # already failing, maybe on this rank alone: no collective, finish the job
        try:  # in flight and keep the original error
            self._join(None)
        except BaseException as error:
            exc.add_note(f"the checkpoint writer also failed: {error!r}")

    def _join(self, timeout: float | None) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"{self._name}: a checkpoint is still being written after {timeout} s")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint in the background failed: {error!r}") from error
