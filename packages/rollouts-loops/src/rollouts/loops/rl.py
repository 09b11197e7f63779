"""The RL loop: prompts -> engine samples -> rewards -> group filter -> advantages -> packed
micro-batches -> (old / reference log-probs) -> loss -> optimizer step -> export + engine sync ->
metrics -> checkpoint.

The loop owns no state of its own: TrainingState is threaded through, the DataBuffer and the
AsyncRolloutManager (carry-over cache) are the stateful iterators, and both go into checkpoints.
`rl_minimal.py` beside this file is the same algorithm in a few dozen lines without the plumbing.

Off-policy overlap (config.overlap): step n+1 is generated while step n trains (training runs in a
worker thread). An engine never changes weights mid-generation: a sync waits for the generation in
flight, so a sample is at most `max_staleness` versions behind the weights it trains.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

from rollouts.backends import (
    TrainingComponents,
    compute_logprobs,
    export_weights,
    forward_backward,
    optim_step,
    packed_only,
    save_checkpoint,
)
from rollouts.data import AsyncRolloutManager, DataBuffer, plan_micro_batches, unpack_values
from rollouts.data.filters import check_reward_nonzero_std
from rollouts.loops.distributed import (
    all_gather_arrays,
    broadcast_json,
    global_counts,
    global_sum,
    rank_world,
    same_count_on_every_rank,
)
from rollouts.loops.sft import CHECKPOINTS_DIR, choose_layout, resume_if_possible
from rollouts.losses import (
    group_advantages,
    kl_penalty,
    loss_fn_from_config,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rollouts.types import (
    AlgorithmConfig,
    InferenceEngine,
    MetricsLogger,
    RewardFn,
    RLConfig,
    RolloutBatch,
    Sample,
    SamplingParams,
    Status,
    TrainingState,
)

WEIGHTS_DIR = "weights"
_MAX_EMPTY_BATCHES = 3  # steps in a row with nothing to train on before the loop gives up
PromptEncoder = Callable[[Any], Sequence[int]]
"""Turns a prompt record (from the DataBuffer) into prompt token ids."""


def check_algorithm(algorithm: AlgorithmConfig) -> None:
    """Raise for settings the RL loop cannot run (before any work starts)."""
    if algorithm.advantage_estimator == "gae":
        raise ValueError(
            "AlgorithmConfig.advantage_estimator 'gae' needs a learned value model, which the RL loop does not "
            "train; use 'grpo', 'rloo' or 'reinforce_pp' (or call rollouts.losses.gae_advantages in your own loop)"
        )


# ---------------------------------------------------------------- rollouts


def make_generate_fn(
    engine: InferenceEngine, encode_prompt: PromptEncoder, sampling: SamplingParams, *, answer_key: str = "answer"
) -> Callable[[Any, int], Any]:
    """GenerateFn for the rollout manager: one prompt record -> n Samples carrying the record's metadata."""

    async def generate_group(record: Any, n: int) -> list[Sample]:
        prompt_ids = list(encode_prompt(record))
        samples = await engine.generate([prompt_ids], dataclasses.replace(sampling, n=n))
        metadata = {k: v for k, v in record.items() if k != "prompt"} if isinstance(record, Mapping) else {}
        prompt = record.get("prompt", "") if isinstance(record, Mapping) else str(record)
        return [
            dataclasses.replace(s, prompt=prompt if isinstance(prompt, str) else tuple(prompt),
                                metadata={**s.metadata, **metadata})
            for s in samples
        ]

    return generate_group


def with_overlong_penalty(samples: Sequence[Sample], algorithm: AlgorithmConfig, *, max_new_tokens: int) -> list[Sample]:
    """DAPO soft overlong punishment added to each reward (no-op when overlong_buffer_length is 0)."""
    if algorithm.overlong_buffer_length == 0:
        return list(samples)
    buffer = min(algorithm.overlong_buffer_length, max_new_tokens)
    return [
        s.with_reward(
            (s.reward or 0.0)
            + overlong_penalty(s.response_length, max_length=max_new_tokens, buffer_length=buffer,
                               factor=algorithm.overlong_penalty_factor)
        )
        for s in samples
    ]


# ---------------------------------------------------------------- advantages


def _padded(values: Mapping[int, np.ndarray], num: int) -> torch.Tensor:
    """[N, T_max] float32 tensor of per-sample token arrays (0-padded on the right)."""
    width = max(len(v) for v in values.values())
    out = torch.zeros(num, width)
    for i, v in values.items():
        out[i, : len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out


def token_advantages(
    samples: Sequence[Sample],
    algorithm: AlgorithmConfig,
    *,
    masks: Mapping[int, np.ndarray],
    kl: Mapping[int, np.ndarray] | None = None,
) -> dict[int, np.ndarray]:
    """Sample index -> [T_i] per-token advantages, from rewards (and per-token KL in the reward)."""
    rewards_N = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups_N = torch.tensor([s.group_index if s.group_index is not None else i for i, s in enumerate(samples)])
    lengths = [len(masks[i]) for i in range(len(samples))]
    if algorithm.advantage_estimator == "reinforce_pp":
        mask_N_T = _padded(masks, len(samples))
        kl_N_T = _padded(kl, len(samples)) if kl is not None else None
        adv_N_T = reinforce_pp_advantages(rewards_N, mask_N_T, kl_B_T=kl_N_T, kl_coef=algorithm.kl_coef,
                                          gamma=algorithm.gamma)
        return {i: adv_N_T[i, :n].numpy() for i, n in enumerate(lengths)}
    if kl is not None:  # KL in the reward, at sequence level for the group estimators
        rewards_N = rewards_N - algorithm.kl_coef * torch.tensor(
            [float((kl[i] * (masks[i] > 0)).sum()) for i in range(len(samples))]
        )
    if algorithm.advantage_estimator == "rloo":
        adv_N = rloo_advantages(rewards_N, groups_N)
    else:
        adv_N = group_advantages(rewards_N, groups_N, scale=algorithm.advantage_scale)
    return {i: np.full(n, float(adv_N[i]), dtype=np.float32) for i, n in enumerate(lengths)}


def scatter_token_values(micro_batches: Sequence[dict[str, np.ndarray]], key: str, values: Mapping[int, np.ndarray]) -> None:
    """Write each sample's [T_i] values into the micro-batches' `key` array, where its tokens sit."""
    for mb in micro_batches:
        out = np.zeros(mb["input_ids"].shape, dtype=np.float32)
        for s, index in enumerate(mb["sample_indices"]):
            where = mb["segment_ids"] == s
            out[where] = values[int(index)]
        mb[key] = out


# ---------------------------------------------------------------- one update


def rl_update(
    components: TrainingComponents,
    state: TrainingState,
    samples: Sequence[Sample],
    config: RLConfig,
    *,
    ref_components: TrainingComponents | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """Advantages, log-probs and `num_updates_per_batch` optimizer steps on one batch of samples.

    Under torchrun every rank calls it with the same samples (see `run_rl_training`) and trains its
    share, samples[rank::world]. Log-probs (old, reference) are computed for the share on its rank;
    the advantages, which may need the whole batch (group statistics with KL in the reward,
    REINFORCE++'s batch whitening), come from every rank's per-token masks and KL, gathered as
    tensors, so each rank computes exactly what one process would.
    """
    algorithm = config.algorithm
    rank, world = rank_world()
    if len(samples) < world:
        raise ValueError(f"{len(samples)} samples cannot give each of {world} ranks one")
    local = list(samples[rank::world])
    plan = plan_micro_batches(local, max_tokens=config.max_tokens_per_micro_batch, layout=choose_layout(local, packed_only=packed_only(components.model)))
    real = [dict(mb) for mb in plan.micro_batches]
    mbs = same_count_on_every_rank(real)  # zero-loss fillers past `real` so FSDP's collectives line up
    masks = unpack_values(real, [mb["loss_mask"] for mb in real])
    num_tokens, num_sequences = global_counts(plan.num_loss_tokens, plan.num_sequences)
    metrics: dict[str, float] = {}
    need_old = algorithm.num_updates_per_batch > 1 or algorithm.kl_placement == "reward"
    # The policy trained is the one sampled from: logits / sampling temperature (0 means greedy: 1).
    temperature = config.rollout.sampling.temperature or 1.0
    old = compute_logprobs(components, mbs, temperature=temperature) if need_old else None
    if old is not None and algorithm.num_updates_per_batch > 1:
        for mb, lp in zip(mbs, old, strict=True):
            mb["old_logprobs"] = lp
    kl_local = None
    if algorithm.needs_reference:
        if ref_components is None:
            raise ValueError("the algorithm puts a KL term in the loss or reward but no reference model was given")
        ref = compute_logprobs(ref_components, mbs, temperature=temperature)
        for mb, lp in zip(mbs, ref, strict=True):
            mb["ref_logprobs"] = lp
        if algorithm.kl_placement == "reward":
            assert old is not None
            kl_mbs = [kl_penalty(torch.from_numpy(o), torch.from_numpy(r), kind=algorithm.kl_kind).numpy()
                      for o, r in zip(old[: len(real)], ref[: len(real)], strict=True)]
            kl_local = unpack_values(real, kl_mbs)
    all_masks, all_kl = _whole_batch(masks, kl_local, num_local=len(local))
    if all_kl is not None:
        kl_sum = sum(float((all_kl[i] * (all_masks[i] > 0)).sum()) for i in all_masks)
        metrics["kl_reward"] = kl_sum / max(1, num_tokens)
    advantages = token_advantages(samples, algorithm, masks=all_masks, kl=all_kl)
    scatter_token_values(mbs, "advantages", {i: advantages[rank + i * world] for i in range(len(local))})
    return _updates(components, state, mbs, config, num_tokens=num_tokens, num_sequences=num_sequences,
                    num_samples=len(samples), temperature=temperature, metrics=metrics)


def _whole_batch(
    masks: dict[int, np.ndarray], kl: dict[int, np.ndarray] | None, *, num_local: int
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray] | None]:
    """Per-sample loss masks (and KL) of the whole batch keyed by global index, from each rank's
    share (rank r holds global samples r, r + world, ...). The same dicts in one process."""
    world = rank_world()[1]
    if world == 1:
        return masks, kl
    arrays = [masks[i] for i in range(num_local)] + ([kl[i] for i in range(num_local)] if kl is not None else [])
    all_masks: dict[int, np.ndarray] = {}
    all_kl: dict[int, np.ndarray] | None = {} if kl is not None else None
    for r, theirs in enumerate(all_gather_arrays(arrays)):
        count = len(theirs) // 2 if kl is not None else len(theirs)
        for i in range(count):
            all_masks[r + i * world] = theirs[i]
            if all_kl is not None:
                all_kl[r + i * world] = theirs[count + i]
    return all_masks, all_kl


def _updates(
    components: TrainingComponents, state: TrainingState, mbs: Sequence[dict[str, np.ndarray]], config: RLConfig,
    *, num_tokens: int, num_sequences: int, num_samples: int, temperature: float, metrics: dict[str, float],
) -> tuple[TrainingState, dict[str, float]]:
    """`num_updates_per_batch` forward/backward + optimizer steps on prepared micro-batches (step-wide counts)."""
    loss_fn = loss_fn_from_config(config.algorithm)
    for _ in range(config.algorithm.num_updates_per_batch):
        fb = forward_backward(components, mbs, loss_fn, num_tokens=num_tokens, num_sequences=num_sequences,
                              temperature=temperature)
        fb["loss"] = global_sum(fb["loss"])  # the step's loss over all ranks (itself on one process)
        state, om = optim_step(components, state, config.optimizer, num_tokens=num_tokens,
                               num_samples=num_samples, loss=fb["loss"])
        metrics.update(fb)
        metrics.update(om)
    return state, metrics


# ---------------------------------------------------------------- the loop


def rollout_metrics(batch: RolloutBatch, state: TrainingState) -> dict[str, float]:
    """Reward, length, truncation, staleness and accounting figures of one step's rollouts."""
    samples = batch.samples
    rewards = [s.reward or 0.0 for s in samples]
    lengths = [s.response_length for s in samples]
    staleness = [state.weight_version - s.weight_version for s in samples if s.weight_version is not None]
    meta = batch.metadata
    out = {
        "reward_mean": float(np.mean(rewards)) if rewards else math.nan,
        "reward_std": float(np.std(rewards)) if rewards else math.nan,
        "accuracy": float(np.mean([r > 0 for r in rewards])) if rewards else math.nan,
        "response_length_mean": float(np.mean(lengths)) if lengths else math.nan,
        "response_length_max": float(max(lengths, default=0)),
        "truncated_fraction": float(np.mean([s.status is Status.TRUNCATED for s in samples])) if samples else math.nan,
        "staleness_max": float(max(staleness, default=0)),
        "num_samples": float(len(samples)),
        "num_filtered": float(batch.num_filtered),
        "num_failed": float(batch.num_failed),
        "num_carried_over": float(batch.num_carried_over),
    }
    for key in ("groups_requested", "num_rounds"):
        if key in meta:
            out[key] = float(meta[key])
    return out


class _Pending:
    """The result of a background task, awaited once."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    async def get(self) -> Any:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


def _start(nursery: trio.Nursery, fn: Callable[[], Any]) -> _Pending:
    pending = _Pending()

    async def run() -> None:
        try:
            pending.value = await fn()
        except Exception as e:  # surfaced to whoever awaits it
            pending.error = e
        finally:
            pending.done.set()

    nursery.start_soon(run)
    return pending


async def sync_engine(components: TrainingComponents, engine: InferenceEngine, state: TrainingState,
                      run_dir: Path, *, shares_model: bool) -> tuple[TrainingState, dict[str, float]]:
    """Export the weights (unless the engine samples from the training model) and sync the engine."""
    version = state.weight_version + 1
    start = time.perf_counter()
    path = run_dir / WEIGHTS_DIR
    if not shares_model:
        broadcast_json({"op": "export", "path": str(path)})  # every rank joins the gather
        await trio.to_thread.run_sync(export_weights, components, path)
    export_s = time.perf_counter() - start
    await engine.update_weights_from_disk(str(path), version)
    return state.with_weight_version(version), {"sync_export_s": export_s, "sync_s": time.perf_counter() - start}


def run_rl_training(
    components: TrainingComponents,
    buffer: DataBuffer,
    engine: InferenceEngine,
    config: RLConfig,
    *,
    reward_fn: RewardFn,
    encode_prompt: PromptEncoder,
    logger: MetricsLogger,
    run_dir: str | Path,
    engine_shares_model: bool = False,
    ref_components: TrainingComponents | None = None,
    resume: bool = True,
    tokenizer: Any = None,
    on_step: Callable[[TrainingState, dict[str, float]], None] | None = None,
) -> tuple[TrainingState, list[dict[str, float]]]:
    """Run RL for `config.num_steps` optimizer steps; returns (final state, per-step metrics).

    `engine` is any InferenceEngine (the in-process sampler, a vLLM/SGLang client or a pool).
    `engine_shares_model` says the engine samples from `components.model` itself (then no weight
    export is needed, and overlap is refused since training would change weights mid-generation).
    A reference model for KL is copied from the starting weights when the algorithm needs one
    and none is given.
    """
    check_algorithm(config.algorithm)
    if config.algorithm.loss_aggregation == "seq-mean-token-sum-norm" and config.algorithm.norm_constant is None:
        # Dr.GRPO divides by a constant; the longest possible response keeps it the same in every
        # micro-batch (the padded length would differ between micro-batches and steps).
        algorithm = dataclasses.replace(config.algorithm, norm_constant=float(config.rollout.sampling.max_new_tokens))
        config = dataclasses.replace(config, algorithm=algorithm)
    if config.overlap and engine_shares_model:
        raise ValueError("overlap needs an engine with its own copy of the weights; engine_shares_model=True")
    rank, world = rank_world()
    if world > 1:
        if engine_shares_model:
            raise ValueError("under torchrun the engine needs its own weights (rank 0 samples; the model is sharded)")
        if config.algorithm.needs_reference and ref_components is None:
            raise ValueError("under torchrun a KL term needs ref_components on every rank: the starting model, "
                             "sharded like the trained one (a sharded model cannot be copied here)")
        if rank != 0:
            return _follow(components, config, Path(run_dir), resume=resume, tokenizer=tokenizer,
                           ref_components=ref_components)
    try:
        return trio.run(
            _rl_main, components, buffer, engine, config, reward_fn, encode_prompt, logger, Path(run_dir),
            engine_shares_model, ref_components, resume, tokenizer, on_step,
        )
    except BaseExceptionGroup as group:  # the loop's nursery wraps even a lone error: raise that one
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        if world > 1:
            broadcast_json({"op": "stop"})


def _follow(components: TrainingComponents, config: RLConfig, run_dir: Path, *, resume: bool,
            tokenizer: Any, ref_components: TrainingComponents | None) -> tuple[TrainingState, list[dict[str, float]]]:
    """A rank other than 0 under torchrun: join each collective rank 0 announces, until it stops."""
    state, _, _ = resume_if_possible(components, run_dir, resume=resume)
    while True:
        command = broadcast_json()
        if command["op"] == "update":
            samples = [Sample.from_dict(d) for d in command["samples"]]
            state, _ = rl_update(components, state, samples, config, ref_components=ref_components)
        elif command["op"] == "export":
            export_weights(components, command["path"])
        elif command["op"] == "checkpoint":
            save_checkpoint(components, state, run_dir / CHECKPOINTS_DIR, keep_last=config.checkpoint.keep_last,
                            save_optimizer=config.checkpoint.save_optimizer, tokenizer=tokenizer)
        elif command["op"] == "stop":
            return state, []
        else:
            raise ValueError(f"unknown command from rank 0: {command['op']!r}")


async def _rl_main(components, buffer, engine, config, reward_fn, encode_prompt, logger, run_dir,
                   shares_model, ref_components, resume, tokenizer, on_step):
    updates = config.algorithm.num_updates_per_batch
    if config.algorithm.needs_reference and ref_components is None:
        # The starting weights, copied before a resume loads later ones into `components`.
        ref_components = dataclasses.replace(components, model=copy.deepcopy(components.model).eval())
    state, extra, _ = resume_if_possible(components, run_dir, resume=resume)
    filter_fn = check_reward_nonzero_std() if config.rollout.dynamic_sampling else None
    sampling = dataclasses.replace(config.rollout.sampling, n=config.rollout.samples_per_prompt)
    manager = AsyncRolloutManager(buffer, config.rollout, make_generate_fn(engine, encode_prompt, sampling),
                                  reward_fn=reward_fn, filter_fn=filter_fn)
    if "buffer" in extra:
        buffer.load_state_dict(extra["buffer"])
    if "manager" in extra:
        manager.load_state_dict(extra["manager"])
    if state.step > 0:  # a resumed run: the engine must serve the restored weights
        state, _ = await sync_engine(components, engine, state, run_dir, shares_model=shares_model)
    history: list[dict[str, float]] = []
    total = config.num_steps * updates

    def generate(step: int):
        async def go() -> tuple[RolloutBatch, float]:
            start = time.perf_counter()
            batch = await manager.generate_batch(step=step)
            return batch, time.perf_counter() - start
        return go

    empty_in_a_row = 0
    async with trio.open_nursery() as nursery:
        if "pending_batch" in extra:  # generated before the checkpoint for the step after it
            pending = _Pending()
            pending.value = (RolloutBatch(samples=[Sample.from_dict(d) for d in extra["pending_batch"]],
                                          step=state.step // updates), 0.0)
            pending.done.set()
        else:
            pending = _start(nursery, generate(state.step // updates))
        while state.step < total:
            step_start = time.perf_counter()
            batch, generate_s = await pending.get()
            wait_s = time.perf_counter() - step_start
            pending = None
            next_step = state.step // updates + 1
            if config.overlap and next_step * updates < total:
                pending = _start(nursery, generate(next_step))
            samples = with_overlong_penalty(batch.samples, config.algorithm,
                                            max_new_tokens=config.rollout.sampling.max_new_tokens)
            fresh = [s for s in samples if s.weight_version is None
                     or state.weight_version - s.weight_version <= config.max_staleness]
            metrics = rollout_metrics(batch, state)
            metrics["num_too_stale"] = float(len(samples) - len(fresh))
            empty_in_a_row = 0 if fresh else empty_in_a_row + 1
            if empty_in_a_row > _MAX_EMPTY_BATCHES:
                raise RuntimeError(
                    f"{empty_in_a_row} steps in a row produced no trainable sample (filtered: "
                    f"{dict(batch.filter_reasons)}, failed: {batch.num_failed}, too stale: {len(samples) - len(fresh)})"
                )
            train_start = time.perf_counter()
            if fresh:
                broadcast_json({"op": "update", "samples": [s.to_dict() for s in fresh]})
                state, train_metrics = await trio.to_thread.run_sync(
                    lambda: rl_update(components, state, fresh, config, ref_components=ref_components))
                metrics.update(train_metrics)
            train_s = time.perf_counter() - train_start
            sync_s = 0.0
            if state.step % (config.sync_every_steps * updates) == 0 or state.step >= total:
                if pending is not None:
                    await pending.done.wait()  # never change an engine's weights mid-generation
                state, sync_metrics = await sync_engine(components, engine, state, run_dir, shares_model=shares_model)
                metrics.update(sync_metrics)
                sync_s = sync_metrics["sync_s"]
            if pending is None and state.step < total:
                pending = _start(nursery, generate(state.step // updates))
            metrics.update(
                generate_s=generate_s, generate_wait_s=wait_s, train_s=train_s, sync_s=sync_s,
                step_time_s=time.perf_counter() - step_start, weight_version=float(state.weight_version),
            )
            history.append(metrics)
            if state.step % config.log_every == 0 or state.step >= total:
                logger.log(state.step, metrics)
            if on_step is not None:  # in a worker thread: a callback may block, or run trio itself
                await trio.to_thread.run_sync(on_step, state, metrics)
            ckpt = config.checkpoint
            if (ckpt.every_steps > 0 and state.step % ckpt.every_steps == 0) or state.step >= total:
                extra = {}
                if pending is not None:  # saved with its samples, and with the buffer and carry-over after it
                    await pending.done.wait()
                    if pending.error is None:
                        extra["pending_batch"] = [s.to_dict() for s in pending.value[0].samples]
                extra.update(buffer=buffer.state_dict(), manager=manager.state_dict())
                broadcast_json({"op": "checkpoint"})
                await trio.to_thread.run_sync(lambda: save_checkpoint(
                    components, state, run_dir / CHECKPOINTS_DIR, extra=extra,
                    keep_last=ckpt.keep_last, save_optimizer=ckpt.save_optimizer, tokenizer=tokenizer,
                    wait=state.step >= total))  # earlier ones flush while training goes on
        if pending is not None:
            nursery.cancel_scope.cancel()
    return state, history
