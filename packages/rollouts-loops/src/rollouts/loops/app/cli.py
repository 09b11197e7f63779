"""The `rollouts` command: sft, rl, pipeline, plot, demo.

Configs are checked completely (file, keys, types, ranges, data files, model directory) before any
work starts; a bad one exits with status 2 and a message naming the file and the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rollouts.loops.app.config import ConfigError, RLRun, SFTRun, load_run, to_toml
from rollouts.loops.errors import DamagedCheckpointError

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _write_resolved(run: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "resolved_config.toml").write_text(to_toml(run))
    (out / "resolved_config.json").write_text(json.dumps(dataclasses.asdict(run), indent=2) + "\n")


def _default_out_dir(command: str) -> str:
    """runs/<command>-<date>-<time>, the same on every rank (rank 0's clock, broadcast)."""
    from rollouts.loops.distributed import broadcast_json, rank_world

    name = str(Path(f"runs/{command}-{datetime.now():%Y%m%d-%H%M%S}").absolute()) if rank_world()[0] == 0 else None
    return broadcast_json(name)


def _model_fingerprint(path: str) -> str:
    """Cheap identity of a model directory: its JSON files' bytes, its weight files' names and sizes."""
    import hashlib

    digest = hashlib.sha256()
    for p in sorted(Path(path).iterdir()):
        if p.suffix == ".json" and p.name != "state.json":
            digest.update(p.name.encode() + p.read_bytes())
        elif p.suffix == ".safetensors":
            digest.update(f"{p.name}:{p.stat().st_size}".encode())
    return digest.hexdigest()


def _prepare_run(run: Any, command: str, source: str) -> tuple[Any, bool]:
    """The run with its out_dir decided, and whether it resumes (announced); a refused resume is a ConfigError."""
    from rollouts.loops.distributed import broadcast_json, rank_world
    from rollouts.loops.run_dir import RunDirInUse, acquire_run_dir, check_resume, file_fingerprint, release_run_dir

    run = dataclasses.replace(
        run, run=dataclasses.replace(run.run, out_dir=run.run.out_dir or _default_out_dir(command))
    )
    out = Path(run.run.out_dir)
    verdict: dict[str, Any] | None = None
    if rank_world()[0] == 0:  # held until the command ends (release_run_dir); refused if another run has it
        try:
            acquire_run_dir(out)
            inputs = {"model": _model_fingerprint(run.model.path), "train_data": file_fingerprint(run.data.train_path)}
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
        _write_resolved(run, out)
        print(f"{command}: {'resuming the run in' if verdict['resume'] else 'new run in'} {out}", file=sys.stderr)
    return run, bool(verdict["resume"])


def _load(loader: Any, *args: Any, **kwargs: Any) -> Any:
    """A data loader's result; its ValueError (naming file, line and field) becomes a ConfigError."""
    try:
        return loader(*args, **kwargs)
    except ValueError as e:
        raise ConfigError(f"data error: {e}") from e


def _answer_fields(run: Any) -> tuple[str, ...]:
    """Fields every prompt record needs for the configured reward: the built-in graders read the
    answer (checked for every record at load time, not when a record's turn comes mid-run)."""
    return (run.data.answer_key,) if run.reward.fn in ("math_answer", "exact_match") else ()


def _release(out: Path, rank: int) -> None:
    from rollouts.loops.run_dir import release_run_dir

    if rank == 0:
        release_run_dir(out)


def _check_paths(run: Any, source: str, *, model: bool = True) -> None:
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


def _distributed() -> tuple[int, int]:
    from rollouts.loops import init_distributed

    return init_distributed()


def _components(run: Any, optimizer, num_training_steps: int):
    import torch

    from rollouts.backends import build_components, build_optimizer, build_scheduler
    from rollouts.backends.components import TrainingComponents

    dtype = getattr(torch, _DTYPES[run.model.dtype])
    rank, world = _distributed()
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
            from rollouts.backends.distributed import enable_activation_checkpointing

            enable_activation_checkpointing(components.model)
        return components
    model = _sharded_model(run, device)
    opt = build_optimizer(model, optimizer)
    return TrainingComponents(
        model=model,
        optimizer=opt,
        device=torch.device(device),
        scheduler=build_scheduler(opt, optimizer, num_training_steps=num_training_steps),
    )


def _sharded_model(run: Any, device: Any):
    """The run's model loaded on every rank and sharded with FSDP2 (under torchrun)."""
    import torch

    from rollouts.backends import load_hf_model
    from rollouts.backends.distributed import shard_model

    model = load_hf_model(
        run.model.path,
        dtype=getattr(torch, _DTYPES[run.model.dtype]),
        device=device,
        attn_implementation=run.model.attn_implementation,
    )
    if run.model.lora.enabled:  # the adapter goes in before sharding; only its weights train
        from rollouts.backends.lora import apply_lora

        model = apply_lora(model, run.model.lora)
    return shard_model(model, activation_checkpointing=run.model.gradient_checkpointing)


def _tokenizer(run: Any):
    from rollouts.backends import load_tokenizer

    return load_tokenizer(run.model.tokenizer_path or run.model.path)


def _local_model(run: Any, source: str) -> Any:
    """The run with model.path (and tokenizer_path) as local directories: a Hugging Face Hub id is
    fetched (or read from the hub cache offline); one the hub cannot provide is a ConfigError."""
    from rollouts.backends import resolve_model_dir

    paths = {}
    for key in ("path", "tokenizer_path"):
        value = getattr(run.model, key)
        if value and not Path(value).is_dir():
            try:
                paths[key] = str(resolve_model_dir(value))
            except ValueError as e:
                raise ConfigError(f"{source}: model.{key}: {e}") from e
    return dataclasses.replace(run, model=dataclasses.replace(run.model, **paths)) if paths else run


def _loggers(run: Any, out: Path, name: str, total: int, *, rank: int = 0):
    """JSONL and console on rank 0, plus wandb and TensorBoard when [log] switches them on."""
    from rollouts.loops import ConsoleLogger, JsonlLogger, MultiLogger, NullLogger, TensorboardLogger, WandbLogger

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


def cmd_sft(run: SFTRun, source: str) -> Path:
    """Tokenize conversations with the model's chat template and train; returns the checkpoint root."""
    run = _local_model(run, source)
    _check_paths(run, source)
    from rollouts.data import load_conversations, tokenize_conversation
    from rollouts.loops import CHECKPOINTS_DIR, run_sft_training

    rank, world = _distributed()
    conversations = _load(load_conversations, run.data.train_path)  # bad data refused before the run dir is touched
    run, resume = _prepare_run(run, "sft", source)
    out = Path(run.run.out_dir)
    try:
        tokenizer = _tokenizer(run)
        samples = [
            tokenize_conversation(list(c), tokenizer, max_length=run.sft.max_length, train_on=run.sft.train_on)
            for c in conversations
        ]
        components = _components(run, run.sft.optimizer, run.sft.num_steps)
        logger = _loggers(run, out, "sft", run.sft.num_steps, rank=rank)
        try:
            state, _ = run_sft_training(
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
    finally:
        _release(out, rank)
    print(f"sft: finished at step {state.step}; checkpoints in {out / CHECKPOINTS_DIR}", file=sys.stderr)
    return out / CHECKPOINTS_DIR


def _encoder(tokenizer):
    def encode(record: Any) -> list[int]:
        prompt = record["prompt"] if isinstance(record, dict) else record
        if isinstance(prompt, str) and not getattr(tokenizer, "chat_template", None):
            return tokenizer.encode(prompt, add_special_tokens=False)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    return encode


def _builtin_reward(name: str, answer_key: str) -> Any:
    from rollouts.loops.app.tasks import exact_answer_reward
    from rollouts.losses import math_answer_reward

    if name == "environment":
        from rollouts.loops import environment_reward

        return environment_reward
    if name == "math_answer":

        def math_answer(sample: Any, record: Any) -> float:
            return math_answer_reward(sample, answer_key=answer_key)

        return math_answer

    def exact_match(sample: Any, record: Any) -> float:
        return exact_answer_reward(sample, record, answer_key=answer_key)

    return exact_match


def resolve_hooks(run: RLRun, source: str) -> dict[str, Any]:
    """run_rl_training's plug-point arguments from [reward] and [hooks], checked before any work."""
    from rollouts.loops import PluginError, Reward, resolve_function
    from rollouts.loops.app.config import BUILTIN_REWARDS

    spec = run.reward
    try:
        if spec.fn in BUILTIN_REWARDS:
            fn = _builtin_reward(spec.fn, run.data.answer_key)
        else:
            what = "reward(samples, records) -> list[float]" if spec.batched else "reward(sample, record) -> float"
            fn = resolve_function(spec.fn, key="reward.fn", num_positional=2, what=what)
        hooks: dict[str, Any] = {
            "reward": Reward(fn=fn, batched=spec.batched, on_error=spec.on_error, timeout_s=spec.timeout_s)
        }
        for key, arg, arity, what in (
            ("rollout", "rollout", 2, "rollout(record, ctx) -> list[Sample]"),
            ("filter", "filter_fn", 1, "filter(group) -> str | None"),
            ("advantages", "advantage_fn", 2, "advantages(rewards_N, groups_N) -> advantages_N"),
            ("loss", "loss_fn", 2, "loss(logprobs_B_T, batch, *, num_tokens, num_sequences)"),
        ):
            path = getattr(run.hooks, key)
            if path:
                hooks[arg] = resolve_function(path, key=f"hooks.{key}", num_positional=arity, what=what)
    except PluginError as e:
        raise ConfigError(f"{source}: {e}") from e
    return hooks


def _rl_engine(run: RLRun, components: Any, tokenizer: Any, *, shares: bool) -> Any:
    """Rank 0's engine (None on other ranks): the in-process sampler or remote servers."""
    import copy

    from rollouts.backends import InProcessEngine, load_hf_model
    from rollouts.loops import CoalescingEngine, remote_engine
    from rollouts.loops.distributed import rank_world

    rank, world = rank_world()
    if rank != 0:
        return None
    if run.engine.kind != "inprocess":
        return remote_engine(
            run.engine.kind,
            run.engine.urls,
            api_key_env=run.engine.api_key_env,
            timeout_s=run.engine.timeout_s,
            max_retries=run.engine.max_retries,
            sync_timeout_s=run.engine.sync_timeout_s,
            sync=run.engine.sync,
        )
    if shares:
        model = components.model
    elif world == 1 and run.model.lora.enabled and run.model.lora.sync == "merged":
        from rollouts.backends.lora import merged_copy

        model = merged_copy(components.model)  # the engine's copy: merged weights, no adapter
    elif world == 1:
        model = copy.deepcopy(components.model)
    else:  # the trained model is sharded: rank 0 samples from a full copy of its own
        model = load_hf_model(run.model.path, device=components.device)
        if run.model.lora.enabled and run.model.lora.sync == "adapter":
            from rollouts.backends.lora import apply_lora

            model = apply_lora(model, run.model.lora)
    return CoalescingEngine(
        InProcessEngine(model, shares_training_model=shares, tokenizer=tokenizer),
        max_prompts_per_call=run.rl.rollout.batch_size,
    )


def _evaluation(run: RLRun) -> Any:
    """The run's Evaluation from [eval] and data.eval_path, or None."""
    import dataclasses as dc

    from rollouts.data import load_prompts
    from rollouts.loops import Evaluation

    if run.eval.every_steps == 0:
        return None
    if not run.data.eval_path:
        raise ConfigError("eval.every_steps > 0 needs data.eval_path")
    records = _load(load_prompts, run.data.eval_path, field=run.data.prompt_key, required_fields=_answer_fields(run))[
        : run.data.num_eval
    ]
    if run.data.prompt_key != "prompt":
        records = [{**r, "prompt": r[run.data.prompt_key]} for r in records]
    sampling = dc.replace(run.rl.rollout.sampling, n=run.eval.samples_per_prompt, temperature=run.eval.temperature)
    return Evaluation(records=tuple(records), every_steps=run.eval.every_steps, sampling=sampling)


def cmd_rl(run: RLRun, source: str) -> Path:
    """RL from the configured model against the configured engine(s); returns the checkpoint root."""
    run = _local_model(run, source)
    _check_paths(run, source)
    from rollouts.data import DataBuffer, load_prompts
    from rollouts.loops import CHECKPOINTS_DIR, run_rl_training
    from rollouts.loops.policy_update import check_algorithm

    try:
        check_algorithm(run.rl.algorithm)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from e
    hooks = resolve_hooks(run, source)
    try:
        evaluation = _evaluation(run)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e
    rank, world = _distributed()
    records = _load(load_prompts, run.data.train_path, field=run.data.prompt_key, required_fields=_answer_fields(run))
    if run.data.prompt_key != "prompt":
        records = [{**r, "prompt": r[run.data.prompt_key]} for r in records]
    run, resume = _prepare_run(run, "rl", source)
    out = Path(run.run.out_dir)
    try:
        tokenizer = _tokenizer(run)
        components = _components(run, run.rl.optimizer, run.rl.num_steps * run.rl.algorithm.num_updates_per_batch)
        shares = run.engine.kind == "inprocess" and not run.rl.overlap and world == 1
        ref_components = None
        if run.rl.algorithm.needs_reference and run.model.lora.enabled:
            from rollouts.backends.lora import reference_components

            ref_components = reference_components(components)  # the base: the adapter switched off
        elif world > 1 and run.rl.algorithm.needs_reference:
            # The starting model, sharded like the trained one (one process copies it itself).
            ref_components = dataclasses.replace(components, model=_sharded_model(run, components.device).eval())
        logger = _loggers(run, out, "rl", run.rl.num_steps * run.rl.algorithm.num_updates_per_batch, rank=rank)
        try:
            state, _ = run_rl_training(
                components,
                DataBuffer(records, seed=run.rl.seed),
                _rl_engine(run, components, tokenizer, shares=shares),
                run.rl,
                encode_prompt=_encoder(tokenizer),
                logger=logger,
                run_dir=out,
                engine_shares_model=shares,
                resume=resume,
                resume_from=run.run.resume_from or None,
                tokenizer=tokenizer,
                ref_components=ref_components,
                evaluation=evaluation,
                num_logged_completions=run.log.num_sample_completions,
                **hooks,
            )
        finally:
            logger.close()
    finally:
        _release(out, rank)
    print(
        f"rl: finished at step {state.step}, weight version {state.weight_version}; "
        f"checkpoints in {out / CHECKPOINTS_DIR}",
        file=sys.stderr,
    )
    return out / CHECKPOINTS_DIR


def cmd_eval(run: RLRun, source: str, checkpoint: str) -> dict[str, float]:
    """Evaluate a saved model on data.eval_path with [eval] and [reward]; prints and returns the metrics."""
    import trio

    from rollouts.backends import InProcessEngine, load_hf_model
    from rollouts.loops import evaluate_groups, group_metrics

    if not (Path(checkpoint) / "config.json").is_file():
        raise ConfigError(f"--checkpoint {checkpoint!r} must be an HF-format model directory (config.json)")
    run = dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, path=checkpoint),
        eval=dataclasses.replace(run.eval, every_steps=max(1, run.eval.every_steps)),
    )
    _check_paths(run, source)
    evaluation = _evaluation(run)
    reward = resolve_hooks(run, source)["reward"]
    tokenizer = _tokenizer(run)
    engine = InProcessEngine(load_hf_model(checkpoint, device=run.model.device), tokenizer=tokenizer)
    groups = trio.run(evaluate_groups, engine, evaluation.records, _encoder(tokenizer), reward, evaluation.sampling)
    metrics = {**group_metrics(groups), "num_eval": float(len(groups))}
    print(json.dumps(metrics))
    return metrics


_SECTIONS = {
    "sft": "[model] path, dtype, device, attn_implementation, gradient_checkpointing\n"
    "  [data] train_path (chat JSONL: messages)\n  [run] out_dir, resume\n"
    "  [log] wandb, tensorboard\n  [sft] num_steps, batch_size, max_length, ... [sft.optimizer] [sft.checkpoint]",
    "rl": "preset = grpo | drgrpo | dapo | ...\n  [model] path, ...\n  [data] train_path, eval_path, prompt_key, answer_key\n"
    "  [engine] kind (inprocess | vllm | sglang), urls, timeouts\n  [run] out_dir, resume\n"
    "  [reward] fn, batched, on_error, timeout_s\n  [hooks] rollout, filter, advantages, loss\n"
    "  [eval] every_steps, samples_per_prompt, temperature\n  [log] wandb, tensorboard, num_sample_completions\n"
    "  [rl] num_steps, overlap, ... [rl.rollout] [rl.rollout.sampling] [rl.algorithm] [rl.optimizer] [rl.checkpoint]",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollouts-loops")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollouts",
        description="SFT and RL post-training for LLMs.",
        epilog="Every key of a run file, with its default and meaning: "
        "rollouts config show sft|rl. Examples: examples/*.toml.",
    )
    parser.add_argument("--version", action="version", version=f"rollouts {_version()}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="level of the library's log messages on stderr (default INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in (("sft", "supervised fine-tuning"), ("rl", "reinforcement learning")):
        p = sub.add_parser(
            name,
            help=what,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=f"run file sections:\n  {_SECTIONS[name]}\n\nall keys: rollouts config show {name}",
        )
        p.add_argument("--config", required=True, help="TOML run file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        p.add_argument(
            "--resume",
            choices=("auto", "never", "must"),
            default=None,
            help="override run.resume: auto (if out_dir has a checkpoint), never, must",
        )
        p.add_argument(
            "--resume-from",
            default=None,
            metavar="CHECKPOINT",
            help="resume from this checkpoint (out_dir/checkpoints/step_N) instead of the newest",
        )
    p = sub.add_parser("config", help="print a run file with every key, its default and what it means")
    p.add_argument("action", choices=("show",))
    p.add_argument("kind", choices=("sft", "rl"))
    p = sub.add_parser("eval", help="evaluate a saved model: mean reward, pass@1, pass@k, maj@k (JSON)")
    p.add_argument("--config", required=True, help="TOML RL run file ([data] eval_path, [reward], [eval])")
    p.add_argument("--checkpoint", required=True, help="HF-format model directory, e.g. a run's checkpoints/step_N")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p = sub.add_parser("pipeline", help="SFT, then RL from SFT's last checkpoint")
    p.add_argument("--sft-config", required=True)
    p.add_argument("--rl-config", required=True)
    p.add_argument("--set-sft", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--set-rl", action="append", default=[], metavar="KEY=VALUE")
    p = sub.add_parser("plot", help="PNG of a run's metrics")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    from rollouts.loops.app.engine_cmd import add_engine_parser

    add_engine_parser(sub)
    from rollouts.loops.app.export_cmd import add_export_parser

    add_export_parser(sub)
    p = sub.add_parser("demo", help="tiny model: SFT then RL on addition, on CPU, in minutes")
    p.add_argument("--quick", action="store_true", help="a sub-minute variant (no accuracy targets)")
    p.add_argument("--out", default=None, help="run directory (default runs/demo-<time>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a DemoConfig field (rl_steps=100) or the RL stage's LoRA (model.lora.rank=8)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rollouts` console script; returns the exit status."""
    import logging

    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sets = [*getattr(args, "set", []), *([f"run.resume='{args.resume}'"] if getattr(args, "resume", None) else [])]
    if getattr(args, "resume_from", None):
        sets.append(f"run.resume_from={json.dumps(str(Path(args.resume_from).absolute()))}")
    clean = False
    try:
        if args.command == "sft":
            cmd_sft(load_run(SFTRun, args.config, sets), args.config)
        elif args.command == "rl":
            cmd_rl(load_run(RLRun, args.config, sets), args.config)
        elif args.command == "config":
            from rollouts.loops.app.config import documented_toml

            print(documented_toml(SFTRun if args.kind == "sft" else RLRun), end="")
        elif args.command == "eval":
            cmd_eval(load_run(RLRun, args.config, args.set), args.config, args.checkpoint)
        elif args.command == "pipeline":
            sft = load_run(SFTRun, args.sft_config, args.set_sft)
            rl = load_run(RLRun, args.rl_config, args.set_rl)
            _check_paths(rl, args.rl_config, model=False)  # both checked before any work
            from rollouts.backends import latest_checkpoint

            _distributed()
            if not sft.run.out_dir or not rl.run.out_dir:  # each stage its own directory under one root
                root = _default_out_dir("pipeline")
                sft = dataclasses.replace(
                    sft, run=dataclasses.replace(sft.run, out_dir=sft.run.out_dir or f"{root}/sft")
                )
                rl = dataclasses.replace(rl, run=dataclasses.replace(rl.run, out_dir=rl.run.out_dir or f"{root}/rl"))
            checkpoint = latest_checkpoint(cmd_sft(sft, args.sft_config))
            if checkpoint is None:
                raise ConfigError(f"{args.sft_config}: SFT wrote no complete checkpoint to start RL from")
            checkpoint = checkpoint.absolute()  # recorded in RL's resolved config: where its weights came from
            rl = dataclasses.replace(
                rl,
                model=dataclasses.replace(
                    rl.model, path=str(checkpoint), tokenizer_path=rl.model.tokenizer_path or str(checkpoint)
                ),
            )
            cmd_rl(rl, args.rl_config)
        elif args.command == "engine":
            from rollouts.loops.app.engine_cmd import cmd_engine

            return cmd_engine(args)
        elif args.command == "export":
            from rollouts.loops.app.export_cmd import cmd_export

            return cmd_export(args)
        elif args.command == "plot":
            from rollouts.loops.app.plot import plot_run

            print(plot_run(args.run_dir, out=args.out))
        elif args.command == "demo":
            from rollouts.loops.app.demo import DemoConfig, demo_overrides, run_demo

            config = DemoConfig.quick() if args.quick else DemoConfig()
            config = demo_overrides(dataclasses.replace(config, seed=args.seed), args.set)
            out = args.out or f"runs/demo-{datetime.now():%Y%m%d-%H%M%S}"
            run_demo(config, out)
        clean = True
    except ConfigError as e:
        print(f"rollouts {args.command}: config error: {e}", file=sys.stderr)
        return 2
    except DamagedCheckpointError as e:
        print(f"rollouts {args.command}: {e}", file=sys.stderr)
        return 2
    finally:
        if "torch" in sys.modules:  # only a run that imported torch can have a process group
            from rollouts.loops import close_distributed

            close_distributed(clean=clean)
    return 0


if __name__ == "__main__":
    sys.exit(main())
