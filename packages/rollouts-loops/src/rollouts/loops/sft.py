"""The SFT loop: packed micro-batches -> forward_backward -> optim_step -> log -> checkpoint.

The loop owns no state: the TrainingState is threaded through and returned, the DataBuffer is the
one stateful iterator, and the one part of the run's saved state besides the model ("buffer" in
each checkpoint's extra), so a resumed run continues from the newest complete checkpoint exactly
where the killed one was.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollouts.backends import CheckpointWriter, TrainingComponents, forward_backward, optim_step, save_checkpoint
from rollouts.data import DataBuffer
from rollouts.loops.micro_batches import plan_shard
from rollouts.loops.run.distributed import global_sum, rank_world
from rollouts.loops.run.heap import startup_objects_frozen
from rollouts.loops.run.run_dir import (
    CHECKPOINTS_DIR,
    Stateful,
    due,
    load_parts,
    lock_run_dir,
    parts_state,
    resume_if_possible,
    sweep_run_dir,
)
from rollouts.losses import sft_loss_fn
from rollouts.types import MetricsLogger, Sample, SFTConfig, TrainingState

log = logging.getLogger(__name__)


def sft_step(
    components: TrainingComponents, state: TrainingState, samples: Sequence[Sample], config: SFTConfig
) -> tuple[TrainingState, dict[str, float]]:
    """One optimizer step of SFT on `samples`; returns the new state and the step's metrics."""
    shard = plan_shard(
        components, samples, max_tokens_per_micro_batch=config.max_tokens_per_micro_batch, what="batch_size"
    )
    num_tokens, num_sequences = shard.num_tokens, shard.num_sequences
    # Dr.GRPO-style normalization divides by a constant; the longest possible sample keeps it the
    # same in every micro-batch (each one's padded length would make the gradient split-dependent).
    norm = float(config.max_length) if config.loss_aggregation == "seq-mean-token-sum-norm" else None
    loss_fn = sft_loss_fn(mode=config.loss_aggregation, norm_constant=norm)
    metrics = forward_backward(
        components, list(shard.micro_batches), loss_fn, num_tokens=num_tokens, num_sequences=num_sequences
    )
    loss = global_sum(metrics["loss"])
    state, step_metrics = optim_step(
        components,
        state,
        config.optimizer,
        num_tokens=num_tokens,
        num_samples=len(samples),
        loss=loss,
    )
    metrics["loss"] = loss
    return state, {**metrics, **step_metrics, "num_truncated": float(sum(s.status == "truncated" for s in samples))}


def check_trainable(samples: Sequence[Sample], *, max_length: int) -> None:
    """Refuse data with no loss token at all (a run would train nothing and exit as if it had), and
    log how many samples have none (truncated before their first assistant token, usually)."""
    if not samples:
        raise ValueError("no SFT samples: the data is empty")
    empty = [i for i, s in enumerate(samples) if not s.has_loss_tokens]
    if len(empty) == len(samples):
        raise ValueError(
            f"none of the {len(samples)} samples has a token to learn from (loss_mask is all 0): cut at "
            f"sft.max_length={max_length} tokens, every sample ends before its first assistant token; "
            "raise sft.max_length, or check sft.train_on"
        )
    if empty:
        log.warning(
            "%d of %d samples have no token to learn from (e.g. sample %d): they only dilute the batches",
            len(empty),
            len(samples),
            empty[0],
        )


def run_sft_training(
    components: TrainingComponents,
    data: Sequence[Sample] | DataBuffer,
    config: SFTConfig,
    *,
    logger: MetricsLogger,
    run_dir: str | Path | None = None,
    resume: bool = True,
    resume_from: str | Path | None = None,
    tokenizer: Any = None,
) -> tuple[TrainingState, list[dict[str, float]]]:
    """Train `config.num_steps` SFT steps on tokenized samples; returns (final state, per-step metrics).

    With `run_dir`, checkpoints (weights, optimizer, RNG, buffer position) go to run_dir/checkpoints
    every `config.checkpoint.every_steps` steps and at the end, and a rerun resumes from the newest.
    """
    buffer = data if isinstance(data, DataBuffer) else DataBuffer(list(data), seed=config.seed)
    check_trainable(buffer.prompts, max_length=config.max_length)
    held = lock_run_dir(run_dir) if run_dir is not None and rank_world()[0] == 0 else contextlib.nullcontext()
    with held:  # one run per directory: another process on it is refused, naming its pid
        if run_dir is not None and rank_world()[0] == 0:
            sweep_run_dir(run_dir)
        # the writer is closed on every exit path: the last checkpoint is published
        with CheckpointWriter() as writer, startup_objects_frozen():
            return _sft_loop(
                components,
                buffer,
                config,
                logger=logger,
                run_dir=run_dir,
                resume=resume,
                resume_from=resume_from,
                tokenizer=tokenizer,
                writer=writer,
            )


def _sft_loop(
    components: TrainingComponents,
    buffer: DataBuffer,
    config: SFTConfig,
    *,
    logger: MetricsLogger,
    run_dir: str | Path | None,
    resume: bool,
    resume_from: str | Path | None,
    tokenizer: Any,
    writer: CheckpointWriter,
) -> tuple[TrainingState, list[dict[str, float]]]:
    parts: dict[str, Stateful] = {"buffer": buffer}
    state, extra, _ = resume_if_possible(components, run_dir, resume=resume, resume_from=resume_from)
    load_parts(parts, extra)
    history: list[dict[str, float]] = []
    ckpt = config.checkpoint
    while state.step < config.num_steps:
        start = time.perf_counter()
        samples = buffer.get_prompts(config.batch_size)
        state, metrics = sft_step(components, state, samples, config)
        metrics.update(epoch=float(buffer.epoch_id), step_time_s=time.perf_counter() - start)
        history.append(metrics)
        if due(state.step, config.log_every, config.num_steps):
            logger.log(state.step, metrics)
        if run_dir is not None and due(state.step, ckpt.every_steps, config.num_steps):
            save_checkpoint(
                components,
                state,
                Path(run_dir) / CHECKPOINTS_DIR,
                extra=parts_state(parts),
                keep_last=ckpt.keep_last,
                save_optimizer=ckpt.save_optimizer,
                tokenizer=tokenizer,
                writer=writer,  # flushed while training goes on
            )
    return state, history
