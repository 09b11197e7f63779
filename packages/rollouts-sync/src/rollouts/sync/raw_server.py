"""A short-lived HTTP endpoint in the trainer's process that serves one payload's raw bytes, so an
engine's workers fetch weights as they are (a bf16 model: its bf16 bytes) instead of receiving them
base64-encoded inside a JSON body.

    async with serve_bytes([header, *tensor_bytes], host="10.0.0.5", timeout_s=120.0) as served:
        await engine_rpc(url=served.url)      # each worker GETs served.url once
    served.sent_bytes                          # what went out on the wire

It answers only `GET /<token>` (a random token in the URL, compared in constant time: the URL is the
credential) and 404 to anything else, up to _MAX_CONNECTIONS connections at once (a tensor-parallel
server's workers fetch side by side; one slow fetcher delays no other), to at most `max_fetches`
fetchers, and only until the `async with` block ends. The bytes are sent from the buffers given (no copy).
Every socket operation is bounded by `timeout_s`, and so is a fetcher that stalls.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

__all__ = ["ServedBytes", "serve_bytes"]

DEFAULT_MAX_FETCHES = 64
"""Fetches one payload serves: every worker of a server (tensor or pipeline parallel), retries included."""
_MAX_HEAD_BYTES = 8192  # a GET from the worker extension is a few hundred bytes; more is not one of ours
_ACCEPT_POLL_S = 0.05  # how often the accept loop looks at the stop flag
_MAX_CONNECTIONS = 16  # served at once, each in a thread of its own (more wait to be accepted)


class ServedBytes:
    """One payload served at `url` until `close()`; `sent_bytes` and `num_fetches` count what went out."""

    def __init__(
        self, parts: Sequence[Any], *, host: str, timeout_s: float, max_fetches: int = DEFAULT_MAX_FETCHES
    ) -> None:
        if not timeout_s > 0 or max_fetches < 1:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0 and max_fetches ({max_fetches}) >= 1")
        self._parts = [memoryview(p).cast("B") for p in parts]
        self.num_bytes = sum(p.nbytes for p in self._parts)
        """The payload's length: what each fetch receives."""
        self._token = secrets.token_urlsafe(24)
        self._timeout_s = timeout_s
        self._max_fetches = max_fetches
        self._listener = socket.create_server((host, 0), family=_family(host))
        self._listener.settimeout(_ACCEPT_POLL_S)
        port = self._listener.getsockname()[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/{self._token}"
        """Where the payload is served; the token in it is the only credential."""
        self.sent_bytes = 0
        """Bytes written to fetchers so far (response heads included)."""
        self.num_fetches = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the counts, written by every connection's thread
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._handlers: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, name="rollouts-raw-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving; returns once the serving threads ended (a send under way ends within timeout_s)."""
        self._stop.set()
        deadline = time.monotonic() + self._timeout_s + 1.0
        self._thread.join(max(0.0, deadline - time.monotonic()))
        for handler in list(self._handlers):
            handler.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set() and self.num_fetches < self._max_fetches:
            if not self._slots.acquire(timeout=_ACCEPT_POLL_S):
                continue
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                self._slots.release()
                continue
            except OSError:  # the listener was closed
                self._slots.release()
                return
            handler = threading.Thread(target=self._handle, args=(conn,), name="rollouts-raw-fetch", daemon=True)
            self._handlers.append(handler)
            handler.start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self._timeout_s)
                try:
                    self._answer(conn)
                except OSError:  # a fetcher that went away or stalled: its own call reports the failure
                    pass
        finally:
            self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        request_line = _read_head(conn, time.monotonic() + self._timeout_s).split(b"\r\n", 1)[0]
        method, _, rest = request_line.partition(b" ")
        target = rest.partition(b" ")[0]
        if method != b"GET" or not hmac.compare_digest(target, f"/{self._token}".encode()):
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        with self._lock:
            if self.num_fetches >= self._max_fetches:  # accepted beside the last one allowed: no answer
                return
            self.num_fetches += 1
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {self.num_bytes}\r\nConnection: close\r\n\r\n"
        ).encode()
        conn.sendall(head)
        self._count(len(head))
        for part in self._parts:
            if self._stop.is_set():
                return
            conn.sendall(part)
            self._count(part.nbytes)

    def _count(self, num_bytes: int) -> None:
        with self._lock:
            self.sent_bytes += num_bytes


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _read_head(conn: socket.socket, deadline: float) -> bytes:
    """The request's head (up to its blank line), at most _MAX_HEAD_BYTES, read before `deadline`."""
    head = b""
    while b"\r\n\r\n" not in head:
        if len(head) > _MAX_HEAD_BYTES or time.monotonic() > deadline:
            raise OSError("request head too long or too slow")
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("connection closed before the request head ended")
        head += chunk
    return head


@asynccontextmanager
async def serve_bytes(
    parts: Sequence[Any], *, host: str, timeout_s: float, max_fetches: int = DEFAULT_MAX_FETCHES
) -> AsyncIterator[ServedBytes]:
    """`parts` (buffers: bytes, numpy arrays, ...) served back to back at a one-off URL on `host` for
    the body of the `async with`; see the module docstring."""
    served = await anyio.to_thread.run_sync(
        lambda: ServedBytes(parts, host=host, timeout_s=timeout_s, max_fetches=max_fetches)
    )
    try:
        yield served
    finally:
        with anyio.CancelScope(shield=True):  # the thread and socket are released even on cancellation
            await anyio.to_thread.run_sync(served.close)
