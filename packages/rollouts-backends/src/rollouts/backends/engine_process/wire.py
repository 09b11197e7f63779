"""Frames between ProcessEngine and its engine process: a JSON header and a byte body, over a pipe.

Layout of one frame: MAGIC (4 bytes), header length (4 bytes, little-endian), body length
(8 bytes, little-endian), the UTF-8 JSON header, then the body. Requests carry their arguments in
the header; a generate answer carries its Samples in the body as rollouts.types.wire's batch bytes.
Never pickle.

The parent's side reads and writes a non-blocking pipe under a deadline (`read_frame`,
`write_frame`): a child that hangs is a TimeoutError, one that exits is a `ChildGone`, never a
hang. The child blocks on its end (`next_request`, `write_frame` with no deadline): it has
nothing else to do, and its parent's exit closes the pipe.
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

__all__ = ["ChildGone", "decode_frame", "encode_frame", "next_request", "read_frame", "write_frame"]

MAGIC = b"RPE1"
_PREFIX_BYTES = 16  # MAGIC + header length + body length
MAX_HEADER_BYTES = 64 * 1024**2  # a request's prompts fit many times over; more means a corrupt stream
MAX_BODY_BYTES = 16 * 1024**3  # past any batch of samples one call returns: a corrupt stream otherwise


class ChildGone(ConnectionError):
    """The other end of the pipe closed (the engine process exited; on its side, the parent)."""

    def __init__(self, message: str, *, num_read: int = 0) -> None:
        super().__init__(message)
        self.num_read = num_read
        """Bytes of the frame read before the pipe closed: 0 is a close between frames."""


def encode_frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    """One frame: `header` (JSON-serialisable) and `body`."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    return b"".join([MAGIC, len(head).to_bytes(4, "little"), len(body).to_bytes(8, "little"), head, body])


def _sizes(prefix: bytes) -> tuple[int, int]:
    if prefix[:4] != MAGIC:
        raise ValueError(f"not an engine frame: starts with {prefix[:4]!r}, expected {MAGIC!r}")
    head, body = int.from_bytes(prefix[4:8], "little"), int.from_bytes(prefix[8:16], "little")
    if head > MAX_HEADER_BYTES or body > MAX_BODY_BYTES:
        raise ValueError(f"engine frame sizes out of bounds: header {head} bytes, body {body} bytes")
    return head, body


def decode_frame(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, body) of exactly one frame; ValueError naming what is wrong for anything else."""
    if len(data) < _PREFIX_BYTES:
        raise ValueError(f"engine frame cut short: {len(data)} bytes, the prefix alone is {_PREFIX_BYTES}")
    head, body = _sizes(data[:_PREFIX_BYTES])
    if len(data) != _PREFIX_BYTES + head + body:
        raise ValueError(f"engine frame of {len(data)} bytes, its prefix says {_PREFIX_BYTES + head + body}")
    return _header(data[_PREFIX_BYTES : _PREFIX_BYTES + head]), data[_PREFIX_BYTES + head :]


def _header(data: bytes) -> dict[str, Any]:
    header = json.loads(data)
    if not isinstance(header, dict):
        raise ValueError(f"engine frame header must be a JSON object, got {type(header).__name__}")
    return header


# ---------------------------------------------------------------- reading and writing a pipe


def write_frame(fd: int, frame: bytes, *, deadline: float | None) -> None:
    """Write all of `frame` to `fd`: non-blocking by `deadline` (time.monotonic), or blocking (None)."""
    view = memoryview(frame)
    while view:
        _wait(fd, deadline, write=True)
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue
        except BrokenPipeError as e:
            raise ChildGone("the engine process closed its end of the request pipe") from e


def read_frame(fd: int, *, deadline: float | None) -> tuple[dict[str, Any], bytes]:
    """(header, body) of the next frame on `fd`: non-blocking by `deadline` (time.monotonic), or
    blocking (None)."""
    head, body = _sizes(_read_exact(fd, _PREFIX_BYTES, deadline))
    header = _header(_read_exact(fd, head, deadline, num_read=_PREFIX_BYTES))
    return header, _read_exact(fd, body, deadline, num_read=_PREFIX_BYTES + head)


def next_request(fd: int) -> tuple[dict[str, Any], bytes] | None:
    """The engine process's side: the next frame on blocking `fd`, or None once the parent closed
    the pipe between frames; ValueError for a pipe closed mid-frame."""
    try:
        return read_frame(fd, deadline=None)
    except ChildGone as e:
        if e.num_read:
            raise ValueError(f"request pipe closed mid-frame, after {e.num_read} bytes") from e
        return None


def _read_exact(fd: int, num_bytes: int, deadline: float | None, *, num_read: int = 0) -> bytes:
    """`num_bytes` from `fd` (`num_read` bytes of the frame came before them)."""
    buffer = bytearray(num_bytes)
    view, got = memoryview(buffer), 0
    while got < num_bytes:
        _wait(fd, deadline, write=False)
        try:
            chunk = os.readv(fd, [view[got:]])
        except BlockingIOError:
            continue
        if chunk == 0:
            raise ChildGone(
                f"the engine process closed its answer pipe ({got} of {num_bytes} bytes read)", num_read=num_read + got
            )
        got += chunk
    return bytes(buffer)


def _wait(fd: int, deadline: float | None, *, write: bool) -> None:
    if deadline is None:  # a blocking fd: the read or write itself waits
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the engine process did not answer in time")
    if write:
        select.select([], [fd], [], remaining)
    else:
        select.select([fd], [], [], remaining)
