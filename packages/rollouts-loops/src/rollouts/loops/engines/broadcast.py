"""An engine synced by collective broadcast (`[engine] sync = "broadcast"`): each weight update
broadcasts the weights, in the trainer's dtype, into the engine's workers through a process group
joined at the first update, and joined again after a sync that broke it (rollouts.sync.broadcast).
The weights come from exported files (`update_weights_from_disk`), or, for a sharded model, straight
from its shards, gathered one bucket at a time as they are sent (`push_weights`, on every rank)."""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch
import trio
from safetensors.torch import load_file

from rollouts.loops.engines.coalescing import _Wrapped
from rollouts.sync import DEFAULT_BROADCAST, BroadcastOptions, EngineFailure, WeightSyncError, is_adapter_dir
from rollouts.sync.broadcast import BroadcastSync, BucketSource
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
    engine needs no view of the trainer's disk. LoRA adapters are not sent this way (vLLM loads an
    adapter from a path only): merged weights are (model.lora.sync = "merged")."""

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
        if is_adapter_dir(path):
            raise ValueError(
                f"{path!r} is a LoRA adapter: engine.sync = 'broadcast' sends full weights only; use "
                "engine.sync = 'disk' (the engine loads the adapter from that path) or model.lora.sync = 'merged'"
            )
        if not self.sync.connected:  # the first sync, or the last one broke the group (a restarted engine)
            await self.sync.connect([self.engine])
        tensors = await trio.to_thread.run_sync(read_torch_weights, path)
        await self.sync.push(tensors, weight_version)

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
        except TimeoutError as exc:
            text = f"did not finish within sync_timeout_s={self.sync_timeout_s}"
            raise WeightSyncError(
                weight_version, [EngineFailure(engine=self.name, url=self.name, status=None, text=text)], []
            ) from exc
        finally:
            if not pushing:
                await self.sync.drain(weights)


def read_torch_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in directory `path`, in the dtype they were saved in."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors file to send")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out
