"""The RL loop, SPMD: every rank runs this same loop; the rank that owns the engines (rank 0)
generates, and one broadcast hands each step's batch to the others. Everything after that —
`rl_step`, weight export, checkpoints — is the same call on every rank.

Per step: batch (prompts -> rollout function -> reward -> group filter) -> `rl_step` (overlong
penalty, staleness filter, advantages, packed micro-batches, loss, optimizer updates) -> export +
engine sync -> reference and KL coefficient -> evaluation, metrics -> checkpoint.
`recipes/grpo_minimal.py` is the algorithm without the plumbing.

One unit: `state.step` counts optimizer updates, `config.num_updates` of them in a run, and every
cadence (`due`) is in updates; each batch (`config.num_steps` counts those) makes
`num_updates_per_batch` of them.

Generation is a producer task on rank 0 feeding a memory channel, one batch per request. Without
overlap the next batch is requested after the sync; with `config.overlap` it is requested before
training, so step n+1 generates while step n trains. An engine never changes weights mid-generation:
the sync takes the engine lock the producer holds while generating, so a sample is at most
`max_staleness` versions behind the weights it trains. With `config.rollout.partial` the producer
does not hold the lock: the sync pauses the rollout manager, the engine's abort() cuts the responses
in flight short, and they are continued under the new weights (each token keeps its version; a
sample's version is its oldest token's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from rollouts.backends import CheckpointWriter
from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.loops.engines.rollout_process import RolloutProcess, remote_rollout_manager
from rollouts.loops.evaluation import Evaluation, evaluate_groups, group_metrics
from rollouts.loops.micro_batches import AdvantageFn
from rollouts.loops.rl.generation import BatchSource, engine_alone, probe_sync, sync_engine
from rollouts.loops.rl.models import RLModels, check_models, with_defaults
from rollouts.loops.rl.state import (
    KLController,
    Manager,
    PendingBatch,
    ReferenceAverage,
    RunFiles,
    restore,
    run_parts,
    save,
    update_reference,
)
from rollouts.loops.rl.step import failure_causes, log_completions, rl_step
from rollouts.loops.rollouts.functions import (
    PromptEncoder,
    RolloutContext,
    RolloutFn,
    check_partial_rollouts,
    check_prompt_lengths,
    model_vocab_size,
    rollout_manager,
    single_turn_rollout,
)
from rollouts.loops.rollouts.scoring import Reward, check_reward_errors, summarize
from rollouts.loops.run.distributed import rank_world
from rollouts.loops.run.heap import startup_objects_frozen
from rollouts.loops.run.run_dir import due, lock_run_dir, sweep_run_dir
from rollouts.losses import LossFn
from rollouts.types import FilterFn, MetricsLogger, RLConfig, RolloutBatch, TrainingState

log = logging.getLogger(__name__)

_MAX_EMPTY_BATCHES = 3  # steps in a row with nothing to train on before the loop gives up


@dataclass(frozen=True, slots=True, kw_only=True)
class RLHooks:
    """The loop's plug points besides the reward, each with a built-in default."""

    rollout: RolloutFn = single_turn_rollout
    """One prompt record -> a group of Samples, using any InferenceEngine (multi-turn, tools, ...)."""
    filter_fn: FilterFn | None = None
    """Judges a group: None keeps it, a string is why it was dropped (default: DAPO's non-zero std
    filter when dynamic_sampling is on, else none)."""
    advantage_fn: AdvantageFn | None = None
    """(rewards_N, groups_N) -> advantages_N; default: the configured estimator."""
    loss_fn: LossFn | None = None
    """Per micro-batch loss; default: rollouts.losses.loss_fn_from_config(config.algorithm)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOutputs:
    """Where a run writes and what it reports: its directory (checkpoints, exported weights), the
    metrics, and whether it continues the run the directory holds."""

    run_dir: str | Path
    logger: MetricsLogger
    resume: bool = True
    """Continue from the directory's newest checkpoint, if it has one."""
    resume_from: str | Path | None = None
    """Continue from this checkpoint instead (newer ones are moved aside)."""
    on_step: Callable[[TrainingState, dict[str, float]], None] | None = None
    """Called with the state and metrics after each step (in a worker thread: it may block)."""
    num_logged_completions: int = 2
    """Completions of each step logged at INFO level on rank 0."""


def run_rl_training(
    models: RLModels,
    buffer: DataBuffer,
    config: RLConfig,
    *,
    reward: Reward | Callable[..., Any],
    encode_prompt: PromptEncoder,
    output: RunOutputs,
    hooks: RLHooks | None = None,
    tokenizer: Any = None,
    evaluation: Evaluation | None = None,
) -> tuple[TrainingState, list[dict[str, float]]]:
    """Run RL for `config.num_steps` batches; returns (final state, per-step metrics).

    Call it on every rank (SPMD); `models.engine` is used on rank 0 only. `reward` is
    `reward(sample, record) -> float` (sync or async), a batched reward, or a `Reward` with its
    error policy (see rollouts.loops.rollouts.scoring). A KL reference is copied from the starting
    weights when the algorithm needs one and none is given, a critic built when PPO needs one.
    With `evaluation`, rank 0 evaluates the engine's weights every `evaluation.every_steps` updates
    and logs eval_reward_mean, eval_pass@1 (and pass@k, maj@k for k > 1) with the step.
    """
    hooks = hooks if hooks is not None else RLHooks()
    rank, world = rank_world()
    check_models(models, config, rank=rank, world=world)
    check_partial_rollouts(config, hooks.rollout)
    if rank == 0 and hooks.rollout is single_turn_rollout:  # every prompt checked before the run, not mid-run
        check_prompt_lengths(
            buffer.prompts,
            encode_prompt,
            max_new_tokens=config.rollout.sampling.max_new_tokens,
            max_context=getattr(getattr(models.policy.model, "config", None), "max_position_embeddings", None),
            max_sample_tokens=config.max_tokens_per_micro_batch,
        )
    models = with_defaults(models, config, world=world)
    context = None
    if models.engine is not None:
        context = RolloutContext(
            engine=models.engine,
            sampling=dataclasses.replace(config.rollout.sampling, n=config.rollout.samples_per_prompt),
            encode_prompt=encode_prompt,
            tokenizer=tokenizer,
            vocab_size=model_vocab_size(models.policy.model),
            max_sample_tokens=config.max_tokens_per_micro_batch,
        )
    run_dir = Path(output.run_dir)
    with lock_run_dir(run_dir) if rank == 0 else contextlib.nullcontext():  # another process on it is refused
        if rank == 0:
            sweep_run_dir(run_dir)
        try:
            with CheckpointWriter() as writer, startup_objects_frozen():  # writer closed on every exit path
                files = RunFiles(run_dir=run_dir, writer=writer, tokenizer=tokenizer)
                args = (models, buffer, config, Reward.of(reward), hooks, context, output, files, evaluation)
                return trio.run(_rl_loop, *args)
        except BaseExceptionGroup as group:  # the loop's nursery wraps even a lone error: raise that one
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


async def _rl_loop(
    models: RLModels,
    buffer: DataBuffer,
    config: RLConfig,
    reward: Reward,
    hooks: RLHooks,
    context: RolloutContext | None,
    output: RunOutputs,
    files: RunFiles,
    evaluation: Evaluation | None,
) -> tuple[TrainingState, list[dict[str, float]]]:
    """The run inside trio: restore, then one step per batch until `config.num_updates` updates."""
    lock, updates = trio.Lock(), config.algorithm.num_updates_per_batch
    manager = _manager(buffer, config, reward, hooks, context)
    pending, kl, average = PendingBatch(), KLController(config), ReferenceAverage(models.reference, config.reference)
    parts = run_parts(buffer, manager, pending, kl)
    state = await restore(
        models, parts, config, files, resume=output.resume, resume_from=output.resume_from, lock=lock, average=average
    )
    # paused for a sync, evaluation or probe; partial rollouts keep the manager here (a RolloutProcess refuses them)
    pausable = manager if config.rollout.partial and isinstance(manager, AsyncRolloutManager) else None
    probe_prompt: tuple[int, ...] = ()  # rank 0 generates the probe sample and broadcasts it
    if config.sync_probe_tokens and context is not None and rank_world()[0] == 0:
        probe_prompt = tuple(context.encode_prompt(buffer.prompts[0]))
    history: list[dict[str, float]] = []
    empty_in_a_row = 0
    async with trio.open_nursery() as nursery:
        batches = BatchSource(nursery, manager, lock, pending.batch, hold_lock=not config.rollout.partial)
        while state.step < config.num_updates:
            step_start = time.perf_counter()
            index = state.step // updates  # the batch this step trains: rollouts are drawn per batch
            batch, wait_s = await batches.next(index, state.weight_version)
            if config.overlap and index + 1 < config.num_steps:
                await batches.request(index + 1, _version_after_step(config, state))
            check_reward_errors(batch.samples, reward.on_error)
            log_completions(batch, state.step + 1, output.num_logged_completions, run_dir=files.run_dir)
            step_config = kl.step_config(config)
            state, metrics = await _train(models, state, batch, step_config, hooks)
            state = await _sync_if_due(models, state, config, files, lock, pausable, probe_prompt, metrics)
            metrics["kl_coef"] = step_config.algorithm.kl_coef
            if models.reference is not None and metrics["num_trained"]:  # moved after batch index + 1, 1-based
                update_reference(models.reference, models.policy, config.reference, step=index + 1, average=average)
            kl.observe(config, metrics)
            empty_in_a_row = 0 if metrics["num_trained"] else empty_in_a_row + 1
            if empty_in_a_row > _MAX_EMPTY_BATCHES:
                raise _no_progress_error(batch, metrics, empty_in_a_row)
            metrics.update(generate_wait_s=wait_s, step_time_s=time.perf_counter() - step_start)
            history.append(metrics)
            eval_error: Exception | None = None
            if (
                evaluation is not None
                and context is not None
                and due(state.step, evaluation.every_steps, config.num_updates)
            ):
                eval_error = await _evaluate_into(metrics, state.step, context, evaluation, reward, lock, pausable)
            if due(state.step, config.log_every, config.num_updates):
                output.logger.log(state.step, metrics)
            if output.on_step is not None:  # in a worker thread: a callback may block, or run trio itself
                await trio.to_thread.run_sync(output.on_step, state, metrics)
            if due(state.step, config.checkpoint.every_steps, config.num_updates):
                # the batch generated ahead is saved with it: the buffer and carry-over are already past it
                pending.batch = await batches.wait_ahead() if state.step < config.num_updates else None
                await save(models, parts, state, config, files, average)
            if eval_error is not None and evaluation is not None and evaluation.stop_on_error:
                raise eval_error  # the step's metrics and checkpoint are written: nothing trained is lost
        nursery.cancel_scope.cancel()  # the producer waits for requests that will not come
    return state, history


async def _train(
    models: RLModels, state: TrainingState, batch: RolloutBatch, config: RLConfig, hooks: RLHooks
) -> tuple[TrainingState, dict[str, float]]:
    """`rl_step` in a worker thread, so that rank 0's producer keeps generating meanwhile."""
    start = time.perf_counter()
    train = functools.partial(
        rl_step,
        models.policy,
        state,
        batch,
        config,
        ref_components=models.reference,
        critic=models.critic,
        advantage_fn=hooks.advantage_fn,
        loss_fn=hooks.loss_fn,
    )
    state, metrics = await trio.to_thread.run_sync(train)
    metrics["train_s"] = time.perf_counter() - start
    return state, metrics


def _manager(
    buffer: DataBuffer, config: RLConfig, reward: Reward, hooks: RLHooks, context: RolloutContext | None
) -> Manager | None:
    """Rank 0's rollout manager; None on other ranks."""
    if context is None or rank_world()[0] != 0:
        return None
    args = (buffer, config, hooks.rollout, context, reward, hooks.filter_fn)
    # A RolloutProcess runs the manager in its engine process: the trainer's process receives batches.
    if isinstance(context.engine, RolloutProcess):
        return remote_rollout_manager(context.engine, *args)
    return rollout_manager(*args)


def _version_after_step(config: RLConfig, state: TrainingState) -> int:
    """The weight version the step starting at `state` leaves the engine at (the next batch's, with
    overlap): one more where the step ends with a sync."""
    after = state.step + config.algorithm.num_updates_per_batch
    return state.weight_version + int(_sync_due(config, after))


def _sync_due(config: RLConfig, step: int) -> bool:
    return due(step, config.sync_every_steps * config.algorithm.num_updates_per_batch, config.num_updates)


async def _sync_if_due(
    models: RLModels,
    state: TrainingState,
    config: RLConfig,
    files: RunFiles,
    lock: trio.Lock,
    manager: AsyncRolloutManager | None,
    probe_prompt: tuple[int, ...],
    metrics: dict[str, float],
) -> TrainingState:
    """The engine sync when it is due, its figures (and the probe's) added to `metrics`. `manager`
    (partial rollouts) is paused for the sync instead of the sync waiting for the generation in flight."""
    metrics["sync_s"] = 0.0
    if _sync_due(config, state.step):
        state, sync_metrics = await sync_engine(
            models.policy,
            models.engine,
            state,
            files.run_dir,
            shares_model=bool(models.engine_shares_model),
            lock=lock,
            writer=files.writer,
            manager=manager,
        )
        metrics.update(sync_metrics)
        if config.sync_probe_tokens:  # the engine serves what was trained, or the step fails naming it
            async with engine_alone(models.engine, lock, manager):
                probe = await probe_sync(
                    models.policy,
                    models.engine,
                    probe_prompt,
                    num_tokens=config.sync_probe_tokens,
                    tolerance=config.sync_probe_tolerance,
                    weight_version=state.weight_version,
                )
            metrics.update(probe)
    metrics["weight_version"] = float(state.weight_version)
    return state


async def _evaluate_into(
    metrics: dict[str, float],
    step: int,
    context: RolloutContext,
    evaluation: Evaluation,
    reward: Reward,
    lock: trio.Lock,
    manager: AsyncRolloutManager | None,
) -> Exception | None:
    """The evaluation's metrics added to the step's; a failure is logged and counted (eval_failed)
    instead of thrown before the step's metrics and checkpoint, and returned for the caller to raise
    once those are written, if the user asked to stop on it."""
    try:
        metrics.update(await _evaluate(context, evaluation, reward, lock, manager))
        metrics["eval_failed"] = 0.0
        return None
    except Exception as e:
        log.warning("evaluation failed at step %d: %s: %s", step, type(e).__name__, e)
        metrics["eval_failed"] = 1.0
        return e


async def _evaluate(
    context: RolloutContext,
    evaluation: Evaluation,
    reward: Reward,
    lock: trio.Lock,
    manager: AsyncRolloutManager | None,
) -> dict[str, float]:
    """Rank 0's evaluation of the engine's weights, with the engine to itself."""
    start = time.perf_counter()
    async with engine_alone(context.engine, lock, manager):
        groups = await evaluate_groups(
            context.engine, evaluation.records, context.encode_prompt, reward, evaluation.sampling
        )
    return {**group_metrics(groups, min_reward=evaluation.correct_min_reward), "eval_s": time.perf_counter() - start}


def _no_progress_error(batch: RolloutBatch, metrics: dict[str, float], empty_in_a_row: int) -> RuntimeError:
    causes = failure_causes(batch)
    return RuntimeError(
        f"{empty_in_a_row} steps in a row produced no trainable sample (filtered: {dict(batch.filter_reasons)}, "
        f"failed: {batch.num_failed}, too stale: {int(metrics['num_too_stale'])})"
        + (f"; causes: {summarize(causes)}" if causes else "")
    )
