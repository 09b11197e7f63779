"""The trainer's side of a flat bucket's bytes (needs torch: the `broadcast` extra): the pieces a
bucket is broadcast in, and the host buffer a bucket from another device is copied into first.

A vLLM worker receives each bucket into one flat buffer, each tensor at its planned offset
(rollouts.sync.broadcast_wire). On the trainer a tensor of SMALL_TENSOR_BYTES or more is broadcast
from its own memory (no copy) and each run of smaller ones packed; tensors on another device than
the group's (a GPU's, for a gloo group) are first copied into a `HostStaging` buffer laid out as the
bucket is, and the pieces are its slices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from rollouts.sync.broadcast_wire import TensorSpec, bucket_pieces

__all__ = ["HostStaging", "flat_pieces"]


def flat_pieces(
    bucket: Sequence[TensorSpec], full: Sequence[torch.Tensor], *, flat: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """What fills a bucket's flat buffer, one broadcast each, in the plan's order (`bucket_pieces`):
    a large tensor's own bytes (a view: no copy), or a run of small ones packed at their offsets;
    with `flat` (the bucket laid out already, `HostStaging.fill`), each piece is its slice."""
    tensors = dict(zip((spec.name for spec in bucket), full, strict=True))
    for piece in bucket_pieces(bucket):
        if flat is not None:
            yield flat[piece[0].offset : piece[-1].offset + piece[-1].num_bytes]
        elif len(piece) == 1:
            yield _bytes_of(tensors[piece[0].name])
        else:
            yield _pack(piece, [tensors[spec.name] for spec in piece])


class HostStaging:
    """Host memory a bucket of tensors from another device is copied into, each at its planned offset,
    kept from one bucket to the next and from sync to sync (page-locked where CUDA is, so the copies
    from the GPU run at full speed): fresh host memory for each tensor of each sync would be mapped
    page by page every time. `fill` answers the bucket's bytes, valid until the next `fill`."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def fill(self, bucket: Sequence[TensorSpec], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        end = bucket[-1].offset + bucket[-1].num_bytes
        if self._buffer is None or self._buffer.numel() < end:
            self._buffer = None  # the old one goes before the new one is allocated
            self._buffer = torch.empty(end, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        flat = self._buffer[:end]
        for spec, tensor in zip(bucket, tensors, strict=True):
            flat[spec.offset : spec.offset + spec.num_bytes].copy_(_bytes_of(tensor))  # waits for the copy
        return flat

    def views(self, bucket: Sequence[TensorSpec], flat: torch.Tensor) -> list[torch.Tensor]:
        """The bucket's tensors as views of its `flat` bytes (what `fill` answered)."""
        return [flat[s.offset : s.offset + s.num_bytes].view(getattr(torch, s.dtype)).view(s.shape) for s in bucket]


def needs_host_copy(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether a bucket for a group on the host (`device`, the group's, is the CPU: gloo) holds tensors
    from another device, to be copied into a HostStaging buffer first."""
    return device.type == "cpu" and any(t.device != device for t in tensors)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _pack(piece: Sequence[TensorSpec], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes [first offset, last end) of a bucket's flat buffer, each tensor at its planned
    offset (on the tensors' device; zeros in the alignment gaps)."""
    start, last = piece[0].offset, piece[-1]
    flat = torch.zeros(last.offset + last.num_bytes - start, dtype=torch.uint8, device=tensors[0].device)
    for spec, tensor in zip(piece, tensors, strict=True):
        flat[spec.offset - start : spec.offset - start + spec.num_bytes].copy_(_bytes_of(tensor))
    return flat
