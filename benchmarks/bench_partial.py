"""Step time of the RL loop with a long-tailed response-length distribution, with and without partial
rollouts (rl.rollout.partial), measured through `run_rl_training`.

The loop is the real one: run_rl_training with overlap (step n+1 generates while step n trains), the
AsyncRolloutManager, a tiny Qwen2 model trained by rl_step, its weights exported and synced into the
engine every step, and with partial rollouts the engine aborted at the sync or at the first-N cut and
the partial samples continued with rollouts.sync.partial.continue_partials.

The engine is `PacedEngine` below: it decodes every request in parallel at a fixed pace per token (as
a GPU server with continuous batching does, where a request takes as long as its own response,
whatever runs beside it), so the figures are those of an engine that is never the bottleneck in
compute, only in latency. Each response's length is a Pareto draw for its (prompt, row), capped at
max_new_tokens; abort() cuts every running response at the token it has reached (a partial Sample:
status ABORTED, metadata["partial"], the in-process sampler's convention) until resume() or a weight
update. All modes see the same prompts and the same length draws.

Modes:
  wait            tail "wait", no partial rollouts: the baseline. A step waits for its slowest
                  group, and the sync waits for the next batch to finish generating.
  wait partial    the same with rl.rollout.partial: the sync aborts the next batch and continues it.
  first_n         tail "first_n" with over-sampling: the first N complete groups are trained, the
                  tail is cancelled and its prompts restarted next step.
  first_n partial the same with rl.rollout.partial: the tail is cut short and carried as partial
                  groups, continued (not restarted) next step under the new weights.

Figures: a run's time a step (the sum of its step times, less the wait for the first batch, which
every mode spends alike, over the number of steps), median over repeats (modes interleaved within
each repeat); samples trained a second; tokens decoded per token of the batches; partial groups a
step (a group cut short twice counts twice); partial groups restarted a step (a group carried
across so many syncs that its oldest tokens would be more than rl.max_staleness versions old when
trained starts again from its prompt); the fraction of samples dropped as too stale.

Run: OMP_NUM_THREADS=1 uv run python benchmarks/bench_partial.py [steps] [repeats] [max_staleness]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import numpy as np
import trio

from rollouts.backends import build_components
from rollouts.data import DataBuffer
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.loggers import NullLogger
from rollouts.types import (
    CheckpointConfig,
    OptimizerConfig,
    RLConfig,
    RolloutConfig,
    Sample,
    SamplingParams,
    Status,
)

BATCH, GROUP, OVER_SAMPLING, MAX_TOKENS = 16, 4, 1.5, 256
PER_TOKEN_S = 0.004  # decode pace of one response
PARETO_ALPHA, MIN_LEN = 1.2, 16  # heavy tail: P(len > x) ~ (x / 16)^-1.2
VOCAB, BASE, ROW_TOKEN, FILL_TOKEN = 32, 30, 10, 20
PROMPT_LEN, NUM_PROMPTS = 2, 600


def encode(record: dict) -> list[int]:
    return [record["id"] // BASE, record["id"] % BASE]


class PacedEngine:
    """Responses decoded in parallel at PER_TOKEN_S a token, each of its drawn length (see module)."""

    name = "paced"

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths  # [prompt id, row] -> response length
        self.version = 0
        self.decoded = 0
        self._abort = trio.Event()

    def abort(self) -> None:
        self._abort.set()

    def resume(self) -> None:
        if self._abort.is_set():
            self._abort = trio.Event()

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        self.version = weight_version
        self.resume()

    async def weight_version(self) -> int:
        return self.version

    async def health(self) -> bool:
        return True

    async def _row(self, prompt: list[int], row: int | None, params: SamplingParams, out: list, at: int) -> None:
        pid = prompt[0] * BASE + prompt[1]
        done = len(prompt) - PROMPT_LEN  # a continuation: prompt + partial response
        row = row if done == 0 else prompt[PROMPT_LEN] - ROW_TOKEN  # the row is the first response token
        total = int(self.lengths[pid, row])
        budget = min(params.max_new_tokens, total - done)
        version, abort, start = self.version, self._abort, trio.current_time()
        cut = False
        if not abort.is_set():
            with trio.move_on_after(budget * PER_TOKEN_S):
                await abort.wait()
                cut = True
        else:
            cut = True
        num = budget if not cut else max(1, min(budget, int((trio.current_time() - start) / PER_TOKEN_S) + 1))
        cut = cut and num < budget
        self.decoded += num
        response = [ROW_TOKEN + row if done + i == 0 else FILL_TOKEN for i in range(num)]
        finished = done + num == total
        out[at] = Sample(
            tokens=(*prompt, *response),
            num_prompt_tokens=len(prompt),
            loss_mask=(0.0,) * len(prompt) + (1.0,) * num,
            rollout_logprobs=(-1.0,) * num,
            weight_version=version,
            status=Status.ABORTED if cut else Status.COMPLETED if finished else Status.TRUNCATED,
            metadata={"partial": True} if cut else {},
        )

    async def generate(self, prompts, params: SamplingParams) -> list[Sample]:
        out: list = [None] * (len(prompts) * params.n)
        async with trio.open_nursery() as nursery:
            for i, p in enumerate(prompts):
                for r in range(params.n):
                    nursery.start_soon(self._row, list(p), r, params, out, i * params.n + r)
        return out


def run_mode(
    tail: str, partial: bool, steps: int, lengths: np.ndarray, max_staleness: int
) -> tuple[float, float, float, float, float, float]:
    """(time a step, samples trained a second, tokens decoded / tokens generated into batches, mean
    partial groups a step, fraction of samples dropped as too stale, mean partial groups restarted a step)."""
    model = build_tiny_model(
        VOCAB,
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=320,
    )
    config = RLConfig(
        num_steps=steps,
        overlap=True,
        max_staleness=max_staleness,
        max_tokens_per_micro_batch=2048,
        rollout=RolloutConfig(
            batch_size=BATCH,
            samples_per_prompt=GROUP,
            over_sampling_factor=OVER_SAMPLING if tail == "first_n" else 1.0,
            tail=tail,
            partial=partial,
            max_concurrency=256,
            request_timeout_s=60.0,
            sampling=SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.0, seed=0),
        ),
        optimizer=OptimizerConfig(schedule="constant", lr=1e-4),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    components = build_components(model, config.optimizer, num_training_steps=steps)
    engine = PacedEngine(lengths)
    trained = []
    with tempfile.TemporaryDirectory() as run_dir:
        _, history = run_rl_training(
            RLModels(policy=components, engine=engine),
            DataBuffer([{"prompt": f"p{i}", "id": i} for i in range(NUM_PROMPTS)], shuffle=False),
            config,
            reward=lambda s, r: float(s.response_length % 2),
            encode_prompt=encode,
            output=RunOutputs(
                run_dir=run_dir,
                logger=NullLogger(),
                on_step=lambda state, metrics: trained.append(metrics["num_samples"] * metrics["response_length_mean"]),
            ),
        )
    # The run's time a step: every step's time, less the wait for the first batch (the same in every mode).
    per_step = (sum(m["step_time_s"] for m in history) - history[0]["generate_wait_s"]) / steps
    stale = sum(m["num_too_stale"] for m in history) / sum(m["num_samples"] for m in history)
    per_second = sum(m["num_trained"] for m in history) / (per_step * steps)
    partial_groups = statistics.mean(m["groups_partial"] for m in history)
    restarted = statistics.mean(m.get("groups_restarted", 0.0) for m in history)
    return per_step, per_second, engine.decoded / sum(trained), partial_groups, stale, restarted


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    max_staleness = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    rng = np.random.default_rng(0)
    lengths = np.minimum(MIN_LEN * (1.0 + rng.pareto(PARETO_ALPHA, (NUM_PROMPTS, GROUP))), MAX_TOKENS).astype(int)
    print(
        f"workload: {steps} steps x {BATCH} groups x {GROUP} samples, response lengths Pareto(alpha={PARETO_ALPHA}) x "
        f"{MIN_LEN} capped at {MAX_TOKENS} (mean {lengths.mean():.0f}, longest of a group: mean "
        f"{lengths.max(axis=1).mean():.0f}), {PER_TOKEN_S * 1e3:.0f} ms/token, over-sampling {OVER_SAMPLING} "
        f"with first_n; overlap on, max_staleness {max_staleness}; {repeats} repeats, modes interleaved"
    )
    modes = {"wait": ("wait", False), "wait partial": ("wait", True)}
    modes |= {"first_n": ("first_n", False), "first_n partial": ("first_n", True)}
    results: dict[str, list[tuple[float, float, float, float, float, float]]] = {name: [] for name in modes}
    start = time.perf_counter()
    for _ in range(repeats):
        for name, (tail, partial) in modes.items():
            results[name].append(run_mode(tail, partial, steps, lengths, max_staleness))
    step = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
    rate = {name: statistics.median(r[1] for r in runs) for name, runs in results.items()}
    for name, runs in results.items():
        print(
            f"  {name:16s} step time {step[name] * 1e3:6.1f} ms (runs: "
            + ", ".join(f"{r[0] * 1e3:.0f}" for r in runs)
            + f")  trained {rate[name]:5.1f} samples/s  decoded/batched tokens "
            f"{statistics.median(r[2] for r in runs):.2f}  partial groups/step {statistics.median(r[3] for r in runs):4.1f}"
            f"  restarted/step {statistics.median(r[5] for r in runs):4.1f}  too stale {statistics.median(r[4] for r in runs):5.1%}"
        )
    for ours, base in (
        ("wait partial", "wait"),
        ("first_n", "wait"),
        ("first_n partial", "wait"),
        ("first_n partial", "first_n"),
    ):
        print(
            f"  {ours} vs {base}: step time {step[base] / step[ours]:.2f}x shorter, "
            f"trained samples/s {rate[ours] / rate[base]:.2f}x"
        )
    print(f"  ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
