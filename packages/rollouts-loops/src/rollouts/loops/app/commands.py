"""The `rollouts sft`, `rl`, `eval` and `pipeline` commands: a checked config in, a finished run out."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from rollouts.backends import (
    EngineProcessOptions,
    InProcessEngine,
    ProcessEngine,
    latest_checkpoint,
    load_hf_model,
)
from rollouts.backends.train.lora import apply_lora, merged_copy, reference_components
from rollouts.backends.train.value import build_critic
from rollouts.data import DataBuffer, load_conversations, load_prompts, prompt_encoder, tokenize_conversation
from rollouts.loops.app.config import ConfigError, RLRun, SFTRun
from rollouts.loops.app.rl_hooks import check_rollout_process, resolve_hooks
from rollouts.loops.app.run_setup import (
    _config_value,
    answer_fields,
    check_paths,
    default_out_dir,
    load_data,
    local_model,
    preflight,
    prepare_run,
    raise_reported,
    release_run,
    run_components,
    run_loggers,
    run_tokenizer,
    sharded_model,
)
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.engines.remote import remote_engine
from rollouts.loops.engines.rollout_process import RolloutProcess
from rollouts.loops.evaluation import Evaluation, evaluate_groups, group_metrics
from rollouts.loops.rl.distill import Distillation, EngineTeacher
from rollouts.loops.rl.loop import RLHooks, RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.distributed import init_distributed, rank_world
from rollouts.loops.run.run_dir import CHECKPOINTS_DIR
from rollouts.loops.sft import run_sft_training
from rollouts.sync import HTTPOptions, RetryPolicy
from rollouts.types import LoraConfig, TrainingState


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What a finished `sft` or `rl` run leaves: where it is, its final state, and its metrics."""

    command: str
    """'sft' or 'rl'."""
    run_dir: Path
    checkpoints: Path
    """The checkpoint root (`run_dir / "checkpoints"`); its newest complete step is the trained model."""
    state: TrainingState
    history: tuple[dict[str, Any], ...]
    """Every step's logged metrics, in order (of this invocation: a resumed run's earlier steps are in
    its metrics JSONL)."""

    @property
    def metrics(self) -> dict[str, Any]:
        """The last step's metrics ({} when no step ran)."""
        return dict(self.history[-1]) if self.history else {}


def cmd_sft(run: SFTRun, source: str) -> RunResult:
    """Tokenize conversations with the model's chat template and train."""
    run = local_model(run, source)
    check_paths(run, source)

    rank, world = init_distributed()
    conversations = load_data(load_conversations, run.data.train_path)  # bad data refused before the run dir is touched
    tokenizer = preflight(run, source, "sft")
    run, resume = prepare_run(run, "sft", source)
    out = Path(run.run.out_dir)
    try:
        samples = [
            tokenize_conversation(list(c), tokenizer, max_length=run.sft.max_length, train_on=run.sft.train_on)
            for c in conversations
        ]
        components = run_components(run, run.sft.optimizer, run.sft.num_steps)
        logger = run_loggers(run, out, "sft", run.sft.num_steps, rank=rank)
        try:
            state, history = run_sft_training(
                components,
                samples,
                run.sft,
                logger=logger,
                run_dir=out,
                resume=resume,
                resume_from=run.run.resume_from or None,
                tokenizer=tokenizer,
            )
        finally:
            logger.close()
    except (Exception, KeyboardInterrupt) as e:
        raise_reported(e, "sft", source, out)
    finally:
        release_run(out, rank)
    print(f"sft: finished at step {state.step}; checkpoints in {out / CHECKPOINTS_DIR}", file=sys.stderr)
    return RunResult(command="sft", run_dir=out, checkpoints=out / CHECKPOINTS_DIR, state=state, history=tuple(history))


def _rl_engine(run: RLRun, components: Any, tokenizer: Any, *, shares: bool) -> Any:
    """Rank 0's engine (None on other ranks): the in-process sampler, in this process or its own, or
    remote servers."""

    rank, world = rank_world()
    if rank != 0:
        return None
    if run.engine.kind in ("process", "rollout_process"):  # from the run's model; restore() syncs a resumed run
        options = EngineProcessOptions(
            num_threads=run.engine.num_threads,
            device=run.model.device,
            dtype=run.model.dtype,
            attn_implementation=run.model.attn_implementation,
            timeout_s=run.engine.timeout_s,
            attest=run.engine.attest,
            weights_transport=run.engine.weights_transport,
        )
        tokenizer_dir = run.model.tokenizer_path or run.model.path
        if run.engine.kind == "rollout_process":  # the rollout manager runs there too, batching its groups
            return RolloutProcess(
                run.model.path, options, tokenizer_dir=tokenizer_dir, max_prompts_per_call=run.rl.rollout.batch_size
            )
        return CoalescingEngine(
            ProcessEngine(run.model.path, options, tokenizer_dir=tokenizer_dir),
            max_prompts_per_call=run.rl.rollout.batch_size,
        )
    if run.engine.kind != "inprocess":
        return remote_engine(
            run.engine.kind,
            run.engine.urls,
            api_key_env=run.engine.api_key_env,
            http=HTTPOptions(timeout_s=run.engine.timeout_s, retry=RetryPolicy(max_retries=run.engine.max_retries)),
            sync_timeout_s=run.engine.sync_timeout_s,
            sync=run.engine.sync,
            partial=run.rl.rollout.partial,
            attest=run.engine.attest,
            http_wire=run.engine.http_wire,
            broadcast_backend=run.engine.broadcast_backend,
        )
    if shares:
        model = components.model
    elif world == 1 and run.model.lora.enabled and run.model.lora.sync == "merged":
        model = merged_copy(components.model)  # the engine's copy: merged weights, no adapter
    elif world == 1:
        model = copy.deepcopy(components.model)
    else:  # the trained model is sharded: rank 0 samples from a full copy of its own
        model = load_hf_model(run.model.path, device=components.device)
        if run.model.lora.enabled and run.model.lora.sync == "adapter":
            model = apply_lora(model, run.model.lora)
    return CoalescingEngine(
        InProcessEngine(model, shares_training_model=shares, tokenizer=tokenizer),
        max_prompts_per_call=run.rl.rollout.batch_size,
    )


def _distillation(run: RLRun, components: Any, world: int) -> Distillation | None:
    """The [distill] teacher: a frozen HF model beside the policy (sharded like it under torchrun),
    or a vLLM server's prompt log-probs; None when the section names no teacher."""
    spec = run.distill
    if not spec.enabled:
        return None
    teacher: Any
    if spec.url:
        api_key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        if spec.api_key_env and not api_key:
            raise ConfigError(f"distill.api_key_env: {spec.api_key_env} is not set in the environment")
        vocab = _config_value(spec.path, "vocab_size") if spec.path else None
        teacher = EngineTeacher(
            spec.url,
            model=spec.model or None,
            api_key=api_key,
            timeout_s=spec.timeout_s,
            max_retries=spec.max_retries,
            vocab_size=vocab,
        )
    else:
        model = (
            sharded_model(
                dataclasses.replace(run, model=dataclasses.replace(run.model, path=spec.path, lora=LoraConfig())),
                str(components.device),
            )
            if world > 1
            else load_hf_model(spec.path, dtype=getattr(torch, run.model.dtype), device=components.device)
        )
        teacher = dataclasses.replace(components, model=model.eval())  # its optimizer is never stepped
    return Distillation(teacher=teacher, coef=spec.coef, mode=spec.mode, estimate=spec.estimate, beta=spec.beta)


def _evaluation(run: RLRun) -> Any:
    """The run's Evaluation from [eval] and data.eval_path, or None."""

    if run.eval.every_steps == 0:
        return None
    if not run.data.eval_path:
        raise ConfigError("eval.every_steps > 0 needs data.eval_path")
    records = load_data(
        load_prompts, run.data.eval_path, field=run.data.prompt_key, required_fields=answer_fields(run)
    )[: run.data.num_eval]
    if run.data.prompt_key != "prompt":
        records = [{**r, "prompt": r[run.data.prompt_key]} for r in records]
    sampling = dataclasses.replace(
        run.rl.rollout.sampling, n=run.eval.samples_per_prompt, temperature=run.eval.temperature
    )
    return Evaluation(
        records=tuple(records),
        every_steps=run.eval.every_steps,
        sampling=sampling,
        stop_on_error=run.eval.stop_on_error,
        correct_min_reward=run.rl.correct_min_reward,
    )


def cmd_rl(run: RLRun, source: str) -> RunResult:
    """RL from the configured model against the configured engine(s)."""
    run = local_model(run, source)
    check_paths(run, source)

    hooks = resolve_hooks(run, source)
    try:
        evaluation = _evaluation(run)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e
    rank, world = init_distributed()
    records = load_data(
        load_prompts, run.data.train_path, field=run.data.prompt_key, required_fields=answer_fields(run)
    )
    if run.data.prompt_key != "prompt":
        records = [{**r, "prompt": r[run.data.prompt_key]} for r in records]
    check_rollout_process(run, hooks, records, source)  # what crosses to the engine process, before any work
    tokenizer = preflight(run, source, "rl")
    run, resume = prepare_run(run, "rl", source)
    out = Path(run.run.out_dir)
    try:
        components = run_components(run, run.rl.optimizer, run.rl.num_updates)
        shares = run.engine.kind == "inprocess" and not run.rl.overlap and world == 1
        critic = None
        if run.rl.algorithm.advantage_estimator == "gae":  # PPO's critic: from [rl.critic] path or the policy's model
            critic = build_critic(
                run.rl.critic.path or run.model.path,
                run.rl.critic.optimizer,
                num_training_steps=run.rl.num_updates,
                device=components.device,
                shard=world > 1,
                gather_once_per_step=run.model.gather_once_per_step,
            )
        ref_components = None
        if run.rl.algorithm.needs_reference and run.model.lora.enabled:
            ref_components = reference_components(components)  # the base: the adapter switched off
        elif world > 1 and run.rl.algorithm.needs_reference:
            # The starting model, sharded like the trained one (one process copies it itself).
            ref_components = dataclasses.replace(components, model=sharded_model(run, str(components.device)).eval())
        distill = _distillation(run, components, world)
        logger = run_loggers(run, out, "rl", run.rl.num_updates, rank=rank)
        engine = _rl_engine(run, components, tokenizer, shares=shares)
        try:
            state, history = run_rl_training(
                RLModels(
                    policy=components,
                    engine=engine,
                    engine_shares_model=shares,
                    reference=ref_components,
                    critic=critic,
                    distill=distill,
                ),
                DataBuffer(records, seed=run.rl.seed),
                run.rl,
                reward=hooks.pop("reward"),
                encode_prompt=prompt_encoder(tokenizer),
                output=RunOutputs(
                    run_dir=out,
                    logger=logger,
                    resume=resume,
                    resume_from=run.run.resume_from or None,
                    num_logged_completions=run.log.num_sample_completions,
                ),
                hooks=RLHooks(**hooks),
                tokenizer=tokenizer,
                evaluation=evaluation,
            )
        finally:
            logger.close()
            if callable(close := getattr(engine, "close", None)):  # an engine process is reaped
                close()
    except (Exception, KeyboardInterrupt) as e:
        raise_reported(e, "rl", source, out)
    finally:
        release_run(out, rank)
    print(
        f"rl: finished at step {state.step}, weight version {state.weight_version}; "
        f"checkpoints in {out / CHECKPOINTS_DIR}",
        file=sys.stderr,
    )
    return RunResult(command="rl", run_dir=out, checkpoints=out / CHECKPOINTS_DIR, state=state, history=tuple(history))


def cmd_eval(run: RLRun, source: str, checkpoint: str) -> dict[str, float]:
    """Evaluate a saved model on data.eval_path with [eval] and [reward]; prints and returns the metrics."""

    if not (Path(checkpoint) / "config.json").is_file():
        raise ConfigError(f"--checkpoint {checkpoint!r} must be an HF-format model directory (config.json)")
    run = dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, path=checkpoint),
        eval=dataclasses.replace(run.eval, every_steps=max(1, run.eval.every_steps)),
    )
    check_paths(run, source)
    evaluation = _evaluation(run)
    reward = resolve_hooks(run, source)["reward"]
    tokenizer = run_tokenizer(run)
    engine = InProcessEngine(load_hf_model(checkpoint, device=run.model.device), tokenizer=tokenizer)
    groups = trio.run(
        evaluate_groups, engine, evaluation.records, prompt_encoder(tokenizer), reward, evaluation.sampling
    )
    metrics = {**group_metrics(groups, min_reward=evaluation.correct_min_reward), "num_eval": float(len(groups))}
    print(json.dumps(metrics))
    return metrics


def cmd_pipeline(sft: SFTRun, sft_source: str, rl: RLRun, rl_source: str) -> RunResult:
    """SFT, then RL from SFT's newest checkpoint; both configs checked before any work. Returns RL's result."""

    check_paths(rl, rl_source, model=False)  # the RL stage starts from what SFT will write
    init_distributed()
    if not sft.run.out_dir or not rl.run.out_dir:  # each stage its own directory under one root
        root = default_out_dir("pipeline")
        sft = dataclasses.replace(sft, run=dataclasses.replace(sft.run, out_dir=sft.run.out_dir or f"{root}/sft"))
        rl = dataclasses.replace(rl, run=dataclasses.replace(rl.run, out_dir=rl.run.out_dir or f"{root}/rl"))
    checkpoint = latest_checkpoint(cmd_sft(sft, sft_source).checkpoints)
    if checkpoint is None:
        raise ConfigError(f"{sft_source}: SFT wrote no complete checkpoint to start RL from")
    checkpoint = checkpoint.absolute()  # recorded in RL's resolved config: where its weights came from
    rl = dataclasses.replace(
        rl,
        model=dataclasses.replace(
            rl.model, path=str(checkpoint), tokenizer_path=rl.model.tokenizer_path or str(checkpoint)
        ),
    )
    return cmd_rl(rl, rl_source)
