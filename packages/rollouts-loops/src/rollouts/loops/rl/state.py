"""What one RL run holds, and how it starts from and saves a checkpoint.

`Run` is everything the loop in rl.py uses, fixed for the run's duration. `restore` resumes the
policy (and the critic, the rollout manager with its buffer, and the batch that was generated ahead)
from the run directory, and brings the engine to the restored weights. `save_run_checkpoint` writes
all of that back, on every rank alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from rollouts.backends import CheckpointWriter, TrainingComponents, save_checkpoint
from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.loops.engines.rollout_process import RemoteRolloutManager, RolloutProcess, remote_rollout_manager
from rollouts.loops.evaluation import Evaluation
from rollouts.loops.rl.critic import load_critic, save_critic
from rollouts.loops.rl.generation import BatchSource, shared_metadata, sync_engine
from rollouts.loops.rl.kl_control import KL_CONTROLLER_KEY
from rollouts.loops.rl.per_token import AdvantageFn
from rollouts.loops.rl.reference import saved_models
from rollouts.loops.rollouts.functions import RolloutContext, RolloutFn, rollout_manager, single_turn_rollout
from rollouts.loops.rollouts.scoring import Reward
from rollouts.loops.run.distributed import rank_world
from rollouts.loops.run.run_dir import CHECKPOINTS_DIR, resume_if_possible
from rollouts.losses import KLControllerState, LossFn
from rollouts.types import FilterFn, InferenceEngine, MetricsLogger, RLConfig, RolloutBatch, Sample, TrainingState

__all__ = ["RLHooks", "Run", "restore", "save_run_checkpoint", "sync_run_engine"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RLHooks:
    """The loop's plug points, each with a built-in default."""

    reward: Reward
    rollout: RolloutFn = single_turn_rollout
    filter_fn: FilterFn | None = None
    """Judges a group: None keeps it, a string is why it was dropped (default: DAPO's non-zero std
    filter when dynamic_sampling is on, else none)."""
    advantage_fn: AdvantageFn | None = None
    """(rewards_N, groups_N) -> advantages_N; default: the configured estimator."""
    loss_fn: LossFn | None = None
    """Per micro-batch loss; default: rollouts.losses.loss_fn_from_config(config.algorithm)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """Everything one run of the loop uses, fixed for its duration."""

    components: TrainingComponents
    ref_components: TrainingComponents | None
    critic: TrainingComponents | None
    buffer: DataBuffer
    engine: InferenceEngine | None
    config: RLConfig
    hooks: RLHooks
    context: RolloutContext | None
    logger: MetricsLogger
    run_dir: Path
    shares_model: bool
    resume: bool
    resume_from: str | Path | None
    tokenizer: Any
    on_step: Callable[[TrainingState, dict[str, float]], None] | None
    evaluation: Evaluation | None
    num_logged_completions: int
    probe_prompt: tuple[int, ...]
    writer: CheckpointWriter
    """Finishes checkpoints and deletes old exports off the loop's path; closed when the run ends."""


async def restore(
    run: Run, lock: trio.Lock
) -> tuple[TrainingState, dict[str, Any], AsyncRolloutManager | RemoteRolloutManager | None, RolloutBatch | None]:
    """(state, the checkpoint's extra, rank 0's rollout manager, the batch generated ahead) of a
    resumed run, or of a fresh one; a resumed run's engine then serves the restored weights."""
    state, extra, resumed = resume_if_possible(
        run.components,
        run.run_dir,
        resume=run.resume,
        resume_from=run.resume_from,
        models=saved_models(run.config.reference, run.ref_components),
    )
    if run.critic is not None and resumed is not None:
        load_critic(run.critic, resumed)
    manager = _manager(run, extra)
    ahead = (
        RolloutBatch(
            samples=[Sample.from_dict(d) for d in extra["pending_batch"]],
            step=state.step // run.config.algorithm.num_updates_per_batch,
            metadata=extra.get("pending_batch_metadata", {}),  # its counts, logged with the step that trains it
        )
        if "pending_batch" in extra
        else None
    )
    if state.step > 0:  # a resumed run: the engine serves the restored weights, under their own version
        state, _ = await sync_run_engine(run, state, lock, version=state.weight_version)
    return state, extra, manager, ahead


async def sync_run_engine(
    run: Run,
    state: TrainingState,
    lock: trio.Lock,
    *,
    version: int | None = None,
    manager: AsyncRolloutManager | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """`sync_engine` with the run's model, engine, directory and writer."""
    return await sync_engine(
        run.components,
        run.engine,
        state,
        run.run_dir,
        shares_model=run.shares_model,
        lock=lock,
        version=version,
        writer=run.writer,
        manager=manager,
    )


def _manager(run: Run, extra: dict[str, Any]) -> AsyncRolloutManager | RemoteRolloutManager | None:
    """Rank 0's rollout manager, restored from a checkpoint's extra; None on other ranks."""
    if run.context is None or rank_world()[0] != 0:
        return None
    args = (run.buffer, run.config, run.hooks.rollout, run.context, run.hooks.reward, run.hooks.filter_fn)
    engine = run.context.engine
    # A RolloutProcess runs the manager in its engine process: the trainer's process receives batches.
    manager = remote_rollout_manager(engine, *args) if isinstance(engine, RolloutProcess) else rollout_manager(*args)
    if "buffer" in extra:
        run.buffer.load_state_dict(extra["buffer"])
    if "manager" in extra:
        manager.load_state_dict(extra["manager"])
    return manager


async def save_run_checkpoint(
    run: Run,
    state: TrainingState,
    manager: AsyncRolloutManager | RemoteRolloutManager | None,
    batches: BatchSource,
    kl_state: KLControllerState | None,
) -> None:
    """A checkpoint of the run at `state`: the policy, the critic (written first), and in extra the
    batch generated ahead, the buffer and rollout manager after it, and the KL coefficient."""
    config, ckpt = run.config, run.config.checkpoint
    extra: dict[str, Any] = {}
    ahead = (
        await batches.wait_ahead() if state.step < config.num_steps * config.algorithm.num_updates_per_batch else None
    )
    if ahead is not None:  # saved with its samples and counts, and with the buffer and carry-over after it
        extra["pending_batch"] = [s.to_dict() for s in ahead.samples]
        extra["pending_batch_metadata"] = shared_metadata(ahead)
    if manager is not None:
        extra.update(buffer=run.buffer.state_dict(), manager=manager.state_dict())
    if kl_state is not None:
        extra[KL_CONTROLLER_KEY] = {"coef": kl_state.coef}
    if run.critic is not None:  # first: a published policy step always has its critic
        await trio.to_thread.run_sync(
            lambda: save_critic(run.critic, state, run.run_dir / CHECKPOINTS_DIR, config, writer=run.writer)
        )
    await trio.to_thread.run_sync(
        lambda: save_checkpoint(
            run.components,
            state,
            run.run_dir / CHECKPOINTS_DIR,
            extra=extra,
            keep_last=ckpt.keep_last,
            save_optimizer=ckpt.save_optimizer,
            tokenizer=run.tokenizer,
            writer=run.writer,
            models=saved_models(run.config.reference, run.ref_components),
        )
    )  # flushed while training goes on
