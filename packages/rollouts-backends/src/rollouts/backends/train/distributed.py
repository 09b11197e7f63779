"""FSDP2 sharding with torch's `fully_shard`, for training on more than one device.

Launch one process per device with torchrun (see the package README); every rank builds the
same model, calls `shard_model`, and then uses forward_backward / optim_step / save_checkpoint
unchanged. FSDP averages gradients over ranks; forward_backward multiplies each loss by the
number of ranks before backward, so the result is the sum over ranks: num_tokens and
num_sequences are the totals over all ranks and the loss normalization stays global.
(`set_gradient_divide_factor(1.0)` would say the same, but its PREMUL_SUM reduction is not
supported by gloo.)

Collectives per micro-batch. By default each micro-batch's forward gathers every layer, its backward
gathers them again and reduce-scatters their gradients: a step of M micro-batches runs 3 M
collectives per layer, each with its host-side bookkeeping. `shard_model(gather_once_per_step=True)`
makes it one gather and one reduce-scatter per layer per step (`step_collectives`): the layers stay
gathered from the step's first forward to its last backward and the gradients accumulate unsharded,
then are reduced once. The price is memory: during the step each rank holds the whole model's
weights (in the compute dtype) and gradients, as an unsharded model would.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rollouts.backends.train.components import model_attr, set_model_attr

__all__ = [
    "all_ok",
    "close_process_group",
    "collective_device",
    "data_parallel_size",
    "distributed_ready",
    "enable_activation_checkpointing",
    "is_distributed",
    "on_all_ranks",
    "rank_world",
    "shard_model",
    "step_collectives",
    "transformer_blocks",
]

_GATHER_ONCE = "_rollouts_gather_once_per_step"
_RESHARD_AFTER_FORWARD = "_rollouts_reshard_after_forward"
CLOSE_BARRIER_TIMEOUT_S = 300.0
"""How long a rank waits at the closing barrier for the others (a checkpoint flush on rank 0, say)."""


def close_process_group(*, clean: bool = True) -> None:
    """Leave the default process group on every exit path; a no-op without one.

    `clean` (the work finished on this rank): wait at a barrier first, so that no rank destroys its
    group while a peer still has a collective in flight against it, then destroy the group while
    the interpreter is fully alive. A group left to the interpreter's exit, or destroyed under a
    peer's pending work, can abort the process in gloo's destructor with "terminate called without
    an active exception" (pytorch/pytorch#190489). On gloo the barrier is `monitored_barrier`:
    rank 0 hears from every rank and answers each, so no send is still in flight when a rank
    leaves (a plain barrier is an allreduce whose last send may be), and it is bounded, naming the
    rank that never arrived. After a failure the barrier is skipped: the peers may never reach it.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if clean:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=CLOSE_BARRIER_TIMEOUT_S))
            else:
                dist.barrier()
    finally:
        dist.destroy_process_group()


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder layers (classes named in HF's `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no decoder-layer classes in _no_split_modules ({sorted(names)}): "
            "cannot choose the units to shard"
        )
    return blocks


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations (an HF model);
    non-reentrant, so it composes with FSDP2's hooks and with log-probs taken after the forward."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5.x; the older name is deprecated there
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model_attr(model, "gradient_checkpointing_enable")(gradient_checkpointing_kwargs=kwargs)


def shard_model(
    model: torch.nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mixed_precision: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    gather_once_per_step: bool = False,
) -> torch.nn.Module:
    """Shard each decoder layer and then the root with `fully_shard`; returns the (same) model.

    Call before building the optimizer (its parameters become DTensor shards). `mesh` defaults
    to all ranks of the default process group. `gather_once_per_step`: forward_backward gathers
    each layer once per step and reduces its gradients once, not per micro-batch (module docstring).
    """
    if not torch.distributed.is_initialized():
        raise ValueError("shard_model needs torch.distributed initialized (launch with torchrun, init_process_group)")
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    # The root (embeddings, final norm, output projection) stays gathered from forward through
    # backward: forward_backward computes log-probs from the output projection's weight after
    # the model's forward returns, and backward would gather it again right away anyway.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    set_model_attr(model, _GATHER_ONCE, gather_once_per_step)
    set_model_attr(model, _RESHARD_AFTER_FORWARD, reshard_after_forward)
    return model


def _no_preparation(index: int) -> None:
    del index


@contextlib.contextmanager
def step_collectives(model: torch.nn.Module, num_micro_batches: int) -> Iterator[Callable[[int], None]]:
    """Around a step's micro-batches: yields `before(i)`, to call before micro-batch i's forward.

    For a model sharded with `gather_once_per_step` and a step of two micro-batches or more, the
    decoder layers stay gathered after each forward and backward, and gradients are reduced only by
    the last micro-batch's backward (which then reshards everything); on the way out the settings
    are restored, and after a failure the step's partial gradients are dropped (those of earlier
    calls, already reduced into the shards, stay) and every layer is resharded. Otherwise `before`
    does nothing.
    Every rank must run the same number of micro-batches (as it must anyway under FSDP2).
    """
    if num_micro_batches < 2 or not getattr(model, _GATHER_ONCE, False) or not isinstance(model, FSDPModule):
        yield _no_preparation
        return
    root: FSDPModule = model
    blocks = [module for module in model.modules() if isinstance(module, FSDPModule) and module is not model]

    def before(index: int) -> None:
        last = index == num_micro_batches - 1
        root.set_requires_gradient_sync(last)
        root.set_reshard_after_backward(last)

    for block in blocks:
        block.set_reshard_after_forward(False, recurse=False)
    finished = False
    try:
        yield before
        finished = True
    finally:
        for block in blocks:
            block.set_reshard_after_forward(getattr(model, _RESHARD_AFTER_FORWARD), recurse=False)
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(True)
        if not finished:  # drop this step's partial, never-reduced gradients, then reshard every layer
            for param in model.parameters():
                if not isinstance(param, DTensor):  # a gathered layer's (sharded ones keep earlier steps' gradients)
                    param.grad = None
            for module in (*blocks, root):
                module.reshard()


def data_parallel_size(model: torch.nn.Module) -> int:
    """How many ranks share (and average) the model's gradients: 1 unless sharded."""
    for param in model.parameters():
        mesh: DeviceMesh | None = getattr(param, "device_mesh", None)  # a DTensor shard's
        if mesh is not None:
            return mesh.size()
    return 1


def is_distributed(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def distributed_ready() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one. The one rank query:
    the loops and run directories ask it too."""
    if distributed_ready():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def all_ok(ok: bool) -> bool:
    """Whether `ok` holds on every rank (an all-reduce, so also a barrier); `ok` itself in one process."""
    if not distributed_ready():
        return ok
    flag = torch.tensor([int(ok)], device=collective_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def on_all_ranks(fn: Callable[[], Any]) -> Any:
    """fn() on this rank; if it raised on any rank, raise on every rank, so that no rank is left
    waiting in a collective for one that failed (a full disk on rank 0, say)."""
    try:
        result = fn()
    except Exception:
        all_ok(False)
        raise
    if not all_ok(True):
        raise RuntimeError(
            f"checkpoint I/O failed on another rank (rank {rank_world()[0]} is fine): see that rank's error"
        )
    return result


def collective_device() -> torch.device:
    """Where tensors for collectives must live: the current CUDA device under NCCL, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
