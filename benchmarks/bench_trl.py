"""A GRPO step and an SFT step: rollouts beside TRL's GRPOTrainer and SFTTrainer, same model and work.

Workload (issue 19, target 1): a random-init Qwen2 of about 1M parameters (hidden 128, 4 layers,
head_dim 32, fp32) with a BPE tokenizer trained here; GRPO: 4 prompts x 8 completions x 16 new
tokens (temperature 1, EOS stops), reward = the fraction of digits in the completion's text, one
update per batch, no KL (TRL's default beta = 0); SFT: 32 sequences x 64 tokens, loss on every
token. AdamW, lr 1e-4 constant, grad-norm clip 1.0, one thread (OMP_NUM_THREADS=1,
torch.set_num_threads(1)). Nothing is loaded from a hub: the model and tokenizer are written to a
temporary directory and each side loads them from there.

Each side runs in its own process (a fresh interpreter: no shared caches or allocator state), in
alternating bursts in ABBA order (ours, TRL, TRL, ours, ...) so a load that comes and goes hits both alike; a
burst times `--steps` steps after `--warmup`. Figures are medians over every timed step of every
burst. Ours is split into phases: generate (the in-process sampler), log-probs (the model forward
and the output layer's log-probs), loss+backward, optimizer, and other (rewards, advantages,
packing). TRL's step is timed from on_step_begin to on_step_end (generation included for GRPO).

Measured (--repeats 5 --steps 5, 2 shared cores, load average 1.1 at the start and 3.3 at the
end; wall and CPU time agree, so the run was barely contended):

    GRPO: ours 102.6 ms, TRL 268.8 ms, ratio 2.62x
          ours: generate 41.4, log-probs 21.7, loss+backward 34.5, optimizer 3.2, other 1.9 ms
    SFT:  ours 157.5 ms, TRL 398.1 ms, ratio 2.53x
          ours: log-probs 56.8, loss+backward 96.5, optimizer 3.6, other 0.6 ms

Under heavier load (2 to 3.8) the CPU-time ratios were GRPO 2.70x and SFT 2.49x to 2.57x: SFT sits
at the goal, its step being almost all the model's own forward and backward (matmuls and the
HF modules' elementwise ops), which both sides run alike.

(Before: GRPO 2.11x and SFT 2.37x on an idle machine.) What moved them: GRPO's 32 short
completions train as padded rows instead of one 620-token packed row behind a dense mask
(rollouts-loops choose_layout weighs the two by their arithmetic), fused AdamW on CPU, glibc
keeping freed memory so an SFT step does not re-fault its activations (rollouts-backends
retain_freed_cpu_memory), and fewer ops per decode step (stacked q/k/v and gate/up matmuls).

TRL is not a project dependency; install it for the run only:

    OMP_NUM_THREADS=1 uv run --with trl==1.16.0 python benchmarks/bench_trl.py [--repeats 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL = 2.5
PROMPTS, GROUP, NEW_TOKENS = 4, 8, 16
SFT_BATCH, SFT_LENGTH = 32, 64
LR = 1e-4


def build_model_dir(directory: Path) -> int:
    """Write the tiny model and tokenizer to `directory`; returns the parameter count."""
    from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer, save_model

    corpus = [f"{a} plus {b} is {a + b}. The cat sat on mat number {a * b}." for a in range(60) for b in range(40)]
    tokenizer = build_tokenizer(corpus, vocab_size=64)
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
    save_model(model, tokenizer, directory)
    return sum(p.numel() for p in model.parameters())


def prompt_texts() -> list[str]:
    return [f"{a} plus {b} is" for a, b in ((12, 7), (3, 45), (28, 19), (6, 33))][:PROMPTS]


def digit_fraction(text: str) -> float:
    """The reward: the share of the completion's characters that are digits (0 for an empty one)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def sft_rows(vocab_size: int, num_special: int) -> list[list[int]]:
    """SFT_BATCH rows of SFT_LENGTH token ids, no specials (a fixed generator: both sides get these)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(num_special, vocab_size, (SFT_BATCH, SFT_LENGTH), generator=g).tolist()


def _load(directory: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(directory))


class _PhaseTimer:
    """Wraps functions so that each call's seconds are added to a named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, module, name: str, phase: str, *, nested_in: str | None = None) -> None:
        inner = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
                if nested_in is not None:  # the phase is part of an enclosing one: take it out of that
                    self.seconds[nested_in] = self.seconds.get(nested_in, 0.0) - elapsed

        setattr(module, name, timed)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def _ours_timer() -> _PhaseTimer:
    import rollouts.backends.train.step as train
    import rollouts.loops.rl.step as policy_update
    import rollouts.loops.sft as sft

    timer = _PhaseTimer()
    for module in (policy_update, sft):
        timer.wrap(module, "forward_backward", "loss+backward")
        timer.wrap(module, "optim_step", "optimizer")
    timer.wrap(train, "token_logprobs_of_model", "log-probs", nested_in="loss+backward")
    return timer


def ours_grpo(directory: Path, *, warmup: int, steps: int) -> list[dict[str, float]]:
    import dataclasses

    import trio

    from rollouts.backends import InProcessEngine, build_components
    from rollouts.loops.rl.step import rl_step
    from rollouts.types import AlgorithmConfig, OptimizerConfig, RLConfig, RolloutBatch, RolloutConfig, SamplingParams

    model, tokenizer = _load(directory)
    timer = _ours_timer()
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=NEW_TOKENS, stop_token_ids=(tokenizer.eos_token_id,), n=GROUP
    )
    optimizer = OptimizerConfig(lr=LR, schedule="constant", max_grad_norm=1.0)
    config = RLConfig(
        num_steps=warmup + steps,
        optimizer=optimizer,
        rollout=RolloutConfig(batch_size=PROMPTS, samples_per_prompt=GROUP, sampling=sampling),
        algorithm=AlgorithmConfig(advantage_estimator="grpo"),
    )
    components = build_components(model, optimizer, num_training_steps=warmup + steps)
    engine = InProcessEngine(model, shares_training_model=True, tokenizer=tokenizer)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompt_texts()]
    from rollouts.types import TrainingState

    state, records = TrainingState(), []
    for step in range(warmup + steps):
        timer.take()
        start, cpu_start = time.perf_counter(), time.process_time()
        params = dataclasses.replace(sampling, seed=step)
        samples = trio.run(engine.generate, prompts, params)
        generated = time.perf_counter()
        # The engine decoded each response once (Sample.response), as TRL decodes its completions
        # once for the reward function; group_index is the prompt's (sample i // GROUP) from the sampler.
        samples = [s.with_reward(digit_fraction(s.response)) for s in samples]
        state, _ = rl_step(components, state, RolloutBatch(samples=samples, step=state.step + 1), config)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if step >= warmup:
            phases = {"generate": generated - start, **timer.take()}
            records.append({"total": total, "cpu": cpu, **phases, "other": total - sum(phases.values())})
    return records


def ours_sft(directory: Path, *, warmup: int, steps: int) -> list[dict[str, float]]:
    from rollouts.backends import build_components
    from rollouts.loops.sft import sft_step
    from rollouts.types import OptimizerConfig, Sample, SFTConfig, TrainingState

    model, tokenizer = _load(directory)
    timer = _ours_timer()
    optimizer = OptimizerConfig(lr=LR, schedule="constant", max_grad_norm=1.0)
    config = SFTConfig(
        num_steps=warmup + steps, batch_size=SFT_BATCH, max_length=SFT_LENGTH, optimizer=optimizer, train_on="all"
    )
    components = build_components(model, optimizer, num_training_steps=warmup + steps)
    rows = sft_rows(len(tokenizer), len(tokenizer.all_special_ids))
    samples = [Sample(tokens=row, loss_mask=[1.0] * len(row)) for row in rows]
    state, records = TrainingState(), []
    for step in range(warmup + steps):
        timer.take()
        start, cpu_start = time.perf_counter(), time.process_time()
        state, _ = sft_step(components, state, samples, config)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if step >= warmup:
            phases = timer.take()
            records.append({"total": total, "cpu": cpu, **phases, "other": total - sum(phases.values())})
    return records


class _StepTimes:
    """A transformers TrainerCallback's two hooks: wall and CPU seconds from on_step_begin to on_step_end."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []
        self._start = (0.0, 0.0)

    def on_step_begin(self, *_args, **_kwargs) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, *_args, **_kwargs) -> None:
        wall, cpu = self._start
        self.records.append({"total": time.perf_counter() - wall, "cpu": time.process_time() - cpu})


def _trl_common(out_dir: str, max_steps: int) -> dict:
    return dict(
        output_dir=out_dir,
        max_steps=max_steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )


def _callback(times: _StepTimes):
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            times.on_step_begin()

        def on_step_end(self, *args, **kwargs):
            times.on_step_end()

    return Callback()


def trl_grpo(directory: Path, *, warmup: int, steps: int) -> list[dict[str, float]]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = _load(directory)

    def reward(completions, **_kwargs) -> list[float]:
        return [digit_fraction(c) for c in completions]

    times = _StepTimes()
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            **_trl_common(out_dir, warmup + steps),
            per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP,
            max_completion_length=NEW_TOKENS,
            temperature=1.0,
            beta=0.0,
        )
        dataset = Dataset.from_list([{"prompt": p} for p in prompt_texts()] * (warmup + steps))
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        trainer.add_callback(_callback(times))
        trainer.train()
    return times.records[warmup:]


def trl_sft(directory: Path, *, warmup: int, steps: int) -> list[dict[str, float]]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = _load(directory)
    rows = sft_rows(len(tokenizer), len(tokenizer.all_special_ids))
    times = _StepTimes()
    with tempfile.TemporaryDirectory() as out_dir:
        args = SFTConfig(
            **_trl_common(out_dir, warmup + steps),
            per_device_train_batch_size=SFT_BATCH,
            max_length=SFT_LENGTH,
            packing=False,
        )
        dataset = Dataset.from_list([{"input_ids": row} for row in rows] * (warmup + steps))
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.add_callback(_callback(times))
        trainer.train()
    return times.records[warmup:]


WORKERS = {"ours-grpo": ours_grpo, "trl-grpo": trl_grpo, "ours-sft": ours_sft, "trl-sft": trl_sft}


def burst(worker: str, directory: Path, *, warmup: int, steps: int, timeout_s: float) -> list[dict[str, float]]:
    """One burst in a fresh process: its per-step records."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, __file__, "--worker", worker, "--model-dir", str(directory)]
    command += ["--warmup", str(warmup), "--steps", str(steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{worker} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(records: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in records)


def report(name: str, ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> None:
    ours_s, trl_s = median_of(ours, "total"), median_of(theirs, "total")
    phases = [k for k in ("generate", "log-probs", "loss+backward", "optimizer", "other") if k in ours[0]]
    split = ", ".join(f"{k} {median_of(ours, k) * 1e3:.1f}" for k in phases)
    print(
        f"{name}: ours {ours_s * 1e3:.1f} ms, TRL {trl_s * 1e3:.1f} ms, ratio {trl_s / ours_s:.2f}x (goal >= {GOAL}x)"
    )
    print(f"  ours per phase (medians, ms): {split}")
    ours_cpu, trl_cpu = median_of(ours, "cpu"), median_of(theirs, "cpu")
    print(
        f"  CPU time per step (all threads): ours {ours_cpu * 1e3:.1f} ms, TRL {trl_cpu * 1e3:.1f} ms, ratio {trl_cpu / ours_cpu:.2f}x"
    )
    print(f"  {len(ours)} vs {len(theirs)} timed steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="bursts per side and workload")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per burst")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each burst")
    parser.add_argument("--only", choices=("grpo", "sft"), default=None)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on one burst")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(WORKERS[args.worker](args.model_dir, warmup=args.warmup, steps=args.steps)))
        return
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "model"
        num_params = build_model_dir(directory)
        print(f"model: Qwen2, {num_params / 1e6:.2f}M parameters, fp32; TRL {trl.__version__}; 1 thread")
        print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
        for name in ("grpo", "sft") if args.only is None else (args.only,):
            ours: list[dict[str, float]] = []
            theirs: list[dict[str, float]] = []
            kw = dict(warmup=args.warmup, steps=args.steps, timeout_s=args.timeout_s)
            for repeat in range(args.repeats):
                # ABBA order (ours first, then TRL first): a load that drifts during the run favours neither
                for side in ("ours", "trl") if repeat % 2 == 0 else ("trl", "ours"):
                    (ours if side == "ours" else theirs).extend(burst(f"{side}-{name}", directory, **kw))
            report(name.upper(), ours, theirs)
        print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
