"""CPU bookkeeping of one RL step at a real batch size, without a model (issue target: < 0.2 s).

Workload: 1024 samples (128 prompts x 8) of 4096 tokens (512 prompt + 3584 response), synthetic.
Phases, each what the loop does outside the model for one step:
  build      Samples from engine output (tokens, loss mask, rollout log-probs), validated
  rewards    a reward and a group index per sample (frozen replace)
  advantage  GRPO group advantages (rollouts.losses) and the per-sample replace
  pack       packed micro-batches of 16384 tokens with step-wide counts (rollouts.data)
  unpack     per-token values scattered back to samples
  send       rank 0: the batch's bytes (rollouts.types.wire) copied into the tensor it broadcasts
  receive    the other ranks: the received tensor's bytes back to a batch
Rank 0 runs build, rewards, send, then (like every rank) advantage, pack, unpack; the other ranks
run receive, advantage, pack, unpack. The step's bookkeeping is the larger of the two totals.
Also prints the bytes a Sample's per-token storage (token ids + loss mask + rollout log-probs)
takes per token. Medians of --repeats runs after one warm-up step (the process's first large
allocations are slower), with the objects alive at startup frozen out of Python's full
collections, as the loops do (rollouts.loops.run.heap).

    OMP_NUM_THREADS=1 uv run python benchmarks/bench_bookkeeping.py [--samples 1024] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np
import torch

from rollouts.data import plan_micro_batches, unpack_values
from rollouts.loops.run.distributed import staged
from rollouts.loops.run.heap import startup_objects_frozen
from rollouts.losses import group_advantages
from rollouts.types import LossMask, RolloutBatch, Sample, Status
from rollouts.types.wire import batch_from_bytes, batch_to_parts

GOAL_S = 0.2


def _engine_output(num_samples: int, num_tokens: int, prompt: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 151_000, size=(num_samples, num_tokens)), -rng.random((num_samples, num_tokens - prompt))


class _Clock:
    """Wall and this thread's CPU seconds per phase: on a shared machine the wall time carries other
    processes' load, the CPU time only this work's."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        wall, cpu = time.perf_counter(), time.thread_time()
        yield
        self.wall[phase] = self.wall.get(phase, 0.0) + time.perf_counter() - wall
        self.cpu[phase] = self.cpu.get(phase, 0.0) + time.thread_time() - cpu


def _totals(times: dict[str, float]) -> dict[str, float]:
    every_rank = times["advantage"] + times["pack"] + times["unpack"]
    times["total rank 0"] = times["build"] + times["rewards"] + times["send"] + every_rank
    times["total others"] = times["receive"] + every_rank
    times["total"] = max(times["total rank 0"], times["total others"])
    return times


def one_step(engine_output, *, prompt: int, group: int) -> tuple[dict[str, float], dict[str, float]]:
    """(wall seconds, CPU seconds) per phase of one step."""
    clock = _Clock()
    samples = []
    for ids_array, lps_array in zip(*engine_output, strict=True):
        # What an engine client holds after parsing one JSON response: Python lists (made outside
        # the timed region), alive while that response's Sample is built.
        ids, lps = ids_array.tolist(), lps_array.tolist()
        with clock("build"):
            samples.append(
                Sample(
                    tokens=ids,
                    num_prompt_tokens=prompt,
                    loss_mask=LossMask.prompt_response(prompt, len(ids) - prompt),
                    rollout_logprobs=lps,
                    status=Status.COMPLETED,
                )
            )
    with clock("rewards"):
        samples = [s.replace(reward=float(i % 3 == 0), group_index=i // group) for i, s in enumerate(samples)]
    with clock("advantage"):
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        groups = torch.tensor([s.group_index for s in samples])
        advantages = group_advantages(rewards, groups).tolist()
        samples = [s.with_advantage(a) for s, a in zip(samples, advantages, strict=True)]
    with clock("pack"):
        plan = plan_micro_batches(samples, max_tokens=16_384)
    with clock("unpack"):
        unpack_values(list(plan.micro_batches), [mb.loss_mask for mb in plan.micro_batches])
    with clock("send"):  # rank 0: the batch's parts copied once into the tensor it broadcasts
        staging = torch.from_numpy(staged(*batch_to_parts(RolloutBatch(samples=tuple(samples)))))
    with clock("receive"):  # the other ranks: the received tensor's bytes, then the batch
        batch_from_bytes(staging.numpy().tobytes())
    return _totals(clock.wall), _totals(clock.cpu)


def token_bytes(sample: Sample) -> float:
    """Bytes per token of a Sample's per-token storage, all of it: token ids, loss mask and rollout
    log-probs (each array object, its packed bytes, a typed view where one is held; the mask's runs)."""
    total = 0
    for packed in (sample.tokens, sample.rollout_logprobs):
        if packed is not None:
            total += sys.getsizeof(packed) + sys.getsizeof(packed.to_bytes()) + sys.getsizeof(packed.buffer)
    mask = sample.loss_mask
    total += sys.getsizeof(mask) + sys.getsizeof(mask.runs) + sum(sys.getsizeof(r) for r in mask.runs)
    total += sum(sys.getsizeof(r[2]) for r in mask.runs) + sys.getsizeof(mask._starts)  # noqa: SLF001
    return total / len(sample.tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    outputs = _engine_output(args.samples, args.tokens, args.prompt)
    with startup_objects_frozen():
        one_step(outputs, prompt=args.prompt, group=args.group)  # warm-up
        runs = [one_step(outputs, prompt=args.prompt, group=args.group) for _ in range(args.repeats)]
    wall = {k: statistics.median(r[0][k] for r in runs) for k in runs[0][0]}
    cpu = {k: statistics.median(r[1][k] for r in runs) for k in runs[0][1]}
    print(f"workload: {args.samples} samples x {args.tokens} tokens, {args.repeats} repeats (medians), 1 thread")
    print("machine load (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"  {'phase':<13} {'wall s':>8} {'CPU s':>8}")
    for key in wall:
        print(f"  {key:<13} {wall[key]:8.3f} {cpu[key]:8.3f}")
    for name, med in (("wall", wall), ("CPU", cpu)):
        verdict = "met" if med["total"] < GOAL_S else "NOT met"
        print(f"CPU bookkeeping per step, {name} seconds: {med['total']:.3f} s (goal < {GOAL_S} s: {verdict})")
    ids, lps = outputs[0][0].tolist(), outputs[1][0].tolist()
    mask = [0.0] * args.prompt + [1.0] * (args.tokens - args.prompt)
    sample = Sample(tokens=ids, num_prompt_tokens=args.prompt, loss_mask=mask, rollout_logprobs=lps)
    per_token = token_bytes(sample)
    print(
        f"Sample per-token storage (ids + loss mask + rollout log-probs): {per_token:.2f} bytes per token "
        f"(goal <= 8: {'met' if per_token <= 8 else 'NOT met'}; tuples before: ~36 for the ids alone)"
    )


if __name__ == "__main__":
    main()
