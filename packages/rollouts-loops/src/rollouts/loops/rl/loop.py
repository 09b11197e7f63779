"""The RL loop, SPMD: every rank runs this same loop; the rank that owns the engines (rank 0)
generates, and one broadcast hands each step's batch to the others. Everything after that —
`rl_step`, weight export, checkpoints — is the same call on every rank.

Per step: batch (prompts -> rollout function -> reward -> group filter) -> `rl_step` (overlong
penalty, staleness filter, advantages, packed micro-batches, loss, optimizer step) -> export + engine
sync -> metrics -> checkpoint. `recipes/grpo_minimal.py` is the algorithm without the plumbing.

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from rollouts.backends import CheckpointWriter, TrainingComponents
from rollouts.backends.train.lora import has_lora
from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.loops.evaluation import Evaluation, evaluate_groups, group_metrics
from rollouts.loops.rl.critic import default_critic
from rollouts.loops.rl.generation import BatchSource, engine_alone
from rollouts.loops.rl.kl_control import initial_kl_state, next_kl_state, with_kl_coef
from rollouts.loops.rl.per_token import AdvantageFn
from rollouts.loops.rl.probe import probe_sync
from rollouts.loops.rl.reference import check_reference_update, default_reference, update_reference
from rollouts.loops.rl.state import RLHooks, Run, restore, save_run_checkpoint, sync_run_engine
from rollouts.loops.rl.step import failure_causes, log_completions, rl_step
from rollouts.loops.rollouts.functions import (
    PromptEncoder,
    RolloutContext,
    RolloutFn,
    check_partial_rollouts,
    check_prompt_lengths,
    model_vocab_size,
    single_turn_rollout,
)
from rollouts.loops.rollouts.scoring import Reward, check_reward_errors, summarize
from rollouts.loops.run.distributed import rank_world
from rollouts.loops.run.heap import startup_objects_frozen
from rollouts.loops.run.run_dir import lock_run_dir, sweep_run_dir
from rollouts.losses import KLControllerState, LossFn
from rollouts.types import (
    FilterFn,
    InferenceEngine,
    MetricsLogger,
    RLConfig,
    RolloutBatch,
    TrainingState,
)

_MAX_EMPTY_BATCHES = 3  # steps in a row with nothing to train on before the loop gives up


def _no_progress_error(batch: RolloutBatch, metrics: dict[str, float], empty_in_a_row: int) -> RuntimeError:
    causes = failure_causes(batch)
    return RuntimeError(
        f"{empty_in_a_row} steps in a row produced no trainable sample (filtered: {dict(batch.filter_reasons)}, "
        f"failed: {batch.num_failed}, too stale: {int(metrics['num_too_stale'])})"
        + (f"; causes: {summarize(causes)}" if causes else "")
    )


# ---------------------------------------------------------------- the loop


def run_rl_training(
    components: TrainingComponents,
    buffer: DataBuffer,
    engine: InferenceEngine | None,
    config: RLConfig,
    *,
    reward: Reward | Callable[..., Any],
    encode_prompt: PromptEncoder,
    logger: MetricsLogger,
    run_dir: str | Path,
    rollout: RolloutFn = single_turn_rollout,
    filter_fn: FilterFn | None = None,
    advantage_fn: AdvantageFn | None = None,
    loss_fn: LossFn | None = None,
    engine_shares_model: bool = False,
    ref_components: TrainingComponents | None = None,
    critic_components: TrainingComponents | None = None,
    resume: bool = True,
    resume_from: str | Path | None = None,
    tokenizer: Any = None,
    on_step: Callable[[TrainingState, dict[str, float]], None] | None = None,
    evaluation: Evaluation | None = None,
    num_logged_completions: int = 2,
) -> tuple[TrainingState, list[dict[str, float]]]:
    """Run RL for `config.num_steps` optimizer steps; returns (final state, per-step metrics).

    Call it on every rank (SPMD). `engine` (any InferenceEngine) is used on rank 0 only; other ranks
    may pass None. `reward` is `reward(sample, record) -> float` (sync or async), a batched reward,
    or a `Reward` with its error policy (see rollouts.loops.rollouts.scoring). `engine_shares_model`: the
    engine samples from `components.model` itself (no export; overlap refused). A KL reference is
    copied from the starting weights when the algorithm needs one and none is given. With
    `evaluation`, rank 0 evaluates the engine's weights every `evaluation.every_steps` steps and
    logs eval_reward_mean, eval_pass@1 (and pass@k, maj@k for k > 1) with the step.
    """
    rank, world = rank_world()
    if config.overlap and engine_shares_model:
        raise ValueError("overlap needs an engine with its own copy of the weights; engine_shares_model=True")
    if rank == 0 and engine is None:
        raise ValueError("rank 0 generates: it needs an engine")
    if world > 1 and engine_shares_model:
        raise ValueError("under torchrun the engine needs its own weights (rank 0 samples; the model is sharded)")
    if world > 1 and config.algorithm.needs_reference and ref_components is None and not has_lora(components.model):
        raise ValueError(
            "under torchrun a KL term needs ref_components on every rank: the starting model, "
            "sharded like the trained one (a sharded model cannot be copied here)"
        )
    check_partial_rollouts(config, rollout)
    if config.algorithm.needs_reference and ref_components is None:
        ref_components = default_reference(components)
    check_reference_update(config.reference, components)
    if rank == 0 and rollout is single_turn_rollout:  # every prompt checked before the run, not mid-run
        check_prompt_lengths(
            buffer.prompts,
            encode_prompt,
            max_new_tokens=config.rollout.sampling.max_new_tokens,
            max_context=getattr(getattr(components.model, "config", None), "max_position_embeddings", None),
            max_sample_tokens=config.max_tokens_per_micro_batch,
        )
    hooks = RLHooks(
        reward=Reward.of(reward), rollout=rollout, filter_fn=filter_fn, advantage_fn=advantage_fn, loss_fn=loss_fn
    )
    sampling = dataclasses.replace(config.rollout.sampling, n=config.rollout.samples_per_prompt)
    context = (
        None
        if engine is None
        else RolloutContext(
            engine=engine,
            sampling=sampling,
            encode_prompt=encode_prompt,
            tokenizer=tokenizer,
            vocab_size=model_vocab_size(components.model),
            max_sample_tokens=config.max_tokens_per_micro_batch,
        )
    )
    run = Run(
        components=components,
        ref_components=ref_components,
        critic=critic_components if critic_components is not None else default_critic(components, config, world=world),
        buffer=buffer,
        engine=engine,
        config=config,
        hooks=hooks,
        context=context,
        logger=logger,
        run_dir=Path(run_dir),
        shares_model=engine_shares_model,
        resume=resume,
        resume_from=resume_from,
        tokenizer=tokenizer,
        on_step=on_step,
        evaluation=evaluation,
        num_logged_completions=num_logged_completions,
        probe_prompt=tuple(encode_prompt(buffer.prompts[0])) if config.sync_probe_tokens and rank == 0 else (),
        writer=CheckpointWriter(),
    )
    held = lock_run_dir(run.run_dir) if rank == 0 else contextlib.nullcontext()
    with held:  # one run per directory: another process on it is refused, naming its pid
        if rank == 0:
            sweep_run_dir(run.run_dir)
        try:
            with run.writer, startup_objects_frozen():  # writer closed on every exit path
                return trio.run(_rl_main, run)
        except BaseExceptionGroup as group:  # the loop's nursery wraps even a lone error: raise that one
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


async def _rl_main(run: Run) -> tuple[TrainingState, list[dict[str, float]]]:
    config, updates, lock = run.config, run.config.algorithm.num_updates_per_batch, trio.Lock()
    total = config.num_steps * updates
    state, extra, manager, ahead = await restore(run, lock)
    history: list[dict[str, float]] = []
    empty_in_a_row = 0
    kl_state = initial_kl_state(config, extra)
    pausable = manager if config.rollout.partial else None  # paused for a sync, evaluation or probe
    async with trio.open_nursery() as nursery:
        batches = BatchSource(nursery, manager, lock, ahead, hold_lock=not config.rollout.partial)
        while state.step < total:
            step_start = time.perf_counter()
            batch, wait_s = await batches.next(state.step // updates, state.weight_version)
            if config.overlap and (state.step // updates + 1) * updates < total:
                await batches.request(state.step // updates + 1, _version_after_step(config, state))
            check_reward_errors(batch.samples, run.hooks.reward.on_error)
            log_completions(batch, state.step + 1, run.num_logged_completions)
            step_config = with_kl_coef(config, kl_state)
            state, metrics = await _train(run, state, batch, lock, pausable, step_config)
            metrics["kl_coef"] = step_config.algorithm.kl_coef
            if run.ref_components is not None and metrics["num_trained"]:
                update_reference(run.ref_components, run.components, config.reference, step=state.step // updates)
            kl_state = next_kl_state(kl_state, config, metrics)
            empty_in_a_row = 0 if metrics["num_trained"] else empty_in_a_row + 1
            if empty_in_a_row > _MAX_EMPTY_BATCHES:
                raise _no_progress_error(batch, metrics, empty_in_a_row)
            metrics.update(generate_wait_s=wait_s, step_time_s=time.perf_counter() - step_start)
            history.append(metrics)
            await _after_step(run, state, metrics, manager, batches, lock, kl_state)
        nursery.cancel_scope.cancel()  # the producer waits for requests that will not come
    return state, history


def _version_after_step(config: RLConfig, state: TrainingState) -> int:
    """The weight version the step starting at `state` leaves the engine at (the next batch's, with
    overlap): one more where the step ends with a sync (as `_train` decides)."""
    updates = config.algorithm.num_updates_per_batch
    after = state.step + updates
    syncs = after % (config.sync_every_steps * updates) == 0 or after >= config.num_steps * updates
    return state.weight_version + int(syncs)


async def _train(
    run: Run,
    state: TrainingState,
    batch: RolloutBatch,
    lock: trio.Lock,
    manager: AsyncRolloutManager | None,
    config: RLConfig,
) -> tuple[TrainingState, dict[str, float]]:
    """rl_step in a worker thread (the producer keeps generating), then the sync when it is due.
    `config` is the run's, with this step's KL coefficient; `manager` (partial rollouts) is paused
    for the sync instead of the sync waiting for the generation in flight."""
    updates = config.algorithm.num_updates_per_batch
    start = time.perf_counter()
    state, metrics = await trio.to_thread.run_sync(
        lambda: rl_step(
            run.components,
            state,
            batch,
            config,
            ref_components=run.ref_components,
            critic=run.critic,
            advantage_fn=run.hooks.advantage_fn,
            loss_fn=run.hooks.loss_fn,
        )
    )
    metrics["train_s"] = time.perf_counter() - start
    metrics["sync_s"] = 0.0
    if state.step % (config.sync_every_steps * updates) == 0 or state.step >= config.num_steps * updates:
        state, sync_metrics = await sync_run_engine(run, state, lock, manager=manager)
        metrics.update(sync_metrics)
        if config.sync_probe_tokens:  # the engine serves what was trained, or the step fails naming it
            async with engine_alone(run.engine, lock, manager):
                metrics.update(
                    await probe_sync(
                        run.components,
                        run.engine,
                        run.probe_prompt,
                        num_tokens=config.sync_probe_tokens,
                        tolerance=config.sync_probe_tolerance,
                        weight_version=state.weight_version,
                    )
                )
    metrics["weight_version"] = float(state.weight_version)
    return state, metrics


async def _after_step(
    run: Run,
    state: TrainingState,
    metrics: dict[str, float],
    manager: AsyncRolloutManager | None,
    batches: BatchSource,
    lock: trio.Lock,
    kl_state: KLControllerState | None,
) -> None:
    """Evaluate, log, call on_step, and checkpoint when due (with the batch generated ahead, if any)."""
    config, total = run.config, run.config.num_steps * run.config.algorithm.num_updates_per_batch
    evaluation = run.evaluation
    if (
        evaluation is not None
        and run.context is not None
        and (state.step % evaluation.every_steps == 0 or state.step >= total)
    ):
        start = time.perf_counter()
        async with engine_alone(run.context.engine, lock, manager if config.rollout.partial else None):
            groups = await evaluate_groups(
                run.context.engine, evaluation.records, run.context.encode_prompt, run.hooks.reward, evaluation.sampling
            )
        metrics.update(group_metrics(groups), eval_s=time.perf_counter() - start)
    if state.step % config.log_every == 0 or state.step >= total:
        run.logger.log(state.step, metrics)
    if run.on_step is not None:  # in a worker thread: a callback may block, or run trio itself
        await trio.to_thread.run_sync(run.on_step, state, metrics)
    every = config.checkpoint.every_steps
    if (every > 0 and state.step % every == 0) or state.step >= total:
        await save_run_checkpoint(run, state, manager, batches, kl_state)
