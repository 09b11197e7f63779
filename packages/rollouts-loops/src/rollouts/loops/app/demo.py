"""`rollouts demo`: tokenizer, tiny model, SFT, RL (GRPO) and evaluations on a laptop CPU.

Everything is built locally: a BPE tokenizer trained on the task's text, a random-init Qwen2
(head_dim 32), and two-digit addition problems with exact answers (written least significant
digit first, the order in which a left-to-right model can carry).

The story it tells: SFT imitates demonstrations from a sloppy teacher, who forgets the carry out
of the units digit most of the time, so the SFT model learns addition *and* the teacher's
mistake. GRPO then samples from that model, scores each answer with an exact verifier, and
shifts probability onto the answers that are right: held-out accuracy rises on exactly the
problems imitation got wrong. The held-out problems never appear in training.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import torch

from rollouts.backends import InProcessEngine, build_components, export_weights
from rollouts.data import DataBuffer, prompt_encoder, tokenize_conversation
from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.app.config import ConfigError, apply_overrides
from rollouts.loops.app.plot import plot_run
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.evaluation import evaluate
from rollouts.loops.recipes.addition import addition_problems, as_conversation, sloppy_teacher
from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer, save_model
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.rollouts.rewards import exact_match
from rollouts.loops.run.loggers import ConsoleLogger, JsonlLogger, MultiLogger
from rollouts.loops.sft import run_sft_training
from rollouts.types import (
    CheckpointConfig,
    InferenceEngine,
    LoraConfig,
    MetricsLogger,
    OptimizerConfig,
    RLConfig,
    RolloutConfig,
    SamplingParams,
    SFTConfig,
    Tokenizer,
    check_fields,
    from_dict,
    require,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """The demo's workload; the defaults are tuned to finish in minutes on 2 CPU cores."""

    seed: int = 0
    digits: int = 2
    reverse_answer: bool = True
    teacher_error_rate: float = 0.6
    """How often the SFT teacher forgets the carry out of the units digit."""
    num_train: int = 8000
    num_eval: int = 200
    hidden_size: int = 128
    num_layers: int = 2
    intermediate_size: int = 256
    sft_steps: int = 1500
    sft_batch_size: int = 64
    sft_lr: float = 1e-3
    rl_steps: int = 400
    rl_prompts_per_step: int = 32
    rl_samples_per_prompt: int = 8
    rl_lr: float = 1e-4
    rl_temperature: float = 1.0
    rl_preset: str = "grpo"
    """The RL stage's algorithm preset (rollouts.loops.ALGORITHMS): e.g. `--set rl_preset=ppo` (a critic)."""
    threads: int = 2
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The RL stage trains a LoRA adapter on the SFT model (rank 0: every weight); `--set model.lora.rank=8`."""
    rl_lora_lr: float = 5e-4
    """RL learning rate with LoRA (5x rl_lr: adapters take larger steps; 2e-3 collapsed to empty answers)."""
    smoke: bool = False
    """A run too short to learn the task (e.g. `--set sft_steps=40`): the summary then shows loss and reward trends."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.rl_preset in ALGORITHMS, "DemoConfig.rl_preset", self.rl_preset, f"be one of {sorted(ALGORITHMS)}")

    @classmethod
    def quick(cls) -> DemoConfig:
        """The same story in under a minute on 2 CPU cores: fewer, faster SFT steps (a higher learning
        rate) and 40 RL steps; SFT still learns the teacher's mistake and RL still repairs part of it."""
        return cls(
            num_train=4000,
            num_eval=100,
            sft_steps=600,
            sft_lr=2e-3,
            rl_steps=40,
            rl_prompts_per_step=16,
            rl_lr=3e-4,
        )


def demo_overrides(config: DemoConfig, overrides: list[str]) -> DemoConfig:
    """`config` with `--set` overrides: DemoConfig fields by name, the RL stage's LoRA as model.lora.<field>."""
    items = [o[len("model.") :] if o.startswith("model.lora.") else o for o in overrides]
    data = apply_overrides(dataclasses.asdict(config), items)
    try:
        return from_dict(DemoConfig, data)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"demo --set {' '.join(overrides)}: {e}") from e


def demo_model(config: DemoConfig, vocab_size: int, *, eos_token_id: int, pad_token_id: int) -> Any:
    """The demo's random-init Qwen2: `config`'s sizes, head_dim 32 (the CPU build of vLLM serves it)."""
    return build_tiny_model(
        vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.hidden_size // 32,
        num_kv_heads=max(1, config.hidden_size // 64),
        intermediate_size=config.intermediate_size,
        max_position_embeddings=64,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        seed=config.seed,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoTask:
    """The demo's problems and tokenizer, built from a DemoConfig (demo_task)."""

    train: tuple[dict[str, str], ...]
    """Training problems (SFT demonstrations come from them, RL prompts are them)."""
    held_out: tuple[dict[str, str], ...]
    """Evaluation problems, none of which is in `train`."""
    tokenizer: Any
    """The BPE tokenizer trained on the task's text (a transformers fast tokenizer)."""


def demo_task(config: DemoConfig) -> DemoTask:
    """The problems and the tokenizer of `config` (the same for the same config)."""
    held_out = addition_problems(
        config.num_eval, digits=config.digits, seed=config.seed + 1, reverse_answer=config.reverse_answer
    )
    train = addition_problems(
        config.num_train,
        digits=config.digits,
        seed=config.seed + 2,
        reverse_answer=config.reverse_answer,
        exclude=frozenset(r["prompt"] for r in held_out),
    )
    tokenizer = build_tokenizer((r["prompt"] + r["answer"] for r in train[:2000]), vocab_size=32)
    return DemoTask(train=tuple(train), held_out=tuple(held_out), tokenizer=tokenizer)


def held_out_accuracy(engine: InferenceEngine, task: DemoTask, config: DemoConfig) -> float:
    """Exact-match accuracy of greedy answers to the held-out problems."""
    tokenizer = task.tokenizer
    greedy = SamplingParams(temperature=0.0, max_new_tokens=config.digits + 3, stop_token_ids=(tokenizer.eos_token_id,))
    accuracy: float
    accuracy, _ = evaluate(engine, list(task.held_out), prompt_encoder(tokenizer, chat=False), exact_match, greedy)
    return accuracy


def run_demo_sft(
    model: Any, task: DemoTask, config: DemoConfig, *, run_dir: Path, logger: MetricsLogger
) -> list[dict[str, float]]:
    """Train `model` in place on the sloppy teacher's demonstrations of `task.train`; the SFT history."""
    sft = SFTConfig(
        num_steps=config.sft_steps,
        batch_size=config.sft_batch_size,
        max_length=32,
        max_tokens_per_micro_batch=4096,
        seed=config.seed,
        optimizer=OptimizerConfig(
            lr=config.sft_lr,
            warmup_steps=max(1, config.sft_steps // 20),
            schedule="cosine",
            weight_decay=0.0,
            max_grad_norm=1.0,
            min_lr_ratio=0.1,
        ),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    demonstrations = sloppy_teacher(
        list(task.train), error_rate=config.teacher_error_rate, seed=config.seed, reverse_answer=config.reverse_answer
    )
    # transformers types decode as str | list[str]; one id list gives str
    chat_tokenizer = cast(Tokenizer, task.tokenizer)
    samples = [
        tokenize_conversation(as_conversation(r), chat_tokenizer, max_length=sft.max_length) for r in demonstrations
    ]
    components = build_components(model, sft.optimizer, num_training_steps=sft.num_steps)
    _, history = run_sft_training(
        components,
        DataBuffer(samples, seed=config.seed),
        sft,
        logger=logger,
        run_dir=run_dir,
        resume=False,
        tokenizer=task.tokenizer,
    )
    return history


def _first_last(history: list[dict[str, float]], key: str, span: int = 3) -> tuple[float, float]:
    """Mean of `key` over the first and over the last `span` steps (a short run's trend, not its noise)."""
    values = [h[key] for h in history if key in h]
    if not values:
        return (float("nan"), float("nan"))
    span = max(1, min(span, len(values) // 2 or 1))
    return (sum(values[:span]) / span, sum(values[-span:]) / span)


def run_demo(config: DemoConfig, out_dir: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Run the whole demo into `out_dir`; returns the summary also written to summary.json."""
    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    say = print if progress else (lambda *a, **k: None)

    task = demo_task(config)
    tokenizer = task.tokenizer
    model = demo_model(config, len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    save_model(model, tokenizer, out / "init_model")
    say(
        f"[demo] tokenizer: {len(tokenizer)} tokens; model: {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"task: {config.digits}-digit addition, {len(task.train)} train / {len(task.held_out)} held-out problems"
    )

    encode = prompt_encoder(tokenizer, chat=False)
    engine = InProcessEngine(model, shares_training_model=True, tokenizer=tokenizer)

    def accuracy(label: str) -> float:
        acc = held_out_accuracy(engine, task, config)
        say(f"[demo] held-out accuracy {label}: {acc:.3f}")
        return acc

    accuracy_before = accuracy("before SFT")
    timings: dict[str, float] = {}
    logger = MultiLogger(
        [JsonlLogger(out / "metrics_sft.jsonl")] + ([ConsoleLogger(config.sft_steps, desc="SFT")] if progress else [])
    )
    phase = time.perf_counter()
    sft_history = run_demo_sft(model, task, config, run_dir=out / "sft", logger=logger)
    logger.close()
    timings["sft_s"] = time.perf_counter() - phase
    accuracy_after_sft = accuracy("after SFT")
    save_model(model, tokenizer, out / "sft_model")  # e.g. a teacher to distill from

    rl = RLConfig(
        num_steps=config.rl_steps,
        rollout=RolloutConfig(
            batch_size=config.rl_prompts_per_step,
            samples_per_prompt=config.rl_samples_per_prompt,
            max_concurrency=config.rl_prompts_per_step,
            request_timeout_s=300.0,
            sampling=SamplingParams(
                temperature=config.rl_temperature,
                max_new_tokens=config.digits + 3,
                stop_token_ids=(tokenizer.eos_token_id,),
            ),
        ),
        algorithm=ALGORITHMS[config.rl_preset],
        optimizer=OptimizerConfig(
            lr=config.rl_lora_lr if config.lora.enabled else config.rl_lr,
            warmup_steps=0,
            schedule="constant",
            max_grad_norm=1.0,
        ),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
        max_tokens_per_micro_batch=4096,
        seed=config.seed,
    )
    rl_components = build_components(
        model, rl.optimizer, num_training_steps=rl.num_steps, lora=config.lora if config.lora.enabled else None
    )
    rl_engine = CoalescingEngine(engine, max_prompts_per_call=config.rl_prompts_per_step)
    rl_logger = MultiLogger(
        [JsonlLogger(out / "metrics_rl.jsonl")] + ([ConsoleLogger(rl.num_steps, desc="RL (GRPO)")] if progress else [])
    )
    prompts = DataBuffer(list(task.train), seed=config.seed + 3)
    phase = time.perf_counter()
    _, rl_history = run_rl_training(
        RLModels(policy=rl_components, engine=rl_engine, engine_shares_model=True),
        prompts,
        rl,
        reward=exact_match,
        encode_prompt=encode,
        output=RunOutputs(run_dir=out / "rl", logger=rl_logger, resume=False),
        tokenizer=tokenizer,
    )
    rl_logger.close()
    timings["rl_s"] = time.perf_counter() - phase
    accuracy_after_rl = accuracy("after RL")

    final = out / "final_model"
    export_weights(rl_components, final, durable=True)
    tokenizer.save_pretrained(str(final))
    sft_loss = _first_last(sft_history, "loss")
    rl_reward = _first_last(rl_history, "reward_mean")
    summary = {
        "smoke_run": config.smoke,
        "sft_loss_first_last": sft_loss,
        "rl_reward_first_last": rl_reward,
        "accuracy_before_sft": accuracy_before,
        "accuracy_after_sft": accuracy_after_sft,
        "accuracy_after_rl": accuracy_after_rl,
        "wall_time_s": time.perf_counter() - start,
        **timings,
        "sft_model": str(out / "sft_model"),
        "final_model": str(final),
        "config": dataclasses.asdict(config),
    }
    try:  # matplotlib is an optional extra ([plot])
        summary["plot"] = str(plot_run(out))
    except ImportError as e:
        say(f"[demo] no plot: {e}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    learned = (
        f"  SFT loss {sft_loss[0]:.3f} -> {sft_loss[1]:.3f} (first vs last steps); "
        f"RL reward {rl_reward[0]:.3f} -> {rl_reward[1]:.3f}\n"
    )
    if config.smoke:
        say(
            "\n  smoke run: a tiny model trained for a few steps, to check that every stage runs;\n"
            "  it is too short to learn the task, so held-out accuracy is not its measure. Learning shows in:\n"
            + learned
            + f"  held-out accuracy before SFT / after SFT / after RL: {accuracy_before:.1%} / "
            f"{accuracy_after_sft:.1%} / {accuracy_after_rl:.1%} (the full demo: rollouts demo)\n"
            f"  wall time {summary['wall_time_s']:.0f} s; outputs in {out}"
        )
        return summary
    say(
        "\n" + learned + "\n  stage         held-out accuracy\n"
        f"  before SFT    {accuracy_before:6.1%}\n  after SFT     {accuracy_after_sft:6.1%}\n"
        f"  after RL      {accuracy_after_rl:6.1%}\n"
        f"  wall time {summary['wall_time_s']:.0f} s (SFT {timings['sft_s']:.0f} s, RL {timings['rl_s']:.0f} s); "
        f"outputs in {out}"
    )
    return summary


def cmd_demo(args: argparse.Namespace) -> int:
    """`rollouts demo [--quick] [--out DIR] [--seed N] [--set KEY=VALUE ...]`; returns the exit status."""
    config = DemoConfig.quick() if args.quick else DemoConfig()
    config = demo_overrides(dataclasses.replace(config, seed=args.seed), args.set)
    run_demo(config, args.out or f"runs/demo-{datetime.now():%Y%m%d-%H%M%S}")
    return 0
