"""Building a run from its checked config: the run directory (resolved config, lock, resume verdict),
the model, optimizer and tokenizer (sharded under torchrun), the data loaders' errors as config errors,
and the metrics loggers. The commands in `commands.py` are made of these.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import torch

from rollouts.backends import (
    TrainingComponents,
    build_components,
    build_optimizer,
    build_scheduler,
    latest_checkpoint,
    load_hf_model,
    load_tokenizer,
    resolve_model_dir,
    shard_model,
)
from rollouts.backends.train.distributed import enable_activation_checkpointing
from rollouts.backends.train.lora import apply_lora, check_lora_targets
from rollouts.backends.train.regional_compile import compile_layers
from rollouts.loops.app.config import ConfigError
from rollouts.loops.app.failures import RunFailed, RunState, report
from rollouts.loops.app.toml_out import to_toml
from rollouts.loops.errors import DamagedCheckpointError
from rollouts.loops.run.distributed import broadcast_json, init_distributed, rank_world
from rollouts.loops.run.loggers import (
    ConsoleLogger,
    JsonlLogger,
    MultiLogger,
    NullLogger,
    TensorboardLogger,
    WandbLogger,
)
from rollouts.loops.run.run_dir import (
    CHECKPOINTS_DIR,
    RunDirInUse,
    acquire_run_dir,
    check_resume,
    file_fingerprint,
    release_run_dir,
)
from rollouts.types import MetricsLogger, OptimizerConfig

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
log = logging.getLogger(__name__)


def write_resolved(run: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "resolved_config.toml").write_text(to_toml(run))
    (out / "resolved_config.json").write_text(json.dumps(dataclasses.asdict(run), indent=2) + "\n")


def default_out_dir(command: str) -> str:
    """runs/<command>-<date>-<time>, the same on every rank (rank 0's clock, broadcast)."""
    name = str(Path(f"runs/{command}-{datetime.now():%Y%m%d-%H%M%S}").absolute()) if rank_world()[0] == 0 else None
    shared: str = broadcast_json(name)
    return shared


def model_fingerprint(path: str) -> str:
    """Cheap identity of a model directory: its JSON files' bytes, its weight files' names and sizes."""
    digest = hashlib.sha256()
    for p in sorted(Path(path).iterdir()):
        if p.suffix == ".json" and p.name != "state.json":
            digest.update(p.name.encode() + p.read_bytes())
        elif p.suffix == ".safetensors":
            digest.update(f"{p.name}:{p.stat().st_size}".encode())
    return digest.hexdigest()


def prepare_run(run: Any, command: str, source: str) -> tuple[Any, bool]:
    """The run with its out_dir decided, and whether it resumes (announced); a refused resume is a ConfigError."""
    run = dataclasses.replace(
        run, run=dataclasses.replace(run.run, out_dir=run.run.out_dir or default_out_dir(command))
    )
    out = Path(run.run.out_dir)
    verdict: dict[str, Any] | None = None
    if rank_world()[0] == 0:  # held until the command ends (release_run_dir); refused if another run has it
        try:
            acquire_run_dir(out)
            inputs = {"model": model_fingerprint(run.model.path), "train_data": file_fingerprint(run.data.train_path)}
            identity = {"config": {k: v for k, v in dataclasses.asdict(run).items() if k != "run"}, "inputs": inputs}
            resumes = check_resume(
                out,
                identity,
                mode="must" if run.run.resume_from else run.run.resume,
                check_newest=not run.run.resume_from,
            )
            verdict = {"resume": resumes}
        except (ValueError, RunDirInUse) as e:
            verdict = {"error": f"{source}: {e}", "locked": not isinstance(e, RunDirInUse)}
    verdict = broadcast_json(verdict)
    if "error" in verdict:
        if verdict.get("locked") and rank_world()[0] == 0:
            release_run_dir(out)
        raise ConfigError(verdict["error"])
    if rank_world()[0] == 0:
        write_resolved(run, out)
        print(f"{command}: {'resuming the run in' if verdict['resume'] else 'new run in'} {out}", file=sys.stderr)
    return run, bool(verdict["resume"])


def run_state(command: str, source: str, out: Path) -> RunState:
    """Where the run in `out` stands: its newest checkpoint and the last step it logged."""
    step = None
    metrics = out / f"metrics_{command}.jsonl"
    if metrics.is_file():
        lines = metrics.read_text(encoding="utf-8").splitlines()
        try:
            step = int(json.loads(lines[-1])["step"]) if lines else None
        except (ValueError, KeyError, TypeError):  # a line cut by the failure itself
            step = None
    return RunState(
        command=command, source=source, out_dir=out, checkpoint=latest_checkpoint(out / CHECKPOINTS_DIR), step=step
    )


def raise_reported(error: BaseException, command: str, source: str, out: Path) -> NoReturn:
    """Raise a run-time failure or interrupt of the command's run in `out` as one paragraph
    (RunFailed), its traceback appended to the run directory's error.log; config errors as they are."""
    if isinstance(error, ConfigError | DamagedCheckpointError | RunFailed):
        raise error
    raise report(error, run_state(command, source, out)) from error


def load_data(loader: Any, *args: Any, **kwargs: Any) -> Any:
    """A data loader's result; its ValueError (naming file, line and field) becomes a ConfigError."""
    try:
        return loader(*args, **kwargs)
    except ValueError as e:
        raise ConfigError(f"data error: {e}") from e


def answer_fields(run: Any) -> tuple[str, ...]:
    """Fields every prompt record needs for the configured reward: the built-in graders read the
    answer (checked for every record at load time, not when a record's turn comes mid-run)."""
    return (run.data.answer_key,) if run.reward.fn in ("math_answer", "exact_match") else ()


def release_run(out: Path, rank: int) -> None:
    """Rank 0 gives up the run directory's lock (taken in prepare_run)."""
    if rank == 0:
        release_run_dir(out)


def check_paths(run: Any, source: str, *, model: bool = True) -> None:
    """File-system checks that belong to config validation: fail before loading anything big.

    `model=False` skips model.path (a pipeline's RL stage starts from what SFT will write).
    """
    if model and (not run.model.path or not (Path(run.model.path) / "config.json").is_file()):
        raise ConfigError(
            f"{source}: model.path {run.model.path!r} must be a local HF-format model directory (config.json)"
        )
    if not run.data.train_path or not Path(run.data.train_path).is_file():
        raise ConfigError(f"{source}: data.train_path {run.data.train_path!r} must be an existing JSONL/JSON file")
    if run.data.eval_path and not Path(run.data.eval_path).is_file():
        raise ConfigError(f"{source}: data.eval_path {run.data.eval_path!r} does not exist")


def preflight(run: Any, source: str, command: str) -> Any:
    """The run's tokenizer, after the checks that need the model's files but not its weights, so
    they fail before the run directory is written: LoRA targets and rank (on a meta-device model),
    a critic's vocabulary against the policy's, SFT's chat template; a tokenizer with no EOS token
    is a warning (every response then runs to max_new_tokens)."""
    try:
        tokenizer = run_tokenizer(run)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{source}: model.tokenizer_path / model.path: the tokenizer does not load: {e}") from e
    if run.model.lora.enabled:
        try:
            check_lora_targets(run.model.path, run.model.lora)
        except ValueError as e:
            raise ConfigError(f"{source}: model.lora: {e}") from e
    if command in ("sft", "dpo") and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{source}: the tokenizer of {run.model.tokenizer_path or run.model.path!r} has no chat template, and "
            f"{command.upper()} "
            "masks conversations with it (save one with the tokenizer: tokenizer.chat_template = ...)"
        )
    if command == "rl":
        critic = run.rl.critic.path
        if run.rl.algorithm.advantage_estimator == "gae" and critic:
            vocab = {p: _config_value(p, "vocab_size") for p in (run.model.path, critic)}
            if vocab[critic] != vocab[run.model.path]:
                raise ConfigError(
                    f"{source}: rl.critic.path {critic!r} has vocab_size {vocab[critic]}, the policy "
                    f"{run.model.path!r} {vocab[run.model.path]}: the critic reads the policy's tokens"
                )
        teacher = run.distill.path
        if teacher:
            if not (Path(teacher) / "config.json").is_file():
                raise ConfigError(
                    f"{source}: distill.path {teacher!r} must be a local HF-format model directory (config.json)"
                )
            vocab = {p: _config_value(p, "vocab_size") for p in (run.model.path, teacher)}
            if vocab[teacher] != vocab[run.model.path]:
                raise ConfigError(
                    f"{source}: distill.path {teacher!r} has vocab_size {vocab[teacher]}, the student "
                    f"{run.model.path!r} {vocab[run.model.path]}: the teacher scores the student's token ids"
                )
        if getattr(tokenizer, "eos_token_id", None) is None and _config_value(run.model.path, "eos_token_id") is None:
            log.warning(
                "%s: neither the tokenizer nor the model's config names an EOS token: responses never stop "
                "early and every one runs to rollout.sampling.max_new_tokens (%d)",
                source,
                run.rl.rollout.sampling.max_new_tokens,
            )
    return tokenizer


def _config_value(model_dir: str, key: str) -> Any:
    """`key` of the model's config.json (None when absent or unreadable: the model load says why)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get(key)
    except (OSError, ValueError):
        return None


def run_components(run: Any, optimizer: OptimizerConfig, num_training_steps: int) -> TrainingComponents:
    dtype = getattr(torch, _DTYPES[run.model.dtype])
    rank, world = init_distributed()
    device = run.model.device
    if world > 1 and device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if world == 1:
        components = build_components(
            run.model.path,
            optimizer,
            num_training_steps=num_training_steps,
            dtype=dtype,
            device=device,
            attn_implementation=run.model.attn_implementation,
            lora=run.model.lora,
        )
        if run.model.gradient_checkpointing:  # as under torchrun: recompute each layer in backward
            enable_activation_checkpointing(components.model)
        compile_layers(components.model, run.model.compile)
        return components
    model = sharded_model(run, device)
    opt = build_optimizer(model, optimizer)
    return TrainingComponents(
        model=model,
        optimizer=opt,
        device=torch.device(device),
        scheduler=build_scheduler(opt, optimizer, num_training_steps=num_training_steps),
    )


def sharded_model(run: Any, device: str) -> torch.nn.Module:
    """The run's model loaded on every rank and sharded with FSDP2 (under torchrun)."""
    model = load_hf_model(
        run.model.path,
        dtype=getattr(torch, _DTYPES[run.model.dtype]),
        device=device,
        attn_implementation=run.model.attn_implementation,
    )
    if run.model.lora.enabled:  # the adapter goes in before sharding; only its weights train
        model = apply_lora(model, run.model.lora)
    compile_layers(model, run.model.compile)  # before sharding: each sharded unit wraps a compiled layer
    return shard_model(
        model,
        activation_checkpointing=run.model.gradient_checkpointing,
        gather_once_per_step=run.model.gather_once_per_step,
    )


def run_tokenizer(run: Any) -> Any:
    return load_tokenizer(run.model.tokenizer_path or run.model.path)


def local_model(run: Any, source: str) -> Any:
    """The run with model.path (and tokenizer_path) as local directories: a Hugging Face Hub id is
    fetched (or read from the hub cache offline); one the hub cannot provide is a ConfigError."""
    paths = {}
    for key in ("path", "tokenizer_path"):
        value = getattr(run.model, key)
        if value and not Path(value).is_dir():
            try:
                paths[key] = str(resolve_model_dir(value))
            except ValueError as e:
                raise ConfigError(f"{source}: model.{key}: {e}") from e
    return dataclasses.replace(run, model=dataclasses.replace(run.model, **paths)) if paths else run


def run_loggers(run: Any, out: Path, name: str, total: int, *, rank: int = 0) -> MetricsLogger:
    """JSONL and console on rank 0, plus wandb and TensorBoard when [log] switches them on."""
    if rank != 0:
        return NullLogger()
    loggers: list[Any] = [JsonlLogger(out / f"metrics_{name}.jsonl"), ConsoleLogger(total, desc=name)]
    if run.log.tensorboard:
        loggers.append(TensorboardLogger(out / "tensorboard"))
    if run.log.wandb:
        loggers.append(
            WandbLogger(
                project=run.log.wandb_project,
                name=run.log.wandb_name or out.name,
                mode=run.log.wandb_mode,
                dir=str(out),
                config=dataclasses.asdict(run),
            )
        )
    return MultiLogger(loggers)
