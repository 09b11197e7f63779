"""A small HTTP/1.1 server for the agent endpoint: trio TCP streams parsed by h11, on 127.0.0.1.

It runs in the caller's trio event loop (where the engine is awaited), one task per connection,
keep-alive supported. Every wait has a bound: a kept-alive connection waits at most
`idle_timeout_s` for its next request, reading the rest of a request and writing a response at
most `io_timeout_s`; bodies are capped at `max_body_bytes` (413) and open connections at
`max_connections` (503). The handler gets (method, path, body) and returns (status, JSON body).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import trio

__all__ = ["Handler", "ServerLimits", "serve_http"]

Handler = Callable[[str, str, bytes], Awaitable[tuple[int, Any]]]
"""(method, path, body) -> (HTTP status, a JSON-ready response body)."""

_CHUNK_BYTES = 65536
_MAX_HEADER_BYTES = 65536  # h11's bound on a request line plus headers


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLimits:
    """The server's bounds."""

    idle_timeout_s: float = 120.0
    """A kept-alive connection waiting for its next request (an agent thinking between turns)."""
    io_timeout_s: float = 30.0
    """Reading the rest of a request once it has started, writing one response."""
    max_body_bytes: int = 16 * 1024 * 1024
    max_connections: int = 512

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "io_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ServerLimits.{name} must be a finite number of seconds > 0, got {value!r}")
        if self.max_body_bytes < 1 or self.max_connections < 1:
            raise ValueError(f"ServerLimits sizes must be >= 1, got {self.max_body_bytes}, {self.max_connections}")


class _Refused(Exception):
    """A request answered with an error and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def serve_http(
    handler: Handler, limits: ServerLimits, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve `handler` on 127.0.0.1 at a free port (reported through `task_status`) until cancelled."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = int(listener.socket.getsockname()[1])
    open_now = [0]

    async def connection(stream: trio.SocketStream) -> None:
        open_now[0] += 1
        try:
            if open_now[0] > limits.max_connections:
                await _refuse(h11.Connection(h11.SERVER), stream, 503, "too many open connections", limits)
                return
            await _serve_connection(stream, handler, limits)
        finally:
            open_now[0] -= 1
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        task_status.started(port)
        await trio.serve_listeners(connection, [listener], handler_nursery=nursery)


async def _serve_connection(stream: trio.SocketStream, handler: Handler, limits: ServerLimits) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEADER_BYTES)
    while True:
        try:
            request = await _read_request(conn, stream, limits)
        except _Refused as e:
            await _refuse(conn, stream, e.status, str(e), limits)
            return
        if request is None:
            return
        method, path, body = request
        status, payload = await handler(method, path, body)
        await _send(conn, stream, status, payload, limits)
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return  # the client asked to close (or broke off): so do we
        conn.start_next_cycle()


async def _read_request(
    conn: h11.Connection, stream: trio.SocketStream, limits: ServerLimits
) -> tuple[str, str, bytes] | None:
    """The next request's (method, path, body); None when the client closed or stayed idle too long."""
    try:
        event = await _next_event(conn, stream, limits.idle_timeout_s)
    except trio.TooSlowError:
        return None  # an idle keep-alive connection: closed, the client opens another
    if isinstance(event, h11.ConnectionClosed):
        return None
    if not isinstance(event, h11.Request):
        raise _Refused(400, f"expected a request, got {type(event).__name__}")
    method, target = event.method.decode("ascii", "replace"), event.target.decode("ascii", "replace")
    body = bytearray()
    try:
        while not isinstance(event := await _next_event(conn, stream, limits.io_timeout_s), h11.EndOfMessage):
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > limits.max_body_bytes:
                    raise _Refused(413, f"request body over {limits.max_body_bytes} bytes")
    except trio.TooSlowError as e:
        raise _Refused(408, f"request not received within {limits.io_timeout_s} s") from e
    return method, target, bytes(body)


async def _next_event(conn: h11.Connection, stream: trio.SocketStream, timeout_s: float) -> Any:
    """h11's next event, reading from `stream` (each read bounded by `timeout_s`) as it needs data."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise _Refused(e.error_status_hint, f"malformed HTTP request: {e}") from e
        if event is not h11.NEED_DATA:
            return event
        with trio.fail_after(timeout_s):
            try:
                data = await stream.receive_some(_CHUNK_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
        conn.receive_data(data)  # b"": the client closed its side


async def _send(
    conn: h11.Connection, stream: trio.SocketStream, status: int, payload: Any, limits: ServerLimits
) -> None:
    body = json.dumps(payload).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    data = conn.send(h11.Response(status_code=status, headers=headers))
    data = (data or b"") + (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
    try:
        with trio.fail_after(limits.io_timeout_s):
            await stream.send_all(data)
    except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
        conn.send_failed()


async def _refuse(
    conn: h11.Connection, stream: trio.SocketStream, status: int, message: str, limits: ServerLimits
) -> None:
    """Answer `status` with `message` (where a response can still be sent), then the caller closes."""
    if conn.our_state is h11.SEND_RESPONSE or conn.our_state is h11.IDLE:
        payload = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        try:
            await _send(conn, stream, status, payload, limits)
        except h11.LocalProtocolError:
            pass  # the connection is past the point of answering: closing it is the answer
