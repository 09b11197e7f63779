"""The generation side of the SPMD RL loop: rank 0's rollout producer, the broadcast of each step's
batch to the other ranks, and the engine sync (export on every rank, load on rank 0; or, for a
sharded model and an engine that takes weight buckets, each bucket gathered on every rank as rank 0
sends it) with its check, the sync probe.

Collectives run in worker threads so rank 0's event loop keeps generating while it waits; their
order is the same on every rank because only the loop's one consumer task calls them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

from rollouts.backends import CheckpointWriter, TrainingComponents, WeightBuckets, compute_logprobs, export_weights
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.backends.checkpoint.lora_files import save_adapter
from rollouts.backends.train.distributed import is_distributed
from rollouts.backends.train.lora import syncs_adapter
from rollouts.data import AsyncRolloutManager, pack_samples
from rollouts.loops.engines.broadcast import BucketLoader
from rollouts.loops.engines.rollout_process import RemoteRolloutManager
from rollouts.loops.run.distributed import broadcast_json, broadcast_tagged, rank_world
from rollouts.loops.run.run_dir import ADAPTER_DIR, WEIGHTS_DIR
from rollouts.sync import BroadcastOptions
from rollouts.sync.broadcast import BroadcastSync
from rollouts.types import Abortable, InferenceEngine, RolloutBatch, Sample, SamplingParams, TrainingState, WeightLoader
from rollouts.types.wire import batch_from_bytes, batch_to_parts

log = logging.getLogger(__name__)

_SHARED_METADATA = (
    "errors",
    "error_causes",
    "groups_requested",
    "groups_partial",
    "groups_restarted",
    "num_rounds",
    "generate_s",
)
"""The batch metadata the other ranks receive (what every rank logs or raises on)."""


def shared_metadata(batch: RolloutBatch) -> dict[str, Any]:
    """The batch metadata every rank receives (and a checkpoint keeps with a batch generated ahead)."""
    metadata = {k: v for k, v in batch.metadata.items() if k in _SHARED_METADATA}
    if "errors" in metadata:
        metadata["errors"] = [str(e) for e in metadata["errors"]]
    if "error_causes" in metadata:  # frozen in the batch: a plain dict for JSON
        metadata["error_causes"] = {str(cause): int(num) for cause, num in metadata["error_causes"].items()}
    return metadata


def _shared(batch: RolloutBatch) -> RolloutBatch:
    """The batch every rank trains on: rank 0's, with only the metadata the others receive."""
    return dataclasses.replace(batch, metadata=shared_metadata(batch))


class BatchSource:
    """Rank 0: a producer task generating one batch per request into a channel. Every rank: `next`
    returns the step's batch, broadcast from rank 0 (a generation error is raised on every rank)."""

    def __init__(
        self,
        nursery: trio.Nursery,
        manager: AsyncRolloutManager | RemoteRolloutManager | None,
        lock: trio.Lock,
        ahead: RolloutBatch | None,
        *,
        hold_lock: bool = True,
    ) -> None:
        """`hold_lock`: generate a batch holding the engine lock, so a sync waits for it; without it
        (partial rollouts) a sync pauses the manager instead (`sync_engine(manager=...)`)."""
        self.ahead = ahead
        self._hold_lock = hold_lock
        self._outstanding = False
        self._requests, requests_rx = trio.open_memory_channel[tuple[int, int]](1)
        self._results_tx, self._results = trio.open_memory_channel[Any](1)
        if manager is not None:
            nursery.start_soon(self._produce, manager, lock, requests_rx)

    async def _produce(
        self, manager: AsyncRolloutManager | RemoteRolloutManager, lock: trio.Lock, requests: Any
    ) -> None:
        async for step, train_version in requests:
            async with lock if self._hold_lock else contextlib.nullcontext():
                start = time.perf_counter()
                try:
                    if isinstance(manager, RemoteRolloutManager):  # its buffer is a copy: ours follows it
                        batch, position = await manager.generate_batch(step=step, train_version=train_version)
                        manager.buffer.load_state_dict(position)
                    else:
                        batch = await manager.generate_batch(step=step, train_version=train_version)
                    seconds = time.perf_counter() - start  # logged as generate_s
                    result: Any = (dataclasses.replace(batch, metadata={**batch.metadata, "generate_s": seconds}),)
                except Exception as error:  # handed to the consumer, which raises it
                    result = error
            await self._results_tx.send(result)

    async def request(self, step: int, train_version: int) -> None:
        """Have rank 0 generate step `step`'s batch, to be trained at weight version `train_version`
        (the rollout manager restarts partial groups too stale for it)."""
        if self.ahead is None and not self._outstanding:
            self._outstanding = True
            if rank_world()[0] == 0:
                await self._requests.send((step, train_version))

    async def wait_ahead(self) -> RolloutBatch | None:
        """The batch generated ahead (overlap), received so a checkpoint can hold it; None if none."""
        if self.ahead is None and self._outstanding:
            self.ahead = await self._receive()
        return self.ahead

    async def next(self, step: int, train_version: int) -> tuple[RolloutBatch, float]:
        await self.request(step, train_version)
        if self.ahead is not None:
            batch, self.ahead = self.ahead, None
            return batch, 0.0
        start = time.perf_counter()
        return await self._receive(), time.perf_counter() - start

    async def _receive(self) -> RolloutBatch:
        self._outstanding = False
        rank, world = rank_world()
        if rank == 0:
            result = await self._results.receive()
            if world == 1:
                if isinstance(result, Exception):
                    raise result
                batch: RolloutBatch = result[0]
                return batch
            # A tag says which: b"E" and an error's text, or b"B" and the batch (rollouts.types.wire,
            # which round-trips exactly: rank 0 keeps its own copy, equal to what the others decode).
            shared = None if isinstance(result, Exception) else _shared(result[0])
            tag, parts = (
                (b"E", [f"{type(result).__name__}: {result}".encode()])
                if shared is None
                else (b"B", await trio.to_thread.run_sync(batch_to_parts, shared))
            )
        else:
            tag, parts, shared = b"", [], None
        tag, received = await trio.to_thread.run_sync(broadcast_tagged, tag, *parts)
        if tag == b"E":
            raise RuntimeError(f"generation on rank 0 failed: {bytes(received).decode()}")
        if shared is not None:
            return shared
        return await trio.to_thread.run_sync(batch_from_bytes, received)


@contextlib.asynccontextmanager
async def engine_alone(engine: Any, lock: trio.Lock, manager: AsyncRolloutManager | None) -> AsyncIterator[None]:
    """The engine to one caller (evaluation, the sync probe): the lock, not mid-sync; with partial
    rollouts (`manager`: the producer generates without the lock) also the manager paused, its
    responses in flight cut short by the engine's abort() (continued afterwards) and the engine
    resumed for the caller, so that no abort (a sync's, a first_n cut) reaches the caller's requests."""
    async with lock:
        if manager is None:
            yield
            return
        abortable = engine if isinstance(engine, Abortable) else None
        async with manager.paused(None if abortable is None else abortable.abort):
            if abortable is not None:
                abortable.resume()
            yield


def direct_loader(
    engine: InferenceEngine | None, components: TrainingComponents, *, shares_model: bool
) -> Callable[[Mapping[str, torch.Tensor], int], Awaitable[None]] | None:
    """The engine's `load_weights`, where a sync can hand it the model's tensors directly: a
    single-process run (under torchrun the weights are gathered by the export) whose engine has
    its own copy of the weights and which syncs full weights (not a LoRA adapter alone)."""
    if not isinstance(engine, WeightLoader) or shares_model or rank_world()[1] > 1 or syncs_adapter(components.model):
        return None
    return engine.load_weights


async def serves_other_weights(engine: InferenceEngine | None, state: TrainingState, *, shares_model: bool) -> bool:
    """Whether a fresh run's engine serves weights other than the run's own: it reports a version, and
    not the run's first (a server started from a model directory reports none until synced: a server
    kept up from another run does; one that cannot say is synced too, and its sync names the failure)."""
    if engine is None or shares_model:
        return False
    try:
        served: object = await engine.weight_version()
    except Exception as exc:  # noqa: BLE001 - the sync that follows names the engine's failure, if it is one
        served = f"unknown ({type(exc).__name__}: {exc})"
    if served is None or served == state.weight_version:
        return False
    log.warning(
        "engine %s serves weight version %s from before this run: this run's initial weights go to it first, "
        "as version %d",
        engine.name,
        served,
        state.weight_version,
    )
    return True


async def sync_engine(
    components: TrainingComponents,
    engine: InferenceEngine | None,
    state: TrainingState,
    run_dir: Path,
    *,
    shares_model: bool,
    lock: trio.Lock,
    version: int | None = None,
    writer: CheckpointWriter | None = None,
    manager: AsyncRolloutManager | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """Export the weights (every rank; not when the engine samples from the training model itself)
    and load them into the engine (rank 0) as `version` (default: the next one). A LoRA model with
    sync 'adapter' exports its adapter alone (engines load it as a runtime LoRA adapter); with
    'merged', the merged full weights. The previous export is deleted on `writer`'s thread if given.
    With `manager` (partial rollouts: the producer generates without the lock), the load runs
    inside `manager.paused`: the engine's abort() cuts the responses in flight short, they come
    back partial, and the manager continues them under the new weights after the load.

    An engine with `load_weights(tensors, version)` (the in-process engine with its own copy, the
    engine process: `direct_loader`) takes the weights straight from the model instead, in a
    single-process run: nothing is exported, and the export directory is not written. So does an
    engine that takes weight buckets (`BucketLoader`: engine.sync = 'broadcast'), from a single
    process's model or a sharded one (not DDP replicas): every rank gathers each bucket as rank 0 sends it (full
    weights: a LoRA model with sync 'adapter' still exports its adapter); `sync_gathered_bytes_max`
    says the most this rank held."""
    version = state.weight_version + 1 if version is None else version
    start = time.perf_counter()
    direct = direct_loader(engine, components, shares_model=shares_model)
    if direct is not None:
        # on the model's device: an engine on the same GPU takes them by CUDA IPC, device to device
        await _load(engine, lock, manager, lambda: direct(model_tensors(components.model, keep_device=True), version))
        return state.with_weight_version(version), {"sync_export_s": 0.0, "sync_s": time.perf_counter() - start}
    bucket_bytes = await _bucket_bytes(engine, components, shares_model=shares_model)
    if bucket_bytes:  # bucket by bucket from the model (a sharded one: gathered as sent), nothing exported
        weights = WeightBuckets(components.model)
        if isinstance(engine, BucketLoader):
            await _load(engine, lock, manager, lambda: engine.push_weights(weights, version))
        else:  # the other ranks: the same gathers, in the same order
            await BroadcastSync(BroadcastOptions(bucket_bytes=bucket_bytes), rank=rank_world()[0]).drain(weights)
        metrics = {"sync_export_s": 0.0, "sync_s": time.perf_counter() - start}
        return state.with_weight_version(version), metrics | {"sync_gathered_bytes_max": float(weights.peak_held_bytes)}
    path = run_dir / WEIGHTS_DIR
    if not shares_model and syncs_adapter(components.model):  # LoRA: the adapter alone, in PEFT's format
        path = run_dir / ADAPTER_DIR
        await trio.to_thread.run_sync(save_adapter, components.model, path)
    elif not shares_model:
        await trio.to_thread.run_sync(lambda: export_weights(components, path, writer=writer))
    export_s = time.perf_counter() - start
    if engine is not None and rank_world()[0] == 0:
        await _load(engine, lock, manager, lambda: engine.update_weights_from_disk(str(path.resolve()), version))
    return state.with_weight_version(version), {"sync_export_s": export_s, "sync_s": time.perf_counter() - start}


async def _bucket_bytes(engine: InferenceEngine | None, components: TrainingComponents, *, shares_model: bool) -> int:
    """Rank 0's engine's bucket size, on every rank, where the weights go to it bucket by bucket
    straight from the model (full weights, an engine that takes buckets; a sharded model's gathered
    as they are sent); else 0."""
    if shares_model or syncs_adapter(components.model):
        return 0  # the same on every rank: no collective needed to agree on it
    if not is_distributed(components.model):  # replicas (DDP) export on every rank, as they agree to
        single = rank_world()[1] == 1
        return engine.bucket_bytes if single and isinstance(engine, BucketLoader) else 0
    own = engine.bucket_bytes if isinstance(engine, BucketLoader) and rank_world()[0] == 0 else 0
    return int(await trio.to_thread.run_sync(broadcast_json, own))


async def _load(
    engine: Any, lock: trio.Lock, manager: AsyncRolloutManager | None, load: Callable[[], Awaitable[None]]
) -> None:
    """`load()` the engine's new weights, never mid-generation: under the lock (the producer holds
    it while generating), and with `manager` (partial rollouts) paused, the responses in flight cut
    short by the engine's abort() and the engine resumed after the load."""
    abortable = engine if isinstance(engine, Abortable) else None
    held: Any = (
        contextlib.nullcontext() if manager is None else manager.paused(None if abortable is None else abortable.abort)
    )
    async with lock, held:
        await load()
        if manager is not None and abortable is not None:
            abortable.resume()


# ---------------------------------------------------------------- verified weight delivery
# After a sync, a probe asks the engine for a few greedy tokens of a fixed prompt and compares the
# log-probs it reports with the trainer's on the new weights. A sync that silently did not apply
# (the engine still serving old weights) shows as a difference and fails the step, naming the
# engine, instead of going unnoticed while training drifts off-policy. The probe runs on every
# rank (under torchrun the trainer's log-probs are a collective): rank 0 generates and broadcasts
# the probe sample.


class SyncProbeError(RuntimeError):
    """The engine's log-probs after a sync differ from the trainer's on the synced weights."""


async def probe_sync(
    components: TrainingComponents,
    engine: InferenceEngine | None,
    prompt: Sequence[int],
    *,
    num_tokens: int,
    tolerance: float,
    weight_version: int,
) -> dict[str, float]:
    """Greedy `num_tokens` from the engine for `prompt`; raise SyncProbeError when the mean |engine -
    trainer| log-prob over them exceeds `tolerance`. Returns {"sync_probe_logprob_diff": ...}."""
    if num_tokens < 1 or not tolerance > 0:
        raise ValueError(f"num_tokens must be >= 1 and tolerance > 0, got {num_tokens}, {tolerance}")
    rank, _ = rank_world()
    payload = None
    if rank == 0:
        assert engine is not None
        params = SamplingParams(max_new_tokens=num_tokens, temperature=0.0, logprobs=True)
        (sample,) = await engine.generate([list(prompt)], params)
        if sample.rollout_logprobs is None:
            raise SyncProbeError(f"engine {engine.name} returned no log-probs for the sync probe")
        payload = {"sample": sample.to_dict(), "engine": engine.name}
    shared: dict[str, Any] = await trio.to_thread.run_sync(broadcast_json, payload)
    sample = Sample.from_dict(shared["sample"])
    if sample.response_length == 0:
        return {"sync_probe_logprob_diff": 0.0}
    budget = len(sample.tokens) + 1
    (trainer_B_T,) = await trio.to_thread.run_sync(
        lambda: compute_logprobs(components, pack_samples([sample], max_tokens=budget))
    )
    trainer = trainer_B_T[0, sample.num_prompt_tokens : len(sample.tokens)]
    engine_lp = np.asarray(sample.rollout_logprobs, dtype=np.float64)
    diff = float(np.mean(np.abs(trainer.astype(np.float64) - engine_lp)))
    if diff > tolerance:
        raise SyncProbeError(
            f"after syncing weight version {weight_version}, engine {shared['engine']} reports log-probs "
            f"{diff:.3g} away from the trainer's on those weights (mean over {sample.response_length} greedy "
            f"tokens; rl.sync_probe_tolerance = {tolerance}): the sync did not apply, or the engine serves "
            "another model or precision"
        )
    return {"sync_probe_logprob_diff": diff}
