"""The offline preference loop: pairs -> micro-batches that keep each pair together -> forward_backward
with the preference loss -> optim_step -> log -> evaluate -> checkpoint.

The reference log-probs of every pair (training and held-out) are computed once, from the starting
weights, before any checkpoint is loaded, and kept in the run directory (`reference_logps.json`), so
a resumed run reads them instead of recomputing them; the reference-free losses (SimPO, ORPO) compute
none. As in SFT, the loop owns no state: the TrainingState is threaded through, and the DataBuffer
over pair indices is the one part of the run's saved state besides the model.

Held-out evaluation: `eval_preference_accuracy` is the fraction of pairs whose implicit reward margin
is positive, a tie counted half (at the start, where policy and reference are one model, every
margin is 0: 50%); the loss's own metrics follow with an `eval_` prefix (TRL's rewards/accuracies
counts a tie as wrong).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollouts.backends import CheckpointWriter, TrainingComponents, forward_backward, optim_step, save_checkpoint
from rollouts.data import DataBuffer
from rollouts.loops.dpo.batches import Pair, PreferenceLossFn, plan_pair_shard, sequence_logps_of
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
from rollouts.losses import PairLogps, metrics_to_floats, preference_loss
from rollouts.types import DPOConfig, MetricsLogger, PreferenceConfig, TrainingState

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class PreferenceData:
    """Tokenized pairs for training and (optionally) held-out evaluation."""

    train: tuple[Pair, ...]
    eval: tuple[Pair, ...] = ()


def pairs_fingerprint(pairs: Sequence[Pair]) -> str:
    """Identity of tokenized pairs: their tokens and loss masks, in order."""
    digest = hashlib.sha256()
    for pair in pairs:
        for s in pair:
            digest.update(np.asarray(list(s.tokens), dtype=np.int64).tobytes())
            digest.update(np.asarray(list(s.loss_mask), dtype=np.float32).tobytes())
    return digest.hexdigest()


def _read_cache(path: Path, fingerprints: dict[str, str]) -> dict[str, np.ndarray] | None:
    """The cached reference log-probs, or None when absent or made for other pairs."""
    if not path.is_file():
        return None
    cached = json.loads(path.read_text(encoding="utf-8"))
    if cached.get("fingerprints") != fingerprints:
        log.warning("%s was computed for other pairs: computing the reference log-probs again", path)
        return None
    return {k: np.asarray(v, dtype=np.float64) for k, v in cached["logps"].items()}


def reference_logps(
    components: TrainingComponents, data: PreferenceData, *, max_tokens: int, run_dir: str | Path | None
) -> dict[str, np.ndarray]:
    """{"train": [2P], "eval": [2Q]} summed reference log-probs under the model as it is now (the
    starting weights), read from run_dir's cache when it holds them for these pairs."""
    fingerprints = {name: pairs_fingerprint(getattr(data, name)) for name in ("train", "eval")}
    path = None if run_dir is None else Path(run_dir) / REFERENCE_FILE
    cached = None if path is None else _read_cache(path, fingerprints)
    if cached is not None:
        return cached
    start = time.perf_counter()
    out = {name: sequence_logps_of(components, getattr(data, name), max_tokens=max_tokens)[0] for name in fingerprints}
    log.info("reference log-probs of %d pairs in %.1f s", len(data.train) + len(data.eval), time.perf_counter() - start)
    if path is not None and rank_world()[0] == 0:
        body = {"fingerprints": fingerprints, "logps": {k: v.tolist() for k, v in out.items()}}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body), encoding="utf-8")  # floats round-trip exactly through JSON
        os.replace(tmp, path)  # never a half-written cache
    return out


def _pair_logps(logps_N: np.ndarray, tokens_N: np.ndarray, ref_N: np.ndarray | None) -> PairLogps:
    t = torch.as_tensor
    refs = {} if ref_N is None else {"ref_chosen_P": t(ref_N[0::2]), "ref_rejected_P": t(ref_N[1::2])}
    return PairLogps(
        chosen_P=t(logps_N[0::2]),
        rejected_P=t(logps_N[1::2]),
        chosen_tokens_P=t(tokens_N[0::2]),
        rejected_tokens_P=t(tokens_N[1::2]),
        **refs,
    )


def reward_margins(logps: PairLogps, config: PreferenceConfig) -> torch.Tensor:
    """[P] implicit reward margins, chosen minus rejected: beta times the log-ratio difference, or for
    the reference-free losses beta times the per-token mean log-prob difference."""
    if not config.needs_reference:
        chosen = logps.chosen_P / logps.chosen_tokens_P.clamp(min=1.0)
        return config.beta * (chosen - logps.rejected_P / logps.rejected_tokens_P.clamp(min=1.0))
    assert logps.ref_chosen_P is not None and logps.ref_rejected_P is not None
    return config.beta * ((logps.chosen_P - logps.ref_chosen_P) - (logps.rejected_P - logps.ref_rejected_P))


def evaluate_pairs(
    components: TrainingComponents, pairs: Sequence[Pair], ref_N: np.ndarray | None, config: DPOConfig
) -> dict[str, float]:
    """Held-out metrics: eval_preference_accuracy (ties half) and the loss's metrics, `eval_`-prefixed."""
    logps_N, tokens_N = sequence_logps_of(components, pairs, max_tokens=config.max_tokens_per_micro_batch)
    logps = _pair_logps(logps_N, tokens_N, ref_N)
    margins_P = reward_margins(logps, config.preference)
    accuracy = float((margins_P > 0).double().mean() + 0.5 * (margins_P == 0).double().mean())
    loss, metrics = preference_loss(logps, config.preference)
    return {"eval_preference_accuracy": accuracy, "eval_loss": float(loss)} | {
        f"eval_{k}": v for k, v in metrics_to_floats(metrics).items()
    }


def dpo_step(
    components: TrainingComponents,
    state: TrainingState,
    pairs: Sequence[Pair],
    ref_N: np.ndarray | None,
    config: DPOConfig,
) -> tuple[TrainingState, dict[str, float]]:
    """One optimizer step on `pairs`; `ref_N` [2P] their reference log-probs (sample 2k chosen, 2k + 1
    rejected; None for SimPO and ORPO). Returns the new state and the step's metrics."""
    shard = plan_pair_shard(components, pairs, max_tokens=config.max_tokens_per_micro_batch)
    loss_fn = PreferenceLossFn(
        config=config.preference,
        ref_logps_N=None if ref_N is None else torch.as_tensor(ref_N),
        num_pairs=shard.num_pairs,
        num_chosen_tokens=shard.num_chosen_tokens,
    )
    # The loss divides by its own pair counts; these two only satisfy forward_backward's checks.
    metrics = forward_backward(
        components,
        list(shard.micro_batches),
        loss_fn,
        num_tokens=shard.num_chosen_tokens,
        num_sequences=shard.num_pairs,
    )
    loss = global_sum(metrics["loss"])
    num_tokens = int(sum(len(s.tokens) for pair in pairs for s in pair))
    state, step_metrics = optim_step(
        components, state, config.optimizer, num_tokens=num_tokens, num_samples=2 * len(pairs), loss=loss
    )
    metrics["loss"] = loss
    return state, {**metrics, **step_metrics, "num_pairs": float(shard.num_pairs)}


def _step_refs(ref_N: np.ndarray | None, ids: Sequence[int]) -> np.ndarray | None:
    """[2B] the reference log-probs of the step's pairs `ids` (dataset indices), in step order."""
    if ref_N is None:
        return None
    return np.stack([ref_N[2 * np.asarray(ids)], ref_N[2 * np.asarray(ids) + 1]], axis=1).reshape(-1)


def run_dpo_training(
    components: TrainingComponents,
    data: PreferenceData,
    config: DPOConfig,
    *,
    logger: MetricsLogger,
    run_dir: str | Path | None = None,
    resume: bool = True,
    resume_from: str | Path | None = None,
    tokenizer: Any = None,
) -> tuple[TrainingState, list[dict[str, float]]]:
    """Train `config.num_steps` preference steps; returns (final state, per-step metrics).

    `components` must hold the starting weights: the reference log-probs come from them (or from
    run_dir's cache) before a checkpoint is resumed. With `run_dir`, checkpoints go to
    run_dir/checkpoints as in SFT and a rerun resumes from the newest, exactly.
    """
    if not data.train:
        raise ValueError("no preference pairs to train on: the data is empty")
    held = lock_run_dir(run_dir) if run_dir is not None and rank_world()[0] == 0 else contextlib.nullcontext()
    with held:  # one run per directory: another process on it is refused, naming its pid
        if run_dir is not None and rank_world()[0] == 0:
            sweep_run_dir(run_dir)
        refs: dict[str, np.ndarray | None] = {"train": None, "eval": None}
        if config.preference.needs_reference:
            max_tokens = config.max_tokens_per_micro_batch
            refs = {**reference_logps(components, data, max_tokens=max_tokens, run_dir=run_dir)}
        with CheckpointWriter() as writer, startup_objects_frozen():
            state, extra, _ = resume_if_possible(components, run_dir, resume=resume, resume_from=resume_from)
            buffer = DataBuffer(list(range(len(data.train))), seed=config.seed)
            parts: dict[str, Stateful] = {"buffer": buffer}
            load_parts(parts, extra)
            history: list[dict[str, float]] = []
            while state.step < config.num_steps:
                start = time.perf_counter()
                ids = buffer.get_prompts(config.batch_size)
                pairs = [data.train[i] for i in ids]
                state, metrics = dpo_step(components, state, pairs, _step_refs(refs["train"], ids), config)
                metrics.update(epoch=float(buffer.epoch_id), step_time_s=time.perf_counter() - start)
                if (
                    data.eval
                    and config.eval_every_steps > 0
                    and due(state.step, config.eval_every_steps, config.num_steps)
                ):
                    metrics |= evaluate_pairs(components, data.eval, refs["eval"], config)
                history.append(metrics)
                if due(state.step, config.log_every, config.num_steps):
                    logger.log(state.step, metrics)
                if run_dir is not None and due(state.step, config.checkpoint.every_steps, config.num_steps):
                    save_checkpoint(
                        components,
                        state,
                        Path(run_dir) / CHECKPOINTS_DIR,
                        extra=parts_state(parts),
                        keep_last=config.checkpoint.keep_last,
                        save_optimizer=config.checkpoint.save_optimizer,
                        tokenizer=tokenizer,
                        writer=writer,
                    )
            return state, history
