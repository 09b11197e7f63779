"""Push a checkpoint to many engines at once (one anyio task group), each bounded in time.

Every engine gets the same deadline; one slow or dead engine neither blocks the others nor
hangs the caller. Retries (exponential backoff with jitter on connection errors and 5xx,
none on 4xx) live in each engine's HTTP calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from rollouts.sync._common import check_seconds, check_weight_version
from rollouts.sync._http import EngineError
from rollouts.sync.fingerprint import AttestationError
from rollouts.types import InferenceEngine


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineFailure:
    """Why one engine did not take the new weights."""

    engine: str
    """The engine's name (its URL)."""
    url: str
    """The URL of the call that failed last."""
    status: int | None
    """HTTP status of that call (None: no response, timeout, or an error outside HTTP)."""
    text: str
    """Response text or error message."""

    def describe(self) -> str:
        status = f"HTTP {self.status}" if self.status is not None else "no response"
        return f"{self.engine} ({self.url}): {status}: {self.text}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncResult:
    """What a successful sync did."""

    weight_version: int
    updated: tuple[str, ...]
    """Names of the engines that now serve `weight_version`, in input order."""
    seconds_by_engine: tuple[float, ...]
    """[E] wall seconds each engine's update took (same order as `updated`)."""


class WeightSyncError(RuntimeError):
    """Some engines failed to update; `failures` says why, `updated` which engines did."""

    def __init__(self, weight_version: int, failures: Sequence[EngineFailure], updated: Sequence[str]) -> None:
        self.weight_version = weight_version
        self.failures = tuple(failures)
        self.updated = tuple(updated)
        lines = [f"weight sync to version {weight_version} failed on {len(self.failures)} engine(s):"]
        lines += [f"  - {f.describe()}" for f in self.failures]
        lines.append(f"updated ({len(self.updated)}): {', '.join(self.updated) if self.updated else 'none'}")
        super().__init__("\n".join(lines))


class BroadcastJoinError(WeightSyncError):
    """Some engines did not join the broadcast group; `failures` names each and says why."""

    def __init__(self, failures: Sequence[EngineFailure]) -> None:
        super().__init__(0, failures, [])
        lines = [f"{len(self.failures)} engine(s) did not join the weight-broadcast group:"]
        self.args = ("\n".join(lines + [f"  - {f.describe()}" for f in self.failures]),)


def engine_failure(name: str, exc: BaseException, *, timeout_text: str = "", note: str = "") -> EngineFailure:
    """Engine `name`'s failure `exc` as an EngineFailure: an EngineError's URL and status; a
    TimeoutError as `timeout_text` where given; `note` (what else is known) appended."""
    suffix = f"; {note}" if note else ""
    if isinstance(exc, EngineError):
        return EngineFailure(engine=name, url=exc.url, status=exc.status, text=str(exc) + suffix)
    if isinstance(exc, TimeoutError) and timeout_text:
        return EngineFailure(engine=name, url=name, status=None, text=timeout_text)
    return EngineFailure(engine=name, url=name, status=None, text=f"{type(exc).__name__}: {exc}{suffix}")


def sync_outcome(
    version: int, names: Sequence[str], outcomes: Sequence[EngineFailure | AttestationError | float | None]
) -> SyncResult:
    """The SyncResult of engines `names` (a float outcome: seconds to update); a WeightSyncError
    naming the failed engines; or, before either, the first AttestationError (an engine received
    weights other than those sent: no caller should go on), the others' as its notes."""
    attestation = [o for o in outcomes if isinstance(o, AttestationError)]
    if attestation:
        for other in attestation[1:]:
            attestation[0].add_note(str(other))
        raise attestation[0]
    failures = [o for o in outcomes if isinstance(o, EngineFailure)]
    updated = [name for name, o in zip(names, outcomes, strict=True) if isinstance(o, float)]
    if failures:
        raise WeightSyncError(version, failures, updated)
    seconds = tuple(o for o in outcomes if isinstance(o, float))
    return SyncResult(weight_version=version, updated=tuple(updated), seconds_by_engine=seconds)


async def sync_weights_to_engines(
    engines: Sequence[InferenceEngine],
    checkpoint_dir: str,
    weight_version: int,
    *,
    timeout_s: float,
) -> SyncResult:
    """Load `checkpoint_dir` into every engine concurrently; each engine gets at most `timeout_s`.

    Raises WeightSyncError naming every failed engine (URL, status, response text) and the
    engines that did update, so the caller can decide whether to go on with a partial pool; but an
    engine whose attestation failed (it received weights other than the ones sent, and did not load
    them) raises its AttestationError, naming the tensors, once every engine is done: no caller
    should go on from it.
    """
    if not engines:
        raise ValueError("engines is empty: nothing to sync")
    check_seconds("timeout_s", timeout_s)
    check_weight_version(weight_version)  # the caller's mistake, not N engine failures
    if not isinstance(checkpoint_dir, str) or not checkpoint_dir:
        raise ValueError(
            f"checkpoint_dir must be a non-empty str (the path as the engines see it), got {checkpoint_dir!r}"
        )
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"engine names must be unique (they identify engines in errors), got {names}")
    outcomes: list[EngineFailure | AttestationError | float | None] = [None] * len(engines)

    async def one(i: int, engine: InferenceEngine) -> None:
        start_s = time.perf_counter()
        try:
            with anyio.fail_after(timeout_s):
                await engine.update_weights_from_disk(checkpoint_dir, weight_version)
                got = await engine.weight_version()
            if got != weight_version:
                outcomes[i] = EngineFailure(
                    engine=engine.name,
                    url=engine.name,
                    status=None,
                    text=f"reports weight version {got!r} after the update, expected {weight_version}",
                )
                return
            outcomes[i] = time.perf_counter() - start_s
        except AttestationError as exc:
            outcomes[i] = exc
        except WeightSyncError as exc:  # a wrapped engine's own sync (a broadcast) named its failure already
            named = [f for f in exc.failures if f.engine == engine.name]
            outcomes[i] = named[0] if named else engine_failure(engine.name, exc)
        except Exception as exc:  # noqa: BLE001 - one engine's bug must not hide the others' results
            outcomes[i] = engine_failure(engine.name, exc, timeout_text=f"did not finish within timeout_s={timeout_s}")

    async with anyio.create_task_group() as tg:
        for i, engine in enumerate(engines):
            tg.start_soon(one, i, engine)
    return sync_outcome(weight_version, names, outcomes)
