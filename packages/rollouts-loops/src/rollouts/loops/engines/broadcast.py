"""Engines synced by collective broadcast (`[engine] sync = "broadcast"`): each weight update
broadcasts the weights, in the trainer's dtype, into the engines' workers through process groups
joined at the first update, and joined again after a sync that broke one (rollouts.sync.broadcast).
The weights come from exported files (`update_weights_from_disk`), or, for a sharded model, straight
from its shards, gathered one bucket at a time as they are sent (`push_weights`, on every rank).
`BroadcastWeights` wraps one engine; `BroadcastPool` is several behind one InferenceEngine, each
bucket read or gathered once and sent to every engine's group."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import torch
import trio
from safetensors.torch import load_file

from rollouts.loops.engines.remote import _Wrapped
from rollouts.sync import (
    DEFAULT_BROADCAST,
    BroadcastOptions,
    EngineFailure,
    EnginePool,
    SyncResult,
    WeightSyncError,
    is_adapter_dir,
)
from rollouts.sync.broadcast import BroadcastSync, BucketSource
from rollouts.sync.weight_sync import BroadcastJoinError
from rollouts.types import InferenceEngine

_DEFAULT_SYNC_TIMEOUT_S = 600.0


@runtime_checkable
class BucketLoader(Protocol):
    """An engine that takes weights bucket by bucket as they are gathered (`BroadcastWeights`)."""

    @property
    def bucket_bytes(self) -> int:
        """The size of its buckets (every rank plans the same gathers from it)."""
        ...

    async def push_weights(self, weights: BucketSource, weight_version: int) -> None: ...


class BroadcastWeights(_Wrapped):
    """`update_weights_from_disk(path, version)` sends the safetensors at `path` by broadcast; the
    engine needs no view of the trainer's disk. A LoRA adapter's directory (model.lora.sync =
    "adapter") goes the same way, its tensors alone, and a vLLM engine serves it as a runtime
    adapter (SGLang takes full weights only: model.lora.sync = "merged")."""

    def __init__(
        self,
        engine: InferenceEngine,
        options: BroadcastOptions = DEFAULT_BROADCAST,
        *,
        sync_timeout_s: float = _DEFAULT_SYNC_TIMEOUT_S,
    ) -> None:
        """`sync_timeout_s` bounds a whole `push_weights` (joining the group included)."""
        if not sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be > 0, got {sync_timeout_s}")
        super().__init__(engine)
        self.sync = BroadcastSync(options, rank=0)  # only the rank that owns the engines syncs them
        self.sync_timeout_s = sync_timeout_s

    @property
    def bucket_bytes(self) -> int:
        return self.sync.options.bucket_bytes

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        if not self.sync.connected:  # the first sync, or the last one broke the group (a restarted engine)
            await self.sync.connect([self.engine])
        tensors = await trio.to_thread.run_sync(read_torch_weights, path)
        await self.sync.push(tensors, weight_version, adapter_config=adapter_config(path))

    async def push_weights(self, weights: BucketSource, weight_version: int) -> None:
        """Send `weights` (a sharded model's: every other rank drains the same buckets meanwhile,
        `BroadcastSync.drain`) and load them as `weight_version`, within `sync_timeout_s`. However
        it ends, this rank has taken part in every bucket's gather, so no other rank waits on it."""
        pushing = False
        try:
            with trio.fail_after(self.sync_timeout_s):
                if not self.sync.connected:  # the first sync, or the last one broke the group
                    await self.sync.connect([self.engine])
                pushing = True  # from here the push itself gathers every bucket, whatever fails
                await self.sync.push(weights, weight_version)
        except trio.TooSlowError as exc:
            text = f"did not finish within sync_timeout_s={self.sync_timeout_s}"
            raise WeightSyncError(
                weight_version, [EngineFailure(engine=self.name, url=self.name, status=None, text=text)], []
            ) from exc
        finally:
            if not pushing:
                await self.sync.drain(weights)


class BroadcastPool(EnginePool):
    """Several vLLM / SGLang engines behind one InferenceEngine, synced by one broadcast: each bucket
    is read (`update_weights_from_disk`) or gathered (`push_weights`) once and sent to every engine's
    group of one BroadcastSync. Generation and health are EnginePool's (least outstanding requests,
    an engine with no response leaves the rotation), and so is a sync's outcome: an engine that did
    not join, broke mid-sync or ended on another version is named in a WeightSyncError whose
    `updated` lists the engines serving the new version, each whole (the others keep their old
    weights whole); an AttestationError wins over both. The whole sync is bounded by
    `sync_timeout_s` (a group join or a bucket already under way first ends at its own bound,
    setup_timeout_s or bucket_timeout_s); past it, the engines that report the new version count as
    updated and the others are named.

    After any failed sync every engine joins afresh at the next one (new groups on the same store,
    each join bounded by setup_timeout_s): a restarted engine rejoins without the others keeping a
    group that may hold half a bucket; one that stays down is named again while the others load."""

    def __init__(
        self,
        engines: Sequence[InferenceEngine],
        options: BroadcastOptions = DEFAULT_BROADCAST,
        *,
        sync_timeout_s: float = _DEFAULT_SYNC_TIMEOUT_S,
        max_concurrency_per_engine: int = 32,
        health_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(
            engines,
            max_concurrency_per_engine=max_concurrency_per_engine,
            health_timeout_s=health_timeout_s,
            sync_timeout_s=sync_timeout_s,
        )
        self.broadcast = BroadcastSync(options, rank=0)  # only the rank that owns the engines syncs them
        self._stale = True  # every engine joins before the next sync: the first, or any after a failure

    @property
    def bucket_bytes(self) -> int:
        return self.broadcast.options.bucket_bytes

    async def sync(self, path: str, weight_version: int) -> SyncResult:
        """Read the safetensors at `path` once and broadcast them to every engine as `weight_version`
        (a LoRA adapter's directory: the adapter, served by each vLLM engine as a runtime adapter)."""
        return await self._push(path, weight_version)

    async def push_weights(self, weights: BucketSource, weight_version: int) -> None:
        """Send `weights` bucket by bucket to every engine (a sharded model's: every other rank drains
        the same buckets meanwhile). However it ends, this rank has taken part in every bucket's
        gather, so no other rank waits on it."""
        await self._push(weights, weight_version)

    async def _push(self, weights: str | BucketSource, weight_version: int) -> SyncResult:
        stale, self._stale = self._stale, True  # cleared only by a sync every engine took whole
        not_joined: list[EngineFailure] = []
        try:
            with trio.fail_after(self.sync_timeout_s):
                result = await self._join_and_push(weights, weight_version, stale=stale, not_joined=not_joined)
        except trio.TooSlowError as exc:
            raise await self._timed_out(weight_version, not_joined) from exc
        except WeightSyncError as exc:
            if not not_joined:
                raise
            why = {f.engine: f for f in not_joined}  # say why an engine had no group, not only that
            failures = [why.get(f.engine, f) for f in exc.failures]
            raise WeightSyncError(weight_version, failures, exc.updated) from exc
        self._stale = False
        return result

    async def _join_and_push(
        self, weights: str | BucketSource, weight_version: int, *, stale: bool, not_joined: list[EngineFailure]
    ) -> SyncResult:
        """Join every engine afresh if `stale` (adding those that did not join to `not_joined`: they
        fail this sync, the others still get it), then push. A BucketSource's buckets are all gathered
        here however it ends."""
        pushing = False
        try:
            if stale or not self.broadcast.connected:
                not_joined.extend(await self._join())
            pushing = True  # from here the push itself gathers every bucket, whatever fails
            source = (
                weights
                if isinstance(weights, BucketSource)
                else await trio.to_thread.run_sync(read_torch_weights, weights)
            )
            config = None if isinstance(weights, BucketSource) else adapter_config(weights)
            result = await self.broadcast.push(source, weight_version, adapter_config=config)
        finally:
            if not pushing and isinstance(weights, BucketSource):
                await self.broadcast.drain(weights)
        assert result is not None  # rank 0's push returns its result or raises
        return result

    async def _join(self) -> tuple[EngineFailure, ...]:
        """Every engine joins a fresh group; those that did not (the others still get this sync)."""
        try:
            await self.broadcast.connect(self.engines)
        except BroadcastJoinError as exc:
            return tuple(replace(f, text=f"did not join the broadcast group: {f.text}") for f in exc.failures)
        return ()

    async def _timed_out(self, weight_version: int, not_joined: Sequence[EngineFailure]) -> WeightSyncError:
        """The error for a sync past sync_timeout_s: each engine is asked its version (each within
        health_timeout_s); those on `weight_version` loaded it whole (a version is set only after the
        last bucket loaded), the others are named."""
        versions: list[int | None] = [None] * len(self.engines)

        async def ask(i: int) -> None:
            with trio.move_on_after(self.health_timeout_s):
                try:
                    versions[i] = await self.engines[i].weight_version()
                except Exception:  # noqa: BLE001 - an engine that cannot say is named below
                    return

        async with trio.open_nursery() as nursery:
            for i in range(len(self.engines)):
                nursery.start_soon(ask, i)
        why = {f.engine: f for f in not_joined}
        text = f"did not finish within sync_timeout_s={self.sync_timeout_s}"
        updated = [e.name for e, v in zip(self.engines, versions, strict=True) if v == weight_version]
        failures = [
            why.get(e.name, EngineFailure(engine=e.name, url=e.name, status=None, text=text))
            for e, v in zip(self.engines, versions, strict=True)
            if v != weight_version
        ]
        return WeightSyncError(weight_version, failures, updated)


def adapter_config(path: str) -> dict[str, Any] | None:
    """The adapter_config.json of `path` if it holds a LoRA adapter (PEFT's format), else None."""
    if not is_adapter_dir(path):
        return None
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path}/adapter_config.json is not a JSON object")
    return config


def read_torch_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in directory `path`, in the dtype they were saved in."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors file to send")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out
