"""A loss's metrics: 0-dim detached tensors while the step runs, floats once it ends.

A loss returns `(loss, metrics)`. The built-in losses give every metric as a 0-dim detached tensor
on the loss's device, so computing them never waits for the device: reading a CUDA value into a
Python float waits for every kernel queued before it, which, done inside the loss, stalls the host
once per micro-batch before that micro-batch's backward is even queued. The trainer reads a step's
metrics once, after its last backward is queued (`floats_of`, `metrics_to_floats`). A user's loss
may give floats, 0-dim tensors, or both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["Metrics", "detached_metrics", "floats_of", "metrics_to_floats"]

Metrics = Mapping[str, Tensor | float]
"""What a loss may return beside its loss: metric name -> a float or a 0-dim tensor."""


def detached_metrics(**named: Tensor | float) -> dict[str, Tensor]:
    """Each value as a 0-dim detached tensor, without a device sync; a float becomes a float64 tensor on
    the device of the first tensor given (CPU when there is none)."""
    device = next((v.device for v in named.values() if isinstance(v, Tensor)), torch.device("cpu"))
    out: dict[str, Tensor] = {}
    for name, value in named.items():
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
            out[name] = value.detach().reshape(())
        else:  # a fill on the device, not a copy from the host
            out[name] = torch.full((), float(value), dtype=torch.float64, device=device)
    return out


def floats_of(values: Sequence[Tensor | float]) -> list[float]:
    """Python floats of floats and one-element tensors, read as float64 with one device sync per device."""
    out: list[float | None] = [None if isinstance(v, Tensor) else float(v) for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, Tensor):
            by_device.setdefault(value.device, []).append(i)
    for indices in by_device.values():
        stacked = torch.stack([values[i].detach().reshape(()).double() for i in indices])  # type: ignore[union-attr]
        for i, read in zip(indices, stacked.tolist(), strict=True):
            out[i] = read
    return [float(v) for v in out if v is not None]


def metrics_to_floats(metrics: Metrics) -> dict[str, float]:
    """A loss's metrics as Python floats, with one device sync per device."""
    return dict(zip(metrics, floats_of(list(metrics.values())), strict=True))
