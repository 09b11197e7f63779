"""Weights through a file in shared memory, both sides of it: ProcessEngine.load_weights copies a
model's tensors into the file, the engine process copies them out into its model (one copy in,
one copy out, no disk and no pipe).

The engine process reports its weights' layout when it starts (`weight_layout`: names, shapes,
which names share one tensor), so the parent refuses a load that would not fit (`check_fits`)
before copying anything. A load's header lists [name, dtype, shape, offset] per tensor.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from typing import Any

import torch

from rollouts.backends.checkpoint.export import storage_key

__all__ = ["DTYPES", "DTYPE_NAMES", "check_fits", "shared_size", "shared_views", "weight_layout", "write_shared"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes an engine process runs its model in and takes weights in, by the name its command
line and a load's header give."""
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ALIGN = 64  # each tensor of a weight load starts on a cache line of the shared file


def weight_layout(model: torch.nn.Module) -> list[list[Any]]:
    """[name, shape, storage] of each of the model's weights; tied weights share a storage number
    (a load needs one name of each storage). What the parent checks a load against."""
    storages: dict[tuple[int, int], int] = {}
    return [
        [name, list(t.shape), storages.setdefault(storage_key(t), len(storages))]
        for name, t in model.state_dict().items()
    ]


def check_fits(
    tensors: Mapping[str, torch.Tensor],
    *,
    shapes: Mapping[str, tuple[int, ...]],
    storages: Mapping[str, int],
    engine: str,
) -> None:
    """Refuse weights the model of `weight_layout` (`shapes` and `storages` by name) would not
    take: a name it lacks, a weight it has none of (tied weights share one: either name will do),
    a shape other than its own, a tensor of a dtype the engine does not take. `engine` names the
    engine in the error."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{engine}: load_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"{engine}: load_weights: {name!r} has dtype {tensor.dtype}; takes {sorted(DTYPES)}")
    unexpected = [name for name in tensors if name not in shapes]
    covered = {storages[name] for name in tensors if name in storages}
    missing = [name for name, storage in storages.items() if storage not in covered]
    if unexpected or missing:
        raise ValueError(
            f"{engine}: load_weights: the weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"{engine}: load_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is {shapes[name]}"
            )


def shared_size(tensors: Mapping[str, torch.Tensor]) -> tuple[list[list[Any]], int]:
    """A load's header for `tensors` ([name, dtype, shape, offset] each) and the bytes they take."""
    header, offset = [], 0
    for name, tensor in tensors.items():
        offset = -(-offset // _ALIGN) * _ALIGN
        header.append([name, DTYPE_NAMES[tensor.dtype], list(tensor.shape), offset])
        offset += tensor.numel() * tensor.element_size()
    return header, offset


def write_shared(shared: mmap.mmap, tensors: Mapping[str, torch.Tensor], header: list[list[Any]]) -> None:
    """Copy `tensors` into `shared` where `header` (from `shared_size`) places them."""
    for (_, _, _, start), tensor in zip(header, tensors.values(), strict=True):
        if tensor.numel():
            target = torch.frombuffer(shared, dtype=tensor.dtype, count=tensor.numel(), offset=start)
            target.view(tensor.shape).copy_(tensor.detach())  # from any device, with no copy between
            del target  # no view may outlive the mapping


def shared_views(shared: mmap.mmap | None, header: list[list[Any]], size: int) -> dict[str, torch.Tensor]:
    """The engine process's side: the tensors of a load's `header`, as views of the `size`-byte `shared`."""
    tensors = {}
    for name, dtype, shape, offset in header:
        count = 1
        for dim in shape:
            count *= int(dim)
        end = offset + count * DTYPES[dtype].itemsize
        if end > size or offset < 0:
            raise ValueError(f"tensor {name!r} spans bytes {offset}..{end}, outside the {size}-byte weights file")
        flat = (
            torch.frombuffer(shared, dtype=DTYPES[dtype], count=count, offset=offset)
            if count and shared is not None
            else torch.empty(0, dtype=DTYPES[dtype])
        )
        tensors[name] = flat.view(shape)
    return tensors
