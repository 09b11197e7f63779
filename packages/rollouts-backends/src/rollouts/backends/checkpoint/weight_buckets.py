"""A model's HF-named full weights, one bucket at a time: what `model_tensors` returns (tied weights
once, a LoRA adapter merged in), without ever holding all of it.

Under FSDP2 a bucket's DTensor shards are gathered (`full_tensor()`, a collective: every rank asks
for the same buckets in the same order) when the bucket is asked for, and the bucket is dropped
before the next one is gathered, so no rank holds more than one bucket beyond its shard. The
iterator counts the bytes it gathered that are still alive (weak references: a bucket a consumer
keeps stays counted), so a caller can check that bound.

    weights = WeightBuckets(model)
    names = [["model.embed_tokens.weight"], ["model.norm.weight", "lm_head.weight"]]
    for tensors in weights.buckets(names):   # on every rank
        send(tensors)                        # then drop them
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from rollouts.backends.checkpoint.export import storage_key
from rollouts.backends.train.lora import lora_layers

__all__ = ["WeightBuckets"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    """One HF-named output tensor and the state-dict tensors it is made of."""

    weight: str
    """The state-dict name of its weight (`<module>.base_layer.weight` for a LoRA layer)."""
    lora: tuple[str, str] | None = None
    """The names of the layer's adapter matrices (A, B) merged into it, if any."""
    scale: float = 0.0
    """The adapter's alpha / r."""


class WeightBuckets:
    """The model's full weights by bucket (see the module docstring); `specs()` reads no weight."""

    def __init__(self, model: torch.nn.Module) -> None:
        # keep_vars: the parameters themselves, so tied ones are one object on every rank (a storage
        # address cannot say so for shards: an empty local shard has none)
        self._state = model.state_dict(keep_vars=True)
        self._entries = _entries(model, self._state)
        self._lock = threading.Lock()
        self.held_bytes = 0
        """Bytes of gathered (or merged) tensors that are alive now."""
        self.peak_held_bytes = 0
        """The most `held_bytes` has been."""

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(HF name, torch dtype name without "torch.", shape) of every tensor, in state-dict order."""
        out = []
        for name, entry in self._entries.items():
            tensor = self._state[entry.weight]
            out.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
        return out

    def buckets(self, names: Sequence[Sequence[str]]) -> Iterator[list[torch.Tensor]]:
        """The whole, contiguous tensors of each group of `names` in turn; call it on every rank with
        the same groups. Each bucket is gathered only when asked for, and this iterator keeps no
        reference to it once the next is asked for."""
        for group in names:
            unknown = [n for n in group if n not in self._entries]
            if unknown:
                raise ValueError(f"not tensors of the model's weights: {unknown[:5]} (see specs())")
            with torch.no_grad():
                bucket = [self._whole(self._entries[name]) for name in group]
            yield bucket
            del bucket  # dropped before the next gather: the consumer holds the only references

    def _whole(self, entry: _Entry) -> torch.Tensor:
        weight = self._gather(self._state[entry.weight])
        if entry.lora is None:
            return weight
        a, b = (self._gather(self._state[name]) for name in entry.lora)
        merged = (weight.to(torch.float32) + entry.scale * (b.to(torch.float32) @ a.to(torch.float32))).to(weight.dtype)
        return self._count(merged)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return tensor.detach().contiguous()  # this rank's own tensor: nothing gathered
        return self._count(tensor.full_tensor().contiguous())

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        num_bytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.held_bytes += num_bytes
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        weakref.finalize(tensor, self._release, num_bytes)
        return tensor

    def _release(self, num_bytes: int) -> None:
        with self._lock:
            self.held_bytes -= num_bytes


def _entries(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, _Entry]:
    """HF name -> how to make it, as `model_tensors` names them: a tied tensor once (its first
    name), adapter matrices merged into their layer's weight (`<module>.base_layer.<w>` -> `<module>.<w>`)."""
    layers = lora_layers(model)
    out: dict[str, _Entry] = {}
    seen: set[object] = set()
    for name, tensor in state.items():
        key = id(tensor) if isinstance(tensor, DTensor) else storage_key(tensor)
        if key in seen or ".lora_" in name:
            continue
        seen.add(key)
        module, found, leaf = name.rpartition(".base_layer.")
        if not found:
            out[name] = _Entry(weight=name)
        elif leaf == "weight" and module in layers:
            lora = (f"{module}.lora_A.default.weight", f"{module}.lora_B.default.weight")
            out[f"{module}.{leaf}"] = _Entry(weight=name, lora=lora, scale=float(layers[module].scaling["default"]))
        else:
            out[f"{module}.{leaf}"] = _Entry(weight=name)
    return out
