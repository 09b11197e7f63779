"""RL step time split into generate / train / sync, synchronous vs overlapped, on the demo workload.

Workload: the demo's model (Qwen2, hidden 128, 2 layers, head_dim 32) on 3-digit addition, GRPO,
32 prompts x 8 samples per step, in-process sampler: in the trainer's process (InProcessEngine), in
an engine process of its own (ProcessEngine, whose generation runs beside training instead of
sharing its interpreter lock), or in an engine process that runs the rollout manager too
(RolloutProcess: the trainer's process only receives each step's batch). Every mode uses an engine
with its own copy of the weights (overlap needs one), so synchronous and overlapped differ only in
scheduling. Prompts are encoded as the demo encodes them (`rollouts.data.prompt_encoder`). Reports per-step medians
over the measured steps (the first step is warm-up) and the overlap efficiency:
a mode's step time / max(generate, train) of the synchronous in-process run (1.0 is perfect
overlap). The process engine needs a core of its own: on a machine whose other work takes a core,
its rows measure that work (the load average is printed after each repeat).

Also prints the first batch's gather (CoalescingEngine adaptive vs a flat 10 ms window; skip it
with --no-gather).

The modes alternate `--repeats` times (a load that comes and goes hits all alike); each
figure is the median over every measured step of every repeat, and the efficiency is also given
per repeat (and their median), beside the goal (<= 1.15).

With --gil it also prints how much a thread doing pure Python beside training slows a training step
of the demo model (the trainer process's own work in an overlapped step shares that lock).

    OMP_NUM_THREADS=1 uv run python benchmarks/bench_loops.py [--steps 6] [--threads 1] [--repeats 3] [--no-gather] [--gil]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
from typing import Any

import torch

from rollouts.backends import InProcessEngine, ProcessEngine, build_components
from rollouts.data import DataBuffer, prompt_encoder
from rollouts.loops.app.demo import DemoConfig, demo_model
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.engines.rollout_process import RolloutProcess
from rollouts.loops.recipes.addition import addition_problems
from rollouts.loops.recipes.tiny import build_tokenizer
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.rollouts.rewards import exact_match
from rollouts.loops.run.loggers import NullLogger
from rollouts.types import AlgorithmConfig, CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams


def run(
    mode_overlap: bool,
    *,
    steps: int,
    demo: DemoConfig,
    adaptive: bool = True,
    where: str = "in process",
    threads: int = 1,
) -> list[dict[str, float]]:
    """One run's per-step metrics (the first dropped); `where` the sampler runs: "in process", "process"
    (an engine process) or "rollouts" (an engine process running the rollout manager too)."""
    records = addition_problems(4000, digits=demo.digits, seed=0)
    tokenizer = build_tokenizer((r["prompt"] + r["answer"] for r in records), vocab_size=32)
    model = demo_model(demo, len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = RLConfig(
        num_steps=steps,
        overlap=mode_overlap,
        rollout=RolloutConfig(
            batch_size=demo.rl_prompts_per_step,
            samples_per_prompt=demo.rl_samples_per_prompt,
            max_concurrency=demo.rl_prompts_per_step,
            request_timeout_s=300.0,
            sampling=SamplingParams(
                temperature=1.0, max_new_tokens=demo.digits + 3, stop_token_ids=(tokenizer.eos_token_id,)
            ),
        ),
        algorithm=AlgorithmConfig(),
        optimizer=OptimizerConfig(lr=1e-4, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
        max_tokens_per_micro_batch=4096,
    )
    components = build_components(model, config.optimizer, num_training_steps=steps)
    if where == "rollouts":  # the engine process runs the rollout manager too: it batches the groups itself
        inner: Any = RolloutProcess.from_model(
            model, tokenizer=tokenizer, num_threads=threads, max_prompts_per_call=demo.rl_prompts_per_step
        )
        engine = inner
    else:
        inner = (
            ProcessEngine.from_model(model, tokenizer=tokenizer, num_threads=threads)
            if where == "process"
            else InProcessEngine(copy.deepcopy(model), shares_training_model=False, tokenizer=tokenizer)
        )
        engine = CoalescingEngine(inner, max_prompts_per_call=demo.rl_prompts_per_step, adaptive=adaptive)

    closing = contextlib.closing(inner) if where != "in process" else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as run_dir, closing:
        _, history = run_rl_training(
            RLModels(policy=components, engine=engine),
            DataBuffer(records, seed=0),
            config,
            reward=exact_match,
            encode_prompt=prompt_encoder(tokenizer, chat=False),  # as the demo encodes
            output=RunOutputs(run_dir=run_dir, logger=NullLogger(), resume=False),
        )
    return history[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-gather", dest="gather", action="store_false", help="skip the gather comparison")
    parser.add_argument(
        "--gil", action="store_true", help="also: how much a busy Python thread slows a training step of the model"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = DemoConfig()
    print(
        f"workload: demo RL step, {demo.rl_prompts_per_step} prompts x {demo.rl_samples_per_prompt} samples, "
        f"{args.steps} steps (first dropped), torch threads {args.threads}"
    )
    keys = ("generate_s", "train_s", "sync_s", "generate_wait_s", "step_time_s")
    modes = {  # name -> (overlap, engine: in process, engine process, rollout process)
        "synchronous": (False, "in process"),
        "overlapped": (True, "in process"),
        "synchronous, process engine": (False, "process"),
        "overlapped, process engine": (True, "process"),
        "overlapped, rollout process": (True, "rollouts"),
    }
    steps_of: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    per_repeat: dict[str, list[float]] = {name: [] for name in modes}
    loads: list[float] = []
    for _ in range(args.repeats):
        medians = {}
        for name, (overlap, where) in modes.items():
            history = run(overlap, steps=args.steps, demo=demo, where=where, threads=args.threads)
            steps_of[name] += history
            medians[name] = {k: statistics.median(h[k] for h in history) for k in keys}
        bound = max(medians["synchronous"]["generate_s"], medians["synchronous"]["train_s"])
        for name in modes:
            per_repeat[name].append(medians[name]["step_time_s"] / bound)
        loads.append(os.getloadavg()[0])  # other work on the machine slows some repeats: shown beside them
    results = {}
    for name in modes:
        med = {k: statistics.median(h[k] for h in steps_of[name]) for k in keys}
        results[name] = med
        print(
            f"{name:>27}: step {med['step_time_s']:.3f} s | generate {med['generate_s']:.3f} s "
            f"(waited {med['generate_wait_s']:.3f} s) | train {med['train_s']:.3f} s | sync {med['sync_s']:.3f} s"
        )
    sync = results["synchronous"]
    bound = max(sync["generate_s"], sync["train_s"])
    print(
        f"overlap efficiency: step / max(generate, train) of the synchronous in-process run ({bound:.3f} s); goal <= 1.15"
    )
    for name in modes:
        step = results[name]["step_time_s"]
        print(
            f"{name:>27}: {step:.3f} / {bound:.3f} = {step / bound:.2f}; per repeat: "
            + ", ".join(f"{r:.2f}" for r in per_repeat[name])
            + f" (median {statistics.median(per_repeat[name]):.2f})"
        )
    print(
        "1-minute load average after each repeat: "
        + ", ".join(f"{x:.1f}" for x in loads)
        + f" ({os.cpu_count()} cores)"
    )
    if args.gather:
        print_gather(steps=args.steps, demo=demo)
    if args.gil:
        print_gil_share(demo=demo)


def print_gil_share(*, demo: DemoConfig, busy_ms: float = 20.0, steps: int = 25) -> None:
    # A forward/backward/AdamW step of the demo model on one step's tokens (256 x 20), alone and
    # beside a thread of the same process running `busy_ms` of pure Python per step (what the
    # trainer's bookkeeping does while an overlapped step trains): the interpreter lock they share
    # turns that work into training time. Alternating, medians.
    import threading
    import time

    model = demo_model(demo, 32, eos_token_id=1, pad_token_id=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(2, 32, (256, 20), generator=torch.Generator().manual_seed(0))
    go, stop = threading.Event(), threading.Event()

    def busy() -> None:
        while not stop.is_set():
            if go.wait(0.1):
                go.clear()
                start = time.thread_time()
                while time.thread_time() - start < busy_ms / 1e3:
                    sum(i * i for i in range(200))

    def step(with_busy: bool) -> float:
        start = time.perf_counter()
        if with_busy:
            go.set()
        for rows in tokens.split(128):
            model(input_ids=rows).logits.logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    try:
        for _ in range(3):
            step(False)
        alone, beside = [], []
        for _ in range(steps):
            alone.append(step(False))
            beside.append(step(True))
            time.sleep(busy_ms / 1e3)  # the busy thread's burst is over before the next step alone
    finally:
        stop.set()
        worker.join()
    a, b = statistics.median(alone), statistics.median(beside)
    print(
        f"interpreter lock: a training step {a * 1e3:.1f} ms alone, {b * 1e3:.1f} ms beside {busy_ms:.0f} ms of "
        f"Python in another thread (+{(b - a) * 1e3:.1f} ms: {(b - a) * 1e3 / busy_ms:.2f} ms per ms of that work)"
    )


def print_gather(*, steps: int, demo: DemoConfig) -> None:
    # The first batch's gather: waiting only while callers join vs a flat 10 ms window (synchronous),
    # alternating runs, medians over every measured step of three runs each.
    gen: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for adaptive in (True, False):
            gen[adaptive] += [h["generate_s"] for h in run(False, steps=steps, demo=demo, adaptive=adaptive)]
    adaptive_s, flat_s = statistics.median(gen[True]), statistics.median(gen[False])
    print(
        f"gather: generate {adaptive_s * 1e3:.1f} ms adaptive vs {flat_s * 1e3:.1f} ms with a flat 10 ms window "
        f"(saves {(flat_s - adaptive_s) * 1e3:.1f} ms per step; flat / adaptive = {flat_s / adaptive_s:.2f}x)"
    )


if __name__ == "__main__":
    main()
