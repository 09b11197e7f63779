"""GRPO and SFT step time: ours beside TRL's GRPOTrainer and SFTTrainer on the identical model and data.

Workload (issue 19, target 1): a random-init Qwen2 of about 1M parameters (hidden 128, 4 layers,
head_dim 32, fp32) with a BPE tokenizer built here on 3-digit addition, saved to a temporary
directory that both sides load from (nothing from a model hub).
- GRPO: 4 prompts x 8 completions x exactly 16 new tokens per step (EOS never stops a completion:
  ours samples with no stop token, TRL gets min_new_tokens=16), exact-answer reward, no KL term,
  one update per batch, AdamW lr 1e-5, generation by the training model itself on both sides
  (ours: the in-process sampler behind CoalescingEngine, synchronous loop, as the demo runs it).
- SFT: 32 sequences x 64 tokens per step (the same random token ids on both sides, loss on every
  token, no padding), AdamW lr 1e-5.

Each side runs in its own subprocess, one thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)), in
alternating bursts (ours, TRL, ours, ...). A step is the time between consecutive step ends (all
of it: data, generation, reward, loss, backward, optimizer), wall and process CPU (the latter
barely moved by other load); the first `--warmup` steps and the last (closing work) are not
counted; figures are medians over every measured step of every burst. Ours is split by phase,
timed around the library's own functions; for SFT the bare model's forward + backward on one
batch is timed too: the compute no training loop can skip.

trl is not a project dependency; install it for the run:

    uv run --with trl==1.16.0 python benchmarks/bench_trl.py [--steps 8] [--warmup 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL = 2.5  # issue 19: TRL step time / ours >= 2.5 for GRPO and for SFT
TRL_VERSION = "1.16.0"
PROMPTS_PER_STEP, COMPLETIONS_PER_PROMPT, NEW_TOKENS = 4, 8, 16
SFT_BATCH, SFT_LENGTH = 32, 64
LR = 1e-5
CHILD_TIMEOUT_S, RESULT_TAG = 600.0, "BENCH_RESULT "  # a hung burst fails the run instead of stalling it
TRL_FIXED = dict(use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)


def prepare(directory: Path, *, num_steps: int) -> int:
    """Build the tiny model and tokenizer, save them with the prompts and SFT data; returns #params."""
    from rollouts.loops.app.tasks import addition_problems
    from rollouts.loops.app.tiny import build_tiny_model, build_tokenizer, save_model

    records = addition_problems(2000, digits=3, seed=0)
    tokenizer = build_tokenizer((r["prompt"] + r["answer"] for r in records), vocab_size=32)
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    save_model(model, tokenizer, directory / "model")
    (directory / "prompts.json").write_text(json.dumps(records[: PROMPTS_PER_STEP * num_steps]))
    rng = random.Random(1)
    specials = {tokenizer.pad_token_id, tokenizer.eos_token_id}
    ordinary = [t for t in range(len(tokenizer)) if t not in specials]
    sequences = [[rng.choice(ordinary) for _ in range(SFT_LENGTH)] for _ in range(SFT_BATCH * num_steps)]
    (directory / "sft.json").write_text(json.dumps(sequences))
    return sum(p.numel() for p in model.parameters())


def load(directory: Path):
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(directory / "model"), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(directory / "model"))


class PhaseClock:
    """Step-end times, and seconds spent per step inside wrapped library functions."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, float]] = []  # (wall, process CPU) clocks
        self.phases: list[dict[str, float]] = []
        self.floor: list[dict[str, float]] = []
        self._open: dict[str, float] = {}

    def wrap(self, module, name: str, phase: str) -> None:
        inner = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._open[phase] = self._open.get(phase, 0.0) + time.perf_counter() - start

        setattr(module, name, timed)

    def step_ended(self, extra: dict[str, float]) -> None:
        self.ends.append((time.perf_counter(), time.process_time()))
        self.phases.append({**self._open, **extra})
        self._open = {}

    # the MetricsLogger protocol: the loops call log() once per step, after the optimizer step
    def log(self, step: int, metrics) -> None:
        self.step_ended({k: float(metrics[k]) for k in ("generate_s", "sync_s") if k in metrics})

    def close(self) -> None:
        pass


def ours_grpo(directory: Path, num_steps: int, clock: PhaseClock) -> None:
    from rollouts.backends import InProcessEngine, build_components
    from rollouts.data import DataBuffer
    from rollouts.loops import policy_update
    from rollouts.loops.app.tasks import exact_answer_reward
    from rollouts.loops.engines import CoalescingEngine
    from rollouts.loops.rl import run_rl_training
    from rollouts.types import AlgorithmConfig, CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig
    from rollouts.types import SamplingParams as Sampling

    model, tokenizer = load(directory)
    records = json.loads((directory / "prompts.json").read_text())
    config = RLConfig(
        num_steps=num_steps,
        overlap=False,
        rollout=RolloutConfig(
            batch_size=PROMPTS_PER_STEP,
            samples_per_prompt=COMPLETIONS_PER_PROMPT,
            max_concurrency=PROMPTS_PER_STEP,
            request_timeout_s=300.0,
            sampling=Sampling(temperature=1.0, max_new_tokens=NEW_TOKENS, stop_token_ids=()),
        ),
        algorithm=AlgorithmConfig(advantage_estimator="grpo", policy_loss="ppo_clip", loss_aggregation="token-mean"),
        optimizer=OptimizerConfig(lr=LR, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
        max_tokens_per_micro_batch=4096,
    )
    components = build_components(model, config.optimizer, num_training_steps=num_steps)
    engine = CoalescingEngine(
        InProcessEngine(model, shares_training_model=True, tokenizer=tokenizer), max_prompts_per_call=PROMPTS_PER_STEP
    )
    clock.wrap(policy_update, "compute_logprobs", "logprobs_s")
    clock.wrap(policy_update, "forward_backward", "loss_backward_s")
    clock.wrap(policy_update, "optim_step", "optimizer_s")
    with tempfile.TemporaryDirectory() as run_dir:
        run_rl_training(
            components,
            DataBuffer(records, seed=0),
            engine,
            config,
            reward=exact_answer_reward,
            encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
            logger=clock,
            run_dir=run_dir,
            engine_shares_model=True,
            resume=False,
        )


def ours_sft(directory: Path, num_steps: int, clock: PhaseClock) -> None:
    from rollouts.backends import build_components
    from rollouts.loops import sft
    from rollouts.types import CheckpointConfig, LossMask, OptimizerConfig, Sample, SFTConfig, Status, TokenIds

    model, _ = load(directory)
    samples = [
        Sample(tokens=TokenIds(ids), loss_mask=LossMask([1.0] * len(ids)), status=Status.COMPLETED)
        for ids in json.loads((directory / "sft.json").read_text())
    ]
    config = SFTConfig(
        num_steps=num_steps,
        batch_size=SFT_BATCH,
        max_length=SFT_LENGTH,
        max_tokens_per_micro_batch=SFT_BATCH * SFT_LENGTH,
        optimizer=OptimizerConfig(lr=LR, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    components = build_components(model, config.optimizer, num_training_steps=num_steps)
    clock.wrap(sft, "forward_backward", "loss_backward_s")
    clock.wrap(sft, "optim_step", "optimizer_s")
    sft.run_sft_training(components, samples, config, logger=clock, run_dir=None)
    clock.floor = model_floor(model, samples[:SFT_BATCH])


def model_floor(model, samples, *, repeats: int = 5) -> list[dict[str, float]]:
    """Seconds of the bare model's forward + cross-entropy + backward on one SFT batch: the compute
    no training loop can skip, so TRL's step / this bounds any loop's speedup over TRL."""
    import torch

    ids_B_T = torch.tensor([list(s.tokens) for s in samples])
    times = []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        logits_B_T_V = model(input_ids=ids_B_T).logits
        loss = torch.nn.functional.cross_entropy(
            logits_B_T_V[:, :-1].reshape(-1, logits_B_T_V.shape[-1]), ids_B_T[:, 1:].reshape(-1)
        )
        loss.backward()
        times.append({"step_s": time.perf_counter() - start, "cpu_s": time.process_time() - start_cpu})
        model.zero_grad(set_to_none=True)
    return times


def trl_common(output_dir: str, num_steps: int) -> dict:
    steps = dict(max_steps=num_steps, logging_steps=num_steps + 1, learning_rate=LR, lr_scheduler_type="constant")
    return dict(output_dir=output_dir, **steps, **TRL_FIXED)


def trl_callback(clock: PhaseClock):
    from transformers import TrainerCallback

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_ended({})

    return StepEnds()


def trl_grpo(directory: Path, num_steps: int, clock: PhaseClock) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load(directory)
    records = json.loads((directory / "prompts.json").read_text())

    def exact_answer(prompts, completions, answer, **_):  # the same rule as rollouts' exact_answer_reward
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            **trl_common(out, num_steps),
            per_device_train_batch_size=PROMPTS_PER_STEP * COMPLETIONS_PER_PROMPT,
            num_generations=COMPLETIONS_PER_PROMPT,
            max_completion_length=NEW_TOKENS,
            generation_kwargs={"min_new_tokens": NEW_TOKENS},
            temperature=1.0,
            beta=0.0,
            num_iterations=1,
        )
        GRPOTrainer(
            model=model,
            reward_funcs=exact_answer,
            args=args,
            train_dataset=Dataset.from_list(records),
            processing_class=tokenizer,
            callbacks=[trl_callback(clock)],
        ).train()


def trl_sft(directory: Path, num_steps: int, clock: PhaseClock) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = load(directory)
    sequences = json.loads((directory / "sft.json").read_text())
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            **trl_common(out, num_steps),
            per_device_train_batch_size=SFT_BATCH,
            max_length=SFT_LENGTH,
            packing=False,
        )
        SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_dict({"input_ids": sequences}),
            processing_class=tokenizer,
            callbacks=[trl_callback(clock)],
        ).train()


RUNNERS = {("ours", "grpo"): ours_grpo, ("ours", "sft"): ours_sft, ("trl", "grpo"): trl_grpo, ("trl", "sft"): trl_sft}


def child(side: str, task: str, directory: Path, *, warmup: int, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    clock = PhaseClock()
    RUNNERS[side, task](directory, warmup + steps + 1, clock)  # + 1: the last step's closing work is not timed
    if len(clock.ends) != warmup + steps + 1:
        raise RuntimeError(f"{side} {task}: saw {len(clock.ends)} step ends, expected {warmup + steps + 1}")
    measured = range(warmup, warmup + steps)
    (wall, cpu) = ([end[k] for end in clock.ends] for k in (0, 1))
    rows = [{"step_s": wall[i] - wall[i - 1], "cpu_s": cpu[i] - cpu[i - 1], **clock.phases[i]} for i in measured]
    print(RESULT_TAG + json.dumps({"steps": rows, "floor": clock.floor}), flush=True)


def burst(side: str, task: str, directory: Path, *, warmup: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable,
        __file__,
        "--child",
        side,
        task,
        str(directory),
        f"--warmup={warmup}",
        f"--steps={steps}",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{side} {task} burst failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_TAG) :])


def report(task: str, workload: str, ours: list[dict[str, float]], trl: list[dict[str, float]], bursts, floor) -> None:
    ours_s = statistics.median(r["step_s"] for r in ours)
    trl_s = statistics.median(r["step_s"] for r in trl)
    ratio = trl_s / ours_s  # the speedup; the goal is >= GOAL
    verdict = "met" if ratio >= GOAL else f"NOT met: {GOAL / ratio:.2f}x short (ours must reach {trl_s / GOAL:.3f} s)"
    print(f"{task} ({workload}): ours {ours_s:.3f} s/step, TRL {trl_s:.3f} s/step, TRL / ours = {ratio:.2f}x")
    print(f"  goal >= {GOAL}x: {verdict}")
    ours_cpu, trl_cpu = (statistics.median(r["cpu_s"] for r in rows) for rows in (ours, trl))
    print(f"  process CPU per step: ours {ours_cpu:.3f} s, TRL {trl_cpu:.3f} s, TRL / ours = {trl_cpu / ours_cpu:.2f}x")
    phases = sorted({k for r in ours for k in r} - {"step_s", "cpu_s"})
    split = {k: statistics.median(r.get(k, 0.0) for r in ours) for k in phases}
    rest = statistics.median(r["step_s"] - sum(r.get(k, 0.0) for k in phases) for r in ours)
    print(
        "  ours per phase (medians): "
        + ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f} ms" for k, v in split.items())
        + f", rest {rest * 1e3:.1f} ms"
    )
    if floor:
        floor_s, floor_cpu = (statistics.median(r[k] for r in floor) for k in ("step_s", "cpu_s"))
        print(
            f"  bare model forward + backward on one batch (no loop, no optimizer): {floor_s * 1e3:.1f} ms wall, "
            f"{floor_cpu * 1e3:.1f} ms CPU; a loop that runs this model's forward + backward cannot beat TRL by more "
            f"than {trl_cpu / floor_cpu:.2f}x (CPU) here; ours takes {ours_cpu / floor_cpu:.2f}x the bare pass"
        )
    print("  per burst (ours / TRL medians, s): " + ", ".join(f"{o:.3f} / {t:.3f}" for o, t in bursts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per burst")
    parser.add_argument("--warmup", type=int, default=2, help="steps per burst not measured")
    parser.add_argument("--repeats", type=int, default=3, help="bursts per side and task")
    parser.add_argument("--tasks", nargs="+", choices=("grpo", "sft"), default=["grpo", "sft"])
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "TASK", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        raise ValueError(
            f"--steps ({args.steps}), --warmup ({args.warmup}) and --repeats ({args.repeats}) must be >= 1"
        )
    if args.child:
        side, task, directory = args.child
        child(side, task, Path(directory), warmup=args.warmup, steps=args.steps)
        return
    tasks = list(dict.fromkeys(args.tasks))
    if importlib.util.find_spec("trl") is None:
        sys.exit(
            "trl is not installed (it is not a project dependency). Run the comparison with:\n"
            f"    uv run --with trl=={TRL_VERSION} python benchmarks/bench_trl.py"
        )
    import torch
    import transformers
    import trl

    note = "" if trl.__version__ == TRL_VERSION else f" (NOT the {TRL_VERSION} the goal names)"
    print(f"trl {trl.__version__}{note}, transformers {transformers.__version__}, torch {torch.__version__}")
    total = args.warmup + args.steps + 1
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        num_params = prepare(directory, num_steps=total)
        print(
            f"model: random-init Qwen2, {num_params / 1e6:.2f}M parameters, fp32, one thread per side; "
            f"{args.repeats} alternating bursts per side of {args.warmup} warm-up + {args.steps} measured steps"
        )
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        results = {(side, t): [] for side in ("ours", "trl") for t in tasks}
        floors, bursts = {t: [] for t in tasks}, {t: [] for t in tasks}
        for _ in range(args.repeats):
            for task in tasks:
                medians = []
                for side in ("ours", "trl"):
                    out = burst(side, task, directory, warmup=args.warmup, steps=args.steps)
                    results[side, task] += out["steps"]
                    floors[task] += out["floor"]
                    medians.append(statistics.median(r["step_s"] for r in out["steps"]))
                bursts[task].append(tuple(medians))
        print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    grpo = f"{PROMPTS_PER_STEP} prompts x {COMPLETIONS_PER_PROMPT} completions x {NEW_TOKENS} new tokens"
    workloads = {"grpo": grpo, "sft": f"{SFT_BATCH} sequences x {SFT_LENGTH} tokens"}
    for task in tasks:
        report(task.upper(), workloads[task], results["ours", task], results["trl", task], bursts[task], floors[task])


if __name__ == "__main__":
    main()
