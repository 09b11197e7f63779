"""Partial rollouts through the RL loop across a checkpoint: with tail "first_n" the slow tail of each
batch is cut short and carried to the next step as partial groups. A run stopped at a checkpoint that
holds such groups, then resumed, continues them (their tokens span two weight versions), trains
every prompt once, and trains what an uninterrupted run trains. With max_staleness 1 the same groups
would be two versions old when trained: they are restarted from their prompts instead.

The engine is event-driven (no timing): a round's fast requests finish once all its requests have
started, the slow ones (a prompt's first fresh generation, except prompts 0 and 2) only when the
engine is aborted, after CUT tokens; continuations finish at once. Each step's training waits until
the batch generating beside it has been cut, so every cut lands between the same two syncs.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter

import pytest
import trio

from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, Sample, SamplingParams, Status

B, N, OVER, MAX_NEW, CUT = 2, 2, 2.0, 6, 2  # groups a step, samples a group, over-sampling, budget, tokens before a cut
ROUND = math.ceil(B * OVER)  # requests a step's round makes
STEPS, CRASH_AT = 5, 3
FAST = {0, 2}  # prompts whose first generation finishes; every other one waits for the cut
_WAIT_S = 30  # bound on every wait below: a wait that runs out is a failure


def encode(record):
    return [2 + record["id"] // 8, 2 + record["id"] % 8]


def prompt_id(prompt):
    return (prompt[0] - 2) * 8 + (prompt[1] - 2)


class GatedEngine:
    """The engine described in the module docstring; counts fresh generations per prompt id."""

    name = "gated"

    def __init__(self):
        self.version = 0
        self.fresh = Counter()
        self.num_cuts = 0
        self.cut = [threading.Event() for _ in range(4 * STEPS)]  # cut[i]: the i-th cut (1-based) happened
        self._abort = trio.Event()
        self._num_started = 0
        self._round_started: dict[int, trio.Event] = {}
        self._num_waiting = 0

    def abort(self):
        if self._num_waiting:  # a first_n cut (a sync's abort finds nothing running)
            self.num_cuts += 1
            self.cut[self.num_cuts].set()
        self._abort.set()

    def resume(self):
        if self._abort.is_set():
            self._abort = trio.Event()

    async def update_weights_from_disk(self, path, weight_version):
        self.version = weight_version
        self.resume()

    async def weight_version(self):
        return self.version

    async def health(self):
        return True

    async def generate(self, prompts, params):
        self._num_started += 1
        round_started = self._round_started.setdefault((self._num_started - 1) // ROUND, trio.Event())
        if self._num_started % ROUND == 0:
            round_started.set()
        version = self.version
        continuation = len(prompts[0]) > 2
        pid = prompt_id(prompts[0])
        if not continuation:
            self.fresh[pid] += 1
        with trio.fail_after(_WAIT_S):
            if continuation or pid in FAST or self.fresh[pid] > 1:  # a restart is not slow again
                await round_started.wait()
                return [
                    self._sample(p, r, params.max_new_tokens, version, cut=False)
                    for p in prompts
                    for r in range(params.n)
                ]
            self._num_waiting += 1
            try:
                await self._abort.wait()
            finally:
                self._num_waiting -= 1
        return [self._sample(p, r, CUT, version, cut=True) for p in prompts for r in range(params.n)]

    @staticmethod
    def _sample(prompt, row, num, version, *, cut):
        response = [20 + row] + [24] * (num - 1) if len(prompt) == 2 else [24] * num
        return Sample(
            tokens=(*prompt, *response),
            num_prompt_tokens=len(prompt),
            loss_mask=(0.0,) * len(prompt) + (1.0,) * num,
            rollout_logprobs=(-1.0,) * num,
            weight_version=version,
            status=Status.ABORTED if cut else Status.TRUNCATED,
            metadata={"partial": True} if cut else {},
        )


class Crash(Exception):
    pass


def run(run_dir, monkeypatch, *, max_staleness, crash_at=None, resume=False):
    """The loop for STEPS steps (resumed from `run_dir` if `resume`); training is recorded, not done.
    Returns (per-step trained samples, per-step metrics, the engine)."""
    import rollouts.loops.rl.step as step_module
    from rollouts.backends import build_components
    from rollouts.data import DataBuffer
    from rollouts.loops.recipes.tiny import build_tiny_model
    from rollouts.loops.rl.loop import RunOutputs, run_rl_training
    from rollouts.loops.rl.models import RLModels
    from rollouts.loops.run.loggers import NullLogger

    engine, trained, first_step = GatedEngine(), {}, []

    def recording_update(components, state, samples, config, **_):
        step = state.step
        if step == crash_at:
            raise Crash
        first_step.append(step)
        trained[step] = list(samples)
        if step + 1 < STEPS:  # the next batch generates beside this step: wait until its tail is cut
            first_round = 0 if not resume else first_step[0] + 1
            assert engine.cut[step + 2 - first_round].wait(_WAIT_S), f"step {step}: the next batch was never cut"
        return state.after_step(num_tokens=1, num_samples=len(samples)), {}

    monkeypatch.setattr(step_module, "rl_update", recording_update)
    model = build_tiny_model(32, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    config = RLConfig(
        num_steps=STEPS,
        overlap=True,
        max_staleness=max_staleness,
        max_tokens_per_micro_batch=64,
        checkpoint=CheckpointConfig(every_steps=1, keep_last=STEPS),
        rollout=RolloutConfig(
            batch_size=B,
            samples_per_prompt=N,
            over_sampling_factor=OVER,
            tail="first_n",
            partial=True,
            sampling=SamplingParams(max_new_tokens=MAX_NEW, seed=0),
        ),
        optimizer=OptimizerConfig(schedule="constant"),
    )
    metrics = {}
    run_rl_training(
        RLModels(policy=build_components(model, config.optimizer, num_training_steps=STEPS), engine=engine),
        DataBuffer([{"prompt": f"p{i}", "id": i} for i in range(40)], shuffle=False),
        config,
        reward=lambda s, r: float(r["id"] % 2),
        encode_prompt=encode,
        output=RunOutputs(
            run_dir=run_dir,
            logger=NullLogger(),
            resume=resume,
            on_step=lambda state, m: metrics.__setitem__(state.step - 1, m),
        ),
    )
    return trained, metrics, engine


def ids(samples):
    return sorted({s.metadata["id"] for s in samples})


def segments(samples):
    return sorted(
        {
            tuple(map(tuple, s.metadata.get("version_segments", [[s.weight_version, s.response_length]])))
            for s in samples
        }
    )


def saved_manager(run_dir, step):
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "state.json").read_text())["extra"]["manager"]


def test_partial_groups_carried_at_a_checkpoint_are_continued_by_the_resumed_run(tmp_path, monkeypatch):
    straight, straight_metrics, engine = run(tmp_path / "straight", monkeypatch, max_staleness=2)
    # Uninterrupted: step b trains the groups cut in step b-1's batch, continued under the next
    # version: its tokens span versions b-2 and b-1, two versions old at version b (max_staleness 2).
    assert [ids(straight[b]) for b in range(STEPS)] == [[0, 2], [1, 3]] + [[2 * b, 2 * b + 1] for b in range(2, STEPS)]
    assert segments(straight[1]) == [((0, MAX_NEW),)]  # cut and continued before the first sync
    for b in range(2, STEPS):
        assert segments(straight[b]) == [((b - 2, CUT), (b - 1, MAX_NEW - CUT))]
    assert all(m["groups_partial"] == B and m["groups_requested"] == B + B for m in straight_metrics.values())
    assert all(m["groups_restarted"] == 0 and m["num_too_stale"] == 0 for m in straight_metrics.values())
    assert set(engine.fresh.values()) == {1}  # every prompt generated once: continued, never restarted

    run_dir = tmp_path / "crashed"
    with pytest.raises(Crash):
        run(run_dir, monkeypatch, max_staleness=2, crash_at=CRASH_AT)
    carried = saved_manager(run_dir, CRASH_AT)["partial_groups"]  # the checkpoint the resumed run starts from
    assert sorted(g["prompt"]["id"] for g in carried) == [2 * CRASH_AT + 2, 2 * CRASH_AT + 3]
    assert all(s["metadata"]["partial"] and s["weight_version"] == CRASH_AT - 1 for g in carried for s in g["samples"])
    resumed, resumed_metrics, resumed_engine = run(run_dir, monkeypatch, max_staleness=2, resume=True)
    assert sorted(resumed) == list(range(CRASH_AT, STEPS))  # the resumed run trains from the checkpoint on
    # the carried groups, continued (not restarted) under the resumed engine's version
    assert not {g["prompt"]["id"] for g in carried} & set(resumed_engine.fresh)
    assert segments(resumed[CRASH_AT + 1]) == [((CRASH_AT - 1, CUT), (CRASH_AT, MAX_NEW - CUT))]
    for b in range(CRASH_AT, STEPS):  # the same samples as the uninterrupted run, step by step
        assert ids(resumed[b]) == ids(straight[b]) and segments(resumed[b]) == segments(straight[b])
        assert resumed_metrics[b]["groups_partial"] == straight_metrics[b]["groups_partial"]
    # none lost, none trained twice: what was trained plus the groups still carried at the end is every prompt drawn
    all_trained = [i for b in range(STEPS) for i in ids(straight[b])]
    left = [g["prompt"]["id"] for g in saved_manager(tmp_path / "straight", STEPS)["partial_groups"]]
    assert sorted(all_trained + left) == list(range(2 * STEPS + 2)) and len(set(all_trained)) == len(all_trained)
    assert left == [g["prompt"]["id"] for g in saved_manager(run_dir, STEPS)["partial_groups"]]


def test_partial_groups_too_stale_for_their_step_are_restarted_not_trained_stale(tmp_path, monkeypatch):
    trained, metrics, engine = run(tmp_path, monkeypatch, max_staleness=1)
    # the groups cut in step b-1's batch would be two versions old at step b: restarted from their
    # prompts under version b-1 (one version old), from step 2 on
    assert [metrics[b]["groups_restarted"] for b in range(STEPS)] == [0, 0] + [B] * (STEPS - 2)
    assert all(m["num_too_stale"] == 0 and m["num_trained"] == B * N for m in metrics.values())
    for b in range(2, STEPS):
        assert ids(trained[b]) == [2 * b, 2 * b + 1] and segments(trained[b]) == [((b - 1, MAX_NEW),)]
        assert all(b - s.weight_version <= 1 for s in trained[b])
    restarted = {i for i, n in engine.fresh.items() if n == 2}
    assert restarted == set(range(4, 2 * STEPS)) and set(engine.fresh.values()) == {1, 2}
