"""HTTP plumbing shared by the engine clients: bounded retries, errors that say what happened.

Retries cover what a restart or a brief overload looks like (connection refused or dropped,
timeouts, 5xx); a 4xx is the caller's mistake and is raised at once.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Self

import anyio
import httpx

from rollouts.sync._common import check_seconds, parse_weight_version

_RESPONSE_TEXT_MAX_CHARS = 500  # keep error messages readable when a server returns a whole HTML page
_RESUME_TIMEOUT_S = 10.0  # resume runs even after a failed update; it must not hang the caller
_RESUME_ATTEMPT_S = 3.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How many times and how patiently one HTTP call is retried."""

    max_retries: int = 3
    """Retries after the first attempt (0: try once)."""
    backoff_base_s: float = 0.5
    """Wait before the first retry; doubles on each further retry."""
    backoff_max_s: float = 8.0
    """Cap on one wait between attempts."""
    jitter_fraction: float = 0.5
    """Each wait is scaled by a uniform factor in [1 - jitter, 1] so clients do not retry in lockstep."""

    def __post_init__(self) -> None:
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"RetryPolicy.max_retries must be an int >= 0, got {self.max_retries!r}")
        if not (math.isfinite(self.backoff_base_s) and self.backoff_base_s >= 0.0):
            raise ValueError(f"RetryPolicy.backoff_base_s must be a finite number >= 0, got {self.backoff_base_s!r}")
        if not (math.isfinite(self.backoff_max_s) and self.backoff_max_s >= self.backoff_base_s):
            raise ValueError(
                f"RetryPolicy.backoff_max_s ({self.backoff_max_s!r}) must be finite and >= backoff_base_s ({self.backoff_base_s!r})"
            )
        if not 0.0 <= self.jitter_fraction <= 1.0:
            raise ValueError(f"RetryPolicy.jitter_fraction must be in [0, 1], got {self.jitter_fraction!r}")


_RESUME_RETRY = RetryPolicy(max_retries=3, backoff_base_s=0.1, backoff_max_s=1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class HTTPOptions:
    """How an engine client talks to its server: the bound on each attempt, the retries, the pool."""

    timeout_s: float = 120.0
    """Bound on one attempt of one call (connect, read, write and pool alike)."""
    retry: RetryPolicy = RetryPolicy()
    """How many times and how patiently a failed call is retried."""
    max_connections: int = 64
    """Connections kept open to the server (concurrent requests beyond it wait for one)."""
    seed: int | None = None
    """Seed of the retry waits' jitter (None: a fresh seed)."""

    def __post_init__(self) -> None:
        check_seconds("timeout_s", self.timeout_s)
        count = self.max_connections
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"HTTPOptions.max_connections must be an int >= 1, got {count!r}")


DEFAULT_HTTP = HTTPOptions()
"""120 s per attempt, 3 retries with capped exponential backoff, 64 connections."""


def backoff_s(policy: RetryPolicy, retry_index: int, rng: random.Random) -> float:
    """Seconds to wait before retry number `retry_index` (0-based): capped exponential with jitter."""
    base_s = min(policy.backoff_max_s, policy.backoff_base_s * (2.0**retry_index))
    return base_s * (1.0 - policy.jitter_fraction * rng.random())


class EngineError(RuntimeError):
    """An engine call failed for good; names the engine, the URL and what came back."""

    def __init__(self, message: str, *, engine: str, url: str, status: int | None = None, text: str = "") -> None:
        super().__init__(message)
        self.engine = engine
        self.url = url
        self.status = status
        """HTTP status of the last attempt (None: no response, e.g. connection refused or timeout)."""
        self.text = text
        """Start of the last response body, or the transport error."""


def is_retryable_status(status: int) -> bool:
    """5xx (server trouble, restarts) are retried; 4xx (a bad request) are not."""
    return status >= 500


def _shorten(text: str) -> str:
    return text if len(text) <= _RESPONSE_TEXT_MAX_CHARS else text[:_RESPONSE_TEXT_MAX_CHARS] + "...[truncated]"


async def request_with_retries(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    *,
    engine: str,
    timeout_s: float,
    retry: RetryPolicy,
    json: Any = None,
    params: Mapping[str, Any] | None = None,
    rng: random.Random | None = None,
) -> httpx.Response:
    """One HTTP call with bounded retries; returns the 2xx response or raises EngineError.

    Each attempt is bounded by `timeout_s` (connect, read, write and pool alike); the whole call
    by (max_retries + 1) * timeout_s plus the backoff waits.
    """
    rng = rng if rng is not None else random.Random()
    url = str(client.base_url.join(path))
    last_status: int | None = None
    last_text = ""
    num_attempts = retry.max_retries + 1
    for attempt in range(num_attempts):
        if attempt > 0:
            await anyio.sleep(backoff_s(retry, attempt - 1, rng))
        try:
            with anyio.fail_after(timeout_s):
                response = await client.request(method, path, json=json, params=params, timeout=timeout_s)
        except (httpx.TransportError, TimeoutError) as exc:
            last_status = None
            kind = "timed out" if isinstance(exc, (httpx.TimeoutException, TimeoutError)) else "transport error"
            last_text = f"{kind} after {timeout_s} s: {type(exc).__name__}: {exc}".rstrip(": ")
            continue
        if response.is_success:
            return response
        last_status = response.status_code
        last_text = _shorten(response.text)
        if not is_retryable_status(response.status_code):
            raise EngineError(
                f"{engine}: {method} {url} -> HTTP {last_status} (not retried: client error): {last_text}",
                engine=engine,
                url=url,
                status=last_status,
                text=last_text,
            )
    status_part = f"HTTP {last_status}" if last_status is not None else "no response"
    raise EngineError(
        f"{engine}: {method} {url} failed after {num_attempts} attempt(s): {status_part}: {last_text}",
        engine=engine,
        url=url,
        status=last_status,
        text=last_text,
    )


def make_client(base_url: str, *, api_key: str | None, timeout_s: float, max_connections: int) -> httpx.AsyncClient:
    """An AsyncClient for one engine; the API key only ever travels in the Authorization header."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
    parsed = httpx.URL(base_url)
    if parsed.userinfo or parsed.query:
        raise ValueError("base_url must not carry credentials or a query string: pass api_key= instead")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty str or None")
    check_seconds("timeout_s", timeout_s)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=timeout_s,
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        trust_env=False,  # a proxy from the environment must not see engine traffic or the key
    )


class HTTPEngineBase:
    """What the engine clients share: one pooled HTTP client, the retry policy, name and lifecycle.

    The API key lives only inside the client's default headers: never in repr(), a URL or a log.
    Subclasses name the server's endpoints for the weight version and the health check.
    """

    WEIGHT_VERSION_PATH: str
    HEALTH_PATH: str

    def __init__(self, base_url: str, *, api_key: str | None, http: HTTPOptions) -> None:
        self._base_url = base_url.rstrip("/")
        self._client = make_client(
            base_url, api_key=api_key, timeout_s=http.timeout_s, max_connections=http.max_connections
        )
        self.timeout_s = http.timeout_s
        self.retry = http.retry
        self._rng = random.Random(http.seed)
        self._weight_version: int | None = None
        self._update_lock: anyio.Lock | None = None  # made at the first update, in the event loop running it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._base_url!r}, timeout_s={self.timeout_s}, max_retries={self.retry.max_retries})"

    @property
    def name(self) -> str:
        """The server URL (used in logs and errors)."""
        return self._base_url

    @property
    def base_url(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> httpx.Response:
        return await request_with_retries(
            self._client,
            method,
            path,
            engine=self.name,
            json=json,
            params=params,
            timeout_s=timeout_s if timeout_s is not None else self.timeout_s,
            retry=retry if retry is not None else self.retry,
            rng=self._rng,
        )

    @asynccontextmanager
    async def _paused(
        self,
        pause_path: str,
        resume_path: str,
        *,
        params: Mapping[str, Any] | None = None,
        bodies: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
    ) -> AsyncIterator[None]:
        """Generation paused on the server for the body; resumed after it, whatever happens. `bodies`:
        the JSON bodies of the pause and the resume calls (SGLang's; None: no body).

        The resume is sent even when the pause itself fails or is cancelled mid-flight (a deadline
        during a drain): the server may have paused already, and would otherwise stay paused. It is
        retried (a lost request must not leave the engine paused while the update reports success),
        shielded from cancellation and bounded by `_RESUME_TIMEOUT_S` in all. When the body
        succeeded but no resume got through, an EngineError says so: the engine is still paused,
        and a pool must count it as failed. One update runs at a time: a second waits for the first
        to resume (two interleaved would resume mid-update, and the IPC wire's buckets share one file).
        """
        if self._update_lock is None:
            self._update_lock = anyio.Lock()
        async with self._update_lock, self._paused_unlocked(pause_path, resume_path, params=params, bodies=bodies):
            yield

    @asynccontextmanager
    async def _paused_unlocked(
        self,
        pause_path: str,
        resume_path: str,
        *,
        params: Mapping[str, Any] | None,
        bodies: tuple[Mapping[str, Any], Mapping[str, Any]] | None,
    ) -> AsyncIterator[None]:
        body_done = False
        try:
            await self._call("POST", pause_path, params=params, json=None if bodies is None else bodies[0])
            yield
            body_done = True
        finally:
            error: EngineError | None = None
            with anyio.CancelScope(shield=True), anyio.move_on_after(_RESUME_TIMEOUT_S) as window:
                try:
                    resume_body = None if bodies is None else bodies[1]
                    await self._call(
                        "POST", resume_path, json=resume_body, timeout_s=_RESUME_ATTEMPT_S, retry=_RESUME_RETRY
                    )
                except EngineError as e:
                    error = e  # after a failed body, that body's own error is the one to raise
            if body_done and (error is not None or window.cancelled_caught):
                raise EngineError(
                    f"{self.name}: {resume_path} failed after the update, so the engine may still be paused: "
                    f"{error if error is not None else f'no answer within {_RESUME_TIMEOUT_S} s'}",
                    engine=self.name,
                    url=f"{self.name}{resume_path}",
                    status=error.status if error is not None else None,
                    text=error.text if error is not None else "",
                )

    async def weight_version(self) -> int | None:
        """The version the server reports (None before the first update)."""
        data = (await self._call("GET", self.WEIGHT_VERSION_PATH)).json()
        self._weight_version = parse_weight_version(data.get("weight_version"))
        return self._weight_version

    async def health(self) -> bool:
        """Whether the health endpoint answers 200 within timeout_s (one attempt, no retries)."""
        try:
            await self._call("GET", self.HEALTH_PATH, retry=RetryPolicy(max_retries=0))
        except EngineError:
            return False
        return True
