"""Data parallelism for the loops under torchrun: rank 0 drives, every rank trains its share.

The loops' collectives live here; the ones a single training step needs (the rank query
`rank_world`, all-ok agreement, the collective device, closing the group) live in
rollouts.backends.train.distributed and are used from there (`rank_world` is also importable from
this module, beside the collectives that use it).

Collectives carry only tensors: commands and samples travel as JSON bytes in a uint8 tensor, never
as pickles.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from rollouts.backends.train.distributed import close_process_group, collective_device
from rollouts.backends.train.distributed import rank_world as rank_world  # the one rank query, re-exported
from rollouts.data.host_memory import default_pool
from rollouts.types import MicroBatch


def init_distributed() -> tuple[int, int]:
    """(rank, world size); joins the process group when launched by torchrun (WORLD_SIZE > 1).

    NCCL with one GPU per rank (LOCAL_RANK) where CUDA is available, gloo on CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.distributed.get_rank(), world


def close_distributed(*, clean: bool = True) -> None:
    """Leave the process group on every exit path (rollouts.backends' close_process_group)."""
    close_process_group(clean=clean)


def global_sum(value: float) -> float:
    """Sum of a per-rank scalar over all ranks (the value itself on one process)."""
    if rank_world()[1] == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
    torch.distributed.all_reduce(tensor)
    return float(tensor[0])


def global_counts(num_tokens: int, num_sequences: int) -> tuple[int, int]:
    """Step-wide loss-token and sequence counts over all ranks."""
    if rank_world()[1] == 1:
        return num_tokens, num_sequences
    tensor = torch.tensor([num_tokens, num_sequences], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(tensor)
    return int(tensor[0]), int(tensor[1])


def same_count_on_every_rank(micro_batches: list[MicroBatch[np.ndarray]]) -> list[MicroBatch[np.ndarray]]:
    """Pad with zero-loss copies so every rank runs as many forward passes as the busiest one.

    FSDP gathers parameters collectively in every forward and backward: ranks with fewer
    micro-batches would leave the others waiting forever. A copy with loss_mask 0 adds nothing
    to the gradient.
    """
    if rank_world()[1] == 1:
        return micro_batches
    count = torch.tensor([len(micro_batches)], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    filler = micro_batches[-1].replace(loss_mask=np.zeros_like(micro_batches[-1].loss_mask))
    return micro_batches + [filler] * (int(count[0]) - len(micro_batches))


def broadcast_json(obj: Any = None) -> Any:
    """Rank 0's JSON-ready `obj` on every rank (other ranks pass nothing)."""
    if rank_world()[1] == 1:
        return obj
    return json.loads(broadcast_bytes(json.dumps(obj).encode() if rank_world()[0] == 0 else b""))


def broadcast_bytes(data: bytes = b"") -> bytes:
    """Rank 0's `data` on every rank (other ranks pass nothing): its length, then the bytes, as two
    tensor broadcasts (no pickle)."""
    rank, world = rank_world()
    if world == 1:
        return data
    if rank == 0:
        broadcast_tagged(b"", data)
        return data
    return bytes(broadcast_tagged()[1])


def staged(*parts: bytes | memoryview) -> np.ndarray:
    """`parts` back to back in one uint8 array of host memory reused from an earlier step once
    nothing views it (rollouts.data.host_memory): what rank 0 broadcasts, copied once."""
    view, offset = default_pool.take(sum(memoryview(p).nbytes for p in parts)), 0
    for part in parts:
        size = memoryview(part).nbytes
        view[offset : offset + size] = np.frombuffer(part, dtype=np.uint8)
        offset += size
    return view


def broadcast_tagged(tag: bytes = b"", *parts: bytes | memoryview) -> tuple[bytes, memoryview]:
    """Rank 0's tag and parts (joined) on every rank; other ranks pass nothing. What
    `broadcast_bytes` does, with a short tag in front in the same message, and the data in parts
    (e.g. rollouts.types.wire.batch_to_parts) that rank 0 copies once, straight into the tensor it
    sends: a step's batch is tens of MB at real sizes. Every rank gets (tag, a read-only view of the
    data); the view is of memory nothing else holds, and never changes."""
    rank, world = rank_world()
    if world == 1:
        return tag, memoryview(b"".join(parts)).toreadonly()
    device = collective_device()
    sizes = [len(tag), sum(memoryview(p).nbytes for p in parts)] if rank == 0 else [0, 0]
    sizes_tensor = torch.tensor(sizes, dtype=torch.int64, device=device)
    torch.distributed.broadcast(sizes_tensor, src=0)
    num_tag, num_data = (int(n) for n in sizes_tensor.tolist())
    if rank == 0:
        view = staged(tag, *parts)
        buffer = torch.from_numpy(view).to(device)
        received = view
    else:
        buffer = torch.empty(num_tag + num_data, dtype=torch.uint8, device=device)
    torch.distributed.broadcast(buffer, src=0)
    if rank != 0:
        received = buffer.cpu().numpy()
    data = received.data.toreadonly()  # a flat uint8 array's own buffer
    return bytes(data[:num_tag]), data[num_tag:]


def all_gather_arrays(arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Every rank's list of 1-D float32 arrays (any count, any lengths), in rank order.

    Three tensor all-gathers (counts, lengths, padded data); no pickles. One process: [arrays].
    """
    world = rank_world()[1]
    mine = [np.asarray(a, dtype=np.float32).reshape(-1) for a in arrays]
    if world == 1:
        return [mine]
    device = collective_device()

    def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(world)]
        torch.distributed.all_gather(out, tensor)
        return [t.cpu() for t in out]

    counts = [int(c[0]) for c in gather(torch.tensor([len(mine)], dtype=torch.int64, device=device))]
    lengths = torch.zeros(max(1, max(counts)), dtype=torch.int64)
    lengths[: len(mine)] = torch.tensor([len(a) for a in mine], dtype=torch.int64)
    all_lengths = [ls[:n].tolist() for ls, n in zip(gather(lengths.to(device)), counts, strict=True)]
    flat = torch.zeros(max(1, max(sum(ls) for ls in all_lengths)), dtype=torch.float32)
    if mine:
        data = np.concatenate(mine)
        flat[: len(data)] = torch.from_numpy(data)
    out = []
    for ls, values in zip(all_lengths, gather(flat.to(device)), strict=True):
        ends = np.cumsum(ls)
        out.append([values[e - n : e].numpy().copy() for n, e in zip(ls, ends, strict=True)])
    return out
