"""An engine synced by collective broadcast (`[engine] sync = "broadcast"`): each weight update
reads the exported weights here, in the trainer's process and dtype, and broadcasts them into the
engine's workers through a process group joined at the first update, and joined again after a sync
that broke it (rollouts.sync.broadcast)."""

from __future__ import annotations

import os

import torch
import trio
from safetensors.torch import load_file

from rollouts.loops.engines.coalescing import _Wrapped
from rollouts.sync import DEFAULT_BROADCAST, BroadcastOptions, is_adapter_dir
from rollouts.sync.broadcast import BroadcastSync
from rollouts.types import InferenceEngine


class BroadcastWeights(_Wrapped):
    """`update_weights_from_disk(path, version)` sends the safetensors at `path` by broadcast; the
    engine needs no view of the trainer's disk. LoRA adapters are not sent this way (vLLM loads an
    adapter from a path only): merged weights are (model.lora.sync = "merged")."""

    def __init__(self, engine: InferenceEngine, options: BroadcastOptions = DEFAULT_BROADCAST) -> None:
        super().__init__(engine)
        self.sync = BroadcastSync(options, rank=0)  # only the rank that owns the engines syncs them

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


def read_torch_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in directory `path`, in the dtype they were saved in."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors file to send")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out
