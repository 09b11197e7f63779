"""Weights from the trainer into engines' workers by a collective broadcast (needs torch: the
`rollouts-sync[broadcast]` extra).

    sync = BroadcastSync(BroadcastOptions(bucket_bytes=256 << 20))
    await sync.connect([VLLMEngine(url)])                  # once: the engines' workers join
    await sync.push(model.state_dict().items(), version)   # each sync: buckets in the trainer's dtype

The trainer (rank 0) hosts a TCPStore; each engine gets a process group of its own on it (gloo on
CPU, NCCL on GPUs; never the default group, so it lives beside FSDP's), so an engine that dies
breaks only its own group: the others still receive every bucket and load. A sync pauses every
engine, POSTs the plan to each (the engine receives while the trainer broadcasts), and loads
nowhere until an engine holds every bucket. Under torch.distributed every rank calls `push` with
its own shards, or with a `BucketSource` (a model's weights gathered one bucket at a time): each
bucket is gathered as it is sent and dropped before the next, so no rank holds more than one
bucket beyond its shard; only rank 0 sends, and rank 0 takes part in every gather even when it
cannot send, so the other ranks never wait on it.

Bounds: joining by `setup_timeout_s`, each bucket by `bucket_timeout_s` (a vLLM worker waits twice
that for each piece: the trainer sends to the engines in turn, so a healthy engine outlasts the
trainer's wait on a stalled one instead of failing with it), the load by `load_timeout_s`; an engine
that fails any of them is named in a WeightSyncError. Attested
(`BroadcastOptions.attest`): each vLLM worker answers the checksums of what it received and holds it
unloaded until they are checked against the trainer's; a mismatch drops it (the engine goes on serving
the weights it had) and raises AttestationError naming the tensors.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import anyio
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rollouts.sync._common import check_weight_version
from rollouts.sync.broadcast_group import broadcast_from_trainer, close_group, join_group, local_address_toward
from rollouts.sync.broadcast_pieces import HostStaging, flat_pieces, needs_host_copy
from rollouts.sync.broadcast_receivers import BroadcastReceiver, check_reported, receiver_for
from rollouts.sync.broadcast_wire import (
    DEFAULT_BROADCAST,
    BroadcastOptions,
    BroadcastPlan,
    TensorSpec,
    adapter_config_json,
    plan_buckets,
)
from rollouts.sync.fingerprint import AttestationError
from rollouts.sync.fingerprint_torch import fingerprint_torch
from rollouts.sync.weight_sync import (
    BroadcastJoinError,
    EngineFailure,
    SyncResult,
    engine_failure,
    sync_outcome,
)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _engine_host(url: str) -> str:
    host = url.split("://", 1)[-1].split("/", 1)[0]
    return host.rsplit(":", 1)[0].strip("[]") if ":" in host else host


@runtime_checkable
class BucketSource(Protocol):
    """Weights handed over one bucket at a time (a sharded model's, gathered as they are sent)."""

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, torch dtype name without "torch.", shape) of every tensor, in the order to send
        them; the same on every rank."""
        ...

    def buckets(self, names: Sequence[Sequence[str]]) -> Iterator[list[torch.Tensor]]:
        """The whole tensors of each group of `names` in turn, contiguous, in the order named; called
        on every rank with the same groups (a gather is a collective). The caller drops a bucket
        before asking for the next."""
        ...


class _WholeTensors:
    """A BucketSource over tensors at hand; a DTensor is gathered (`full_tensor()`) in its bucket."""

    def __init__(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        self.tensors = dict(items)

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(name, _dtype_name(t), tuple(t.shape)) for name, t in self.tensors.items()]

    def buckets(self, names: Sequence[Sequence[str]]) -> Iterator[list[torch.Tensor]]:
        for group in names:
            yield [_full(self.tensors[name]) for name in group]


class _Link:
    """One engine: its receiver, its group (None until joined or once broken), and why it broke."""

    def __init__(self, receiver: BroadcastReceiver) -> None:
        self.receiver = receiver
        self.group: Any = None
        self.error = ""


class BroadcastSync:
    """The trainer's side of the broadcast transport; see the module docstring."""

    def __init__(self, options: BroadcastOptions = DEFAULT_BROADCAST, *, rank: int | None = None) -> None:
        """`rank`: this process's rank in the training job (None: torch.distributed's, or 0 without it)."""
        self.options = options
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self._links: list[_Link] = []
        self._store: Any = None
        self._num_connects = 0  # each connect's groups get fresh names: the store still holds the old keys
        self._token = secrets.token_hex(4)  # and each BroadcastSync's: an engine may hold an earlier trainer's
        self._staging = HostStaging()  # where a GPU's bucket goes first for a gloo group
        self.last_num_bytes = 0
        """Bytes of the weights the last push sent to each engine."""

    @property
    def connected(self) -> bool:
        """Whether every engine of the last connect still has its group (False once one broke)."""
        return bool(self._links) and all(link.group is not None for link in self._links)

    @property
    def device(self) -> torch.device:
        """Where bucket buffers live: the CPU for gloo, this process's GPU for NCCL."""
        if self.options.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    async def connect(self, engines: Sequence[object]) -> None:
        """Join each engine's workers in a group of its own (rank 0 only; other ranks do nothing).
        Raises WeightSyncError naming each engine that did not join within setup_timeout_s."""
        if self.rank != 0:
            return
        if not engines:
            raise ValueError("engines is empty: nothing to connect")
        links = [_Link(receiver_for(e)) for e in engines]
        names = [link.receiver.name for link in links]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique (they identify engines in errors), got {names}")
        host = self.options.host or local_address_toward(_engine_host(names[0]))
        if self._store is None:
            self._store = await anyio.to_thread.run_sync(self._make_store, host)
        self._num_connects += 1
        failures: list[EngineFailure] = []

        async def join(i: int, link: _Link) -> None:
            try:
                with anyio.fail_after(self.options.setup_timeout_s):
                    await self._join(i, link, host)
            except Exception as exc:  # noqa: BLE001 - each engine's failure is reported by name
                failures.append(
                    engine_failure(
                        link.receiver.name,
                        exc,
                        timeout_text=f"did not join within setup_timeout_s={self.options.setup_timeout_s}",
                        note=link.error,
                    )
                )

        old, self._links = self._links, []
        await anyio.to_thread.run_sync(_close_links, old)  # before the new groups: their resources go first
        async with anyio.create_task_group() as tg:
            for i, link in enumerate(links):
                tg.start_soon(join, i, link)
        self._links = links
        if failures:
            raise BroadcastJoinError(failures)

    def _make_store(self, host: str) -> Any:
        timeout = timedelta(seconds=self.options.setup_timeout_s)
        return dist.TCPStore(host, self.options.port, None, True, timeout, wait_for_workers=False)  # type: ignore[attr-defined]

    async def _join(self, i: int, link: _Link, host: str) -> None:
        world_size = 1 + await link.receiver.num_workers()
        group = f"rollouts-sync-{self._token}-{self._num_connects}-{i}"
        address = self.options.host or local_address_toward(_engine_host(link.receiver.name))
        result: dict[str, Any] = {}

        def make_group() -> Any:
            return join_group(
                self._store,
                group=group,
                rank=0,
                world_size=world_size,
                backend=self.options.backend,
                address=address,
                setup_timeout_s=self.options.setup_timeout_s,
                bucket_timeout_s=self.options.bucket_timeout_s,
                prefixes=link.receiver.store_prefixes(group, self.options.backend),
            )

        async def trainer_side() -> None:
            # its failure is raised after the task group: raised inside it, a join cancelled from
            # outside (a caller's deadline) would end in that error instead of the cancellation
            try:
                result["group"] = await anyio.to_thread.run_sync(make_group)
            except Exception as exc:  # noqa: BLE001 - raised below
                result["error"] = exc
                tg.cancel_scope.cancel()  # the workers cannot join without rank 0

        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer_side)  # meets the workers' joins below
            await link.receiver.join(
                host=host, port=int(self._store.port), group=group, world_size=world_size, options=self.options
            )
        if "error" in result:
            raise result["error"]
        link.group = result["group"]

    async def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | BucketSource,
        weight_version: int,
        *,
        adapter_config: Mapping[str, Any] | None = None,
    ) -> SyncResult | None:
        """Send the tensors (HF names; DTensors gathered bucket by bucket, or a BucketSource's
        buckets) to every connected engine and load them there under `weight_version`. On rank 0
        returns the SyncResult, or raises a WeightSyncError naming each engine that failed (the
        others serve the new version); on other ranks only takes part in the gathers and returns None.

        With `adapter_config` (PEFT's adapter_config.json, as a dict), the tensors are a LoRA
        adapter's (adapter_model.safetensors' names): each vLLM engine serves it beside its base
        weights as `<adapter_prefix>-v<weight_version>`, as a disk sync of the adapter's directory
        does, without the engine reading the trainer's disk (its workers write the files on their
        own host). SGLang engines take full weights only (ValueError before anything is sent)."""
        check_weight_version(weight_version)
        adapter_json = None if adapter_config is None else adapter_config_json(adapter_config)
        source = named_tensors if isinstance(named_tensors, BucketSource) else _WholeTensors(named_tensors)
        plan, gathers = self._gathers(source, weight_version)
        try:
            if self.rank != 0:
                return None
            if not self._links:
                raise RuntimeError("BroadcastSync.push before connect(engines): no engine to send to")
            refusing = [link.receiver.name for link in self._links if not link.receiver.takes_adapters]
            if adapter_json is not None and refusing:
                raise ValueError(
                    f"engines {refusing} (SGLang) load LoRA adapters from a path only: sync the adapter's "
                    "directory from disk, or send merged weights"
                )
            self.last_num_bytes = plan.num_bytes
            return await self._push(plan, gathers, adapter_json)
        finally:  # every bucket not gathered yet: the other ranks gather each, whatever happened here
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_drain, gathers)

    async def drain(self, source: BucketSource) -> None:
        """Take part in every gather of a push of `source` without sending (what ranks other than 0
        do; rank 0 too when it cannot push, so that the other ranks do not wait on it)."""
        _, gathers = self._gathers(source, 0)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_drain, gathers)

    def _gathers(self, source: BucketSource, weight_version: int) -> tuple[BroadcastPlan, Iterator[list[torch.Tensor]]]:
        """The plan of a push of `source` and its buckets' gathers (lazy: each runs when asked for)."""
        plan = plan_buckets(source.specs(), bucket_bytes=self.options.bucket_bytes, weight_version=weight_version)
        return plan, source.buckets([[spec.name for spec in bucket] for bucket in plan.buckets])

    async def _push(
        self, plan: BroadcastPlan, gathers: Iterator[list[torch.Tensor]], adapter_json: str | None
    ) -> SyncResult:
        links = self._links
        outcomes: list[EngineFailure | AttestationError | float | None] = [None] * len(links)
        paused = [anyio.Event() for _ in links]
        go, sent = anyio.Event(), anyio.Event()
        expected: dict[str, int] = {}  # checksums of the tensors as sent, filled by the broadcast
        start_s = time.perf_counter()

        async def engine(i: int, link: _Link) -> None:
            try:
                if link.group is None:
                    raise RuntimeError(f"no broadcast group ({link.error or 'never joined'}): connect again")
                async with link.receiver.paused():
                    paused[i].set()
                    await go.wait()  # every engine paused: the broadcast starts now
                    try:
                        reported = await link.receiver.receive(plan, self.options, adapter_json)
                        if self.options.attest and reported is not None:
                            await sent.wait()
                            check_reported(link.receiver, expected, reported, plan.weight_version)
                        await link.receiver.finish(plan.weight_version)
                    except BaseException as exc:  # a mismatch or a failure: what it holds is dropped unloaded
                        if not isinstance(exc, anyio.get_cancelled_exc_class()):  # (cancelled: the next receive)
                            await link.receiver.reject()
                        raise
                await link.receiver.check_version(plan.weight_version)
                outcomes[i] = time.perf_counter() - start_s
            except AttestationError as exc:  # it received other weights than those sent: raised once all are done
                outcomes[i] = exc
            except Exception as exc:  # noqa: BLE001 - each engine's failure is reported by name
                if go.is_set():  # it failed mid-sync: its group may hold half a bucket, so no more sends on it
                    link.group = None
                    link.error = link.error or f"lost during the sync to version {plan.weight_version}"
                outcomes[i] = engine_failure(link.receiver.name, exc, note=link.error)
            finally:
                paused[i].set()

        async with anyio.create_task_group() as tg:
            for i, link in enumerate(links):
                tg.start_soon(engine, i, link)
            for event in paused:
                await event.wait()
            live = [link for link, o in zip(links, outcomes, strict=True) if o is None]
            go.set()
            try:
                await anyio.to_thread.run_sync(self._broadcast_all, plan, gathers, live, expected)
            finally:
                sent.set()
        return sync_outcome(plan.weight_version, [link.receiver.name for link in links], outcomes)

    def _broadcast_all(
        self, plan: BroadcastPlan, gathers: Iterator[list[torch.Tensor]], live: list[_Link], expected: dict[str, int]
    ) -> None:
        """Every bucket to every live group, gathered once per bucket; a group that fails is dropped
        (its engine's receive fails within the bucket bound) and the rest go on. With attestation,
        `expected` gets each tensor's checksum as sent."""
        with ThreadPoolExecutor(1, thread_name_prefix="rollouts-checksum") as checksums:
            for index, bucket in enumerate(plan.buckets):
                full, flat = next(gathers), None
                pending = None  # the bucket's checksums, computed where it is while it is sent (both only read it)
                if self.options.attest:
                    pending = checksums.submit(
                        fingerprint_torch, dict(zip((s.name for s in bucket), full, strict=True))
                    )
                try:
                    if needs_host_copy(full, self.device):  # a GPU's bucket for a gloo group: laid out on the host
                        flat = self._staging.fill(bucket, full)
                        full = self._staging.views(bucket, flat)
                    else:  # already on the group's device, or (NCCL) a host bucket for the GPU
                        full = [t.to(self.device) for t in full]
                    self._send_bucket(index, bucket, full, live, flat=flat)
                finally:
                    if pending is not None:
                        expected.update(pending.result())
                del full, flat, pending  # dropped before the next bucket is gathered

    def _send_bucket(
        self,
        index: int,
        bucket: tuple[TensorSpec, ...],
        full: list[torch.Tensor],
        live: list[_Link],
        flat: torch.Tensor | None = None,
    ) -> None:
        del index  # where a test injects a fault
        flat_links = [k for k in live if k.receiver.layout == "flat"]
        if flat_links:  # each piece cut once, sent to every such engine
            for piece in flat_pieces(bucket, full, flat=flat):
                for link in flat_links:
                    _send(link, piece)
        for link in live:
            if link.receiver.layout != "flat":
                for tensor in full:
                    _send(link, tensor)


def _send(link: _Link, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` on the link's group; a group that fails is marked broken (never used again)."""
    if link.group is None:
        return
    try:
        broadcast_from_trainer(link.group, tensor)
    except RuntimeError as exc:
        link.error = f"broadcast failed: {exc}"
        close_group(link.group)
        link.group = None


def _close_links(links: Sequence[_Link]) -> None:
    """Release the groups of `links` (a connect's before the next connect's are made)."""
    for link in links:
        close_group(link.group)
        link.group = None


def _drain(gathers: Iterator[list[torch.Tensor]]) -> None:
    while next(gathers, None) is not None:  # (a for loop's variable would keep a bucket through the next gather)
        pass


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered from every rank), contiguous."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().contiguous()
