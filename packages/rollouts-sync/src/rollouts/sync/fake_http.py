"""The minimal HTTP/1.1 the fake engine server speaks on anyio: one request per connection, bounded
reads, JSON answers. Enough for the engine clients' requests, and nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import ByteStream

__all__ = ["Fault", "HTTPError", "json_response", "pop_fault", "read_request", "send_response"]

MAX_HEAD_BYTES = 64 * 1024
"""Request line + headers; more is not a request an engine client sends."""
MAX_BODY_BYTES = 512 * 1024 * 1024
"""Bound on a body (weights travel in bodies)."""
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(slots=True, kw_only=True)
class Fault:
    """Misbehave on requests whose path starts with `path` (every path if empty), `times` times."""

    kind: str
    """"status": answer `status` with `text`; "delay": sleep `delay_s` first; "drop": close without answering."""
    path: str = ""
    times: int = 1
    status: int = 500
    text: str = "injected failure"
    delay_s: float = 0.0


def pop_fault(faults: list[Fault], path: str) -> Fault | None:
    """The first fault that still applies to `path`, counted down; None if none does."""
    for fault in faults:
        if fault.times > 0 and path.startswith(fault.path):
            fault.times -= 1
            return fault
    return None


class HTTPError(Exception):
    """Answer with `status` and `text` (as {"error": text})."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def json_response(status: int, obj: Any) -> tuple[int, bytes]:
    """(status, the JSON body)."""
    return status, json.dumps(obj).encode()


async def _receive(stream: ByteStream, max_bytes: int) -> bytes:
    """Up to `max_bytes` from the stream; b"" once the peer has closed it."""
    try:
        return await stream.receive(max_bytes)
    except anyio.EndOfStream:
        return b""


async def read_request(stream: ByteStream) -> tuple[str, str, dict[str, str], bytes] | None:
    """(method, target, lower-cased headers, body), or None for a closed, oversized or cut-off request."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await _receive(stream, 65536)
        if not chunk or len(buf) > MAX_HEAD_BYTES:
            return None
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    length = int(headers.get("content-length", "0"))
    if length > MAX_BODY_BYTES:
        return None
    while len(body) < length:
        chunk = await _receive(stream, min(1 << 20, length - len(body)))
        if not chunk:
            return None
        body += chunk
    return method, target, headers, body


async def send_response(stream: ByteStream, status: int, payload: bytes) -> None:
    """A JSON response, then the connection closes (the caller closes the stream)."""
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    await stream.send(head.encode("latin-1") + payload)
