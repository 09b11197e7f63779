"""Rewards as users write them (per sample, batched, sync, async), their error policy, and plugin paths."""

import math
import re
import threading
import time

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.loops.plugins import PluginError, load_object, resolve_function
from rollouts.loops.rollouts.scoring import (
    REWARD_ERROR_KEY,
    GroupScorer,
    Reward,
    RewardError,
    batched_reward,
    check_reward_errors,
    summarize,
)
from rollouts.types import Sample

_HUNG_BOUND_S = 2.0  # the hung call's bound; the other calls end far inside it, however loaded the machine


def _group(n=3):
    return [
        Sample(tokens=(1, 2, 3 + i), num_prompt_tokens=2, loss_mask=(0.0, 0.0, 1.0), response=str(i)) for i in range(n)
    ]


def _score(reward, samples=None, record=None):
    return trio.run(GroupScorer(reward).score, samples or _group(), record or {"answer": "1"})


def test_per_sample_sync_and_async_rewards_see_the_sample_and_its_record():
    def sync(sample, record):
        return float(sample.response == record["answer"])

    async def async_(sample, record):
        await trio.sleep(0)
        return float(sample.response == record["answer"])

    for fn in (sync, async_):
        assert [s.reward for s in _score(Reward.of(fn))] == [0.0, 1.0, 0.0]


def test_a_batched_reward_is_called_once_per_group():
    calls = []

    @batched_reward
    def lengths(samples, records):
        calls.append(len(samples))
        assert len(records) == len(samples)
        return [len(s.tokens) for s in samples]

    assert [s.reward for s in _score(Reward.of(lengths))] == [3.0, 3.0, 3.0] and calls == [3]


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda s, r: 1 / 0, "ZeroDivisionError: division by zero"),
        (lambda s, r: "1.0", "not a number"),
        (lambda s, r: None, "not a number"),
        (lambda s, r: math.nan, "not a finite number"),
        (lambda s, r: math.inf, "not a finite number"),
    ],
)
def test_reward_errors_score_zero_and_say_why(bad, message):
    scored = _score(Reward(fn=bad, on_error="zero"))
    assert [s.reward for s in scored] == [0.0] * 3
    assert all(message in s.metadata[REWARD_ERROR_KEY] for s in scored)
    good = Sample(tokens=(1, 2, 3), num_prompt_tokens=2, loss_mask=(0.0, 0.0, 1.0)).with_reward(1.0)
    check_reward_errors([*scored, good], "zero")  # counted, not raised: one reward of the step is left
    with pytest.raises(RewardError, match=f"3 of 4 rewards failed; first: .*{message.split(':')[0]}"):
        check_reward_errors([*scored, good], "raise")
    for on_error in ("raise", "zero"):  # a step whose every reward failed stops whatever the policy
        with pytest.raises(RewardError, match=f"3 of 3 rewards failed; first: .*{message.split(':')[0]}"):
            check_reward_errors(scored, on_error)


def test_a_hung_reward_times_out_within_its_bound():
    async def hangs(sample, record):
        await trio.sleep(3600)

    scored = _score(Reward(fn=hangs, timeout_s=0.05, on_error="zero"), samples=_group(1))
    assert "took longer than 0.05 s" in scored[0].metadata[REWARD_ERROR_KEY]


def test_a_groups_sync_rewards_run_in_one_worker_thread():
    threads = []

    def reward(sample, record):
        threads.append(threading.get_ident())
        return float(sample.response)

    assert [s.reward for s in _score(Reward.of(reward), samples=_group(4))] == [0.0, 1.0, 2.0, 3.0]
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()


def test_a_hung_sync_reward_fails_its_sample_and_the_others_still_score():
    release = threading.Event()

    def reward(sample, record):
        if sample.response == "1":
            release.wait(3600)  # hangs until the test ends: abandoned at its bound
        return float(sample.response)

    try:
        scored = _score(Reward(fn=reward, timeout_s=_HUNG_BOUND_S, on_error="zero"), samples=_group(4))
    finally:
        release.set()
    assert [s.reward for s in scored] == [0.0, 0.0, 2.0, 3.0]
    assert [REWARD_ERROR_KEY in s.metadata for s in scored] == [False, True, False, False]
    assert f"took longer than {_HUNG_BOUND_S} s" in scored[1].metadata[REWARD_ERROR_KEY]


def test_a_sync_reward_may_return_an_awaitable():
    async def later(value):
        await trio.sleep(0)
        return value

    assert [s.reward for s in _score(Reward.of(lambda s, r: later(float(s.response))))] == [0.0, 1.0, 2.0]


def test_a_batched_reward_of_the_wrong_length_fails_the_group():
    scored = _score(Reward(fn=lambda s, r: [1.0], batched=True, on_error="zero"))
    assert all("must return 3 numbers" in s.metadata[REWARD_ERROR_KEY] for s in scored)


@settings(deadline=None, max_examples=50)
@given(
    st.lists(
        st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.text(max_size=3), st.none()),
        min_size=1,
        max_size=6,
    )
)
def test_every_value_becomes_a_finite_reward_or_a_named_error(values):
    samples = _group(len(values))
    it = iter(values)
    scored = _score(Reward(fn=lambda s, r: next(it), on_error="zero"), samples=samples)
    for value, sample in zip(values, scored, strict=True):
        ok = isinstance(value, float) and math.isfinite(value)
        assert sample.reward == (value if ok else 0.0)
        assert (REWARD_ERROR_KEY in sample.metadata) == (not ok)


def test_summarize_counts_the_most_common_errors_first():
    assert summarize(["A: x", "B: y", "A: x"]) == "'A: x' x2; 'B: y' x1"


def test_plugins_resolve_by_module_path_and_by_file(tmp_path):
    assert load_object("math:sqrt", key="k") is math.sqrt
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def reward(sample, record):\n    return 1.0\nNOT_A_FUNCTION = 3\n")
    fn = resolve_function(f"{plugin}:reward", key="reward.fn", num_positional=2, what="reward(sample, record)")
    assert fn(None, None) == 1.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:f", "module 'no_such_module_xyz' does not import: ModuleNotFoundError"),
        ("math:no_such_name", "'math' has no 'no_such_name'"),
        ("math", "must look like 'package.module:name'"),
        ("/nope/reward.py:f", "no such file"),
        ("FILE:NOT_A_FUNCTION", "is a int, not a function"),
        ("FILE:one_arg", "cannot be called with 2 positional argument(s)"),
        ("BROKEN:f", "does not import: SyntaxError"),
    ],
)
def test_bad_plugin_specs_name_the_key_and_the_reason(tmp_path, spec, message):
    (tmp_path / "plugin.py").write_text("NOT_A_FUNCTION = 3\ndef one_arg(sample):\n    return 0.0\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    spec = spec.replace("FILE", str(tmp_path / "plugin.py")).replace("BROKEN", str(tmp_path / "broken.py"))
    with pytest.raises(PluginError) as info:
        resolve_function(spec, key="reward.fn", num_positional=2, what="reward(sample, record)")
    assert str(info.value).startswith("reward.fn") and message in str(info.value)


# ---------------------------------------------------------------- evaluation metrics

from itertools import combinations  # noqa: E402

from rollouts.loops.evaluation import group_metrics, majority_correct, pass_at_k  # noqa: E402


@settings(deadline=None, max_examples=200)
@given(st.lists(st.booleans(), min_size=1, max_size=8), st.data())
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(correct, data):
    n, c = len(correct), sum(correct)
    k = data.draw(st.integers(1, n))
    subsets = list(combinations(correct, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def _scored(responses, rewards):
    return [
        Sample(tokens=(1, 2), num_prompt_tokens=1, loss_mask=(0.0, 1.0), response=r, reward=w)
        for r, w in zip(responses, rewards, strict=True)
    ]


def test_group_metrics_on_hand_made_groups():
    groups = [
        _scored(["7", "7", "8", "9"], [1.0, 1.0, 0.0, 0.0]),  # majority right, 2 of 4 right
        _scored(["1", "2", "2", "5"], [0.0, 0.0, 0.0, 1.0]),  # majority wrong, 1 of 4 right
        _scored(["0", "0", "0", "0"], [0.0, 0.0, 0.0, 0.0]),  # all wrong
    ]
    metrics = group_metrics(groups)
    assert metrics["eval_reward_mean"] == pytest.approx(3 / 12)
    assert metrics["eval_pass@1"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)
    assert metrics["eval_pass@4"] == pytest.approx(2 / 3)
    assert metrics["eval_maj@4"] == pytest.approx(1 / 3)
    assert majority_correct(_scored(["a", "b"], [1.0, 0.0]))  # a tie goes to the first seen
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def _score_groups(reward, groups, *, rounds=2):
    """Score `groups` concurrently (as a batched engine call hands them back together), `rounds`
    times in one trio run; the scored groups of each round."""
    scorer = GroupScorer(reward)

    async def main():
        out = []
        for _ in range(rounds):
            scored = [None] * len(groups)

            async def one(i, scored=scored):
                scored[i] = await scorer.score(groups[i], {"answer": "1"})

            async with trio.open_nursery() as nursery:
                for i in range(len(groups)):
                    nursery.start_soon(one, i)
            out.append(scored)
        return out

    return trio.run(main)


def test_cheap_sync_rewards_of_groups_finishing_together_share_one_thread_hop():
    threads = []

    def reward(sample, record):
        threads.append(threading.get_ident())
        return float(sample.response)

    groups = [_group(4) for _ in range(16)]
    first, second = _score_groups(Reward.of(reward), groups)
    for scored in (first, second):
        assert [[s.reward for s in g] for g in scored] == [[0.0, 1.0, 2.0, 3.0]] * 16
    # before a cost is measured each group has a thread; once the calls are known cheap, one does all
    assert len(set(threads[64:])) == 1 and threads[64] != threading.get_ident()


def test_slow_sync_rewards_of_groups_finishing_together_run_in_parallel_threads():
    active, most = [0], [0]
    lock = threading.Lock()
    release = threading.Event()

    def reward(sample, record):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        release.wait(0.02)  # a slow grader (a sandbox, a judge): 20 ms a call
        with lock:
            active[0] -= 1
        return float(sample.response)

    groups = [_group(2) for _ in range(6)]
    _, second = _score_groups(Reward.of(reward), groups)
    assert [[s.reward for s in g] for g in second] == [[0.0, 1.0]] * 6
    assert most[0] >= 2  # measured slow: the batch is split over threads, not run in one


def test_groups_that_joined_a_cancelled_leader_score_their_own_samples():
    entered, gate = threading.Event(), threading.Event()

    def reward(sample, record):
        entered.set()
        gate.wait(5.0)  # the leader's batch is cancelled while it waits here
        return float(sample.response)

    scorer = GroupScorer(Reward(fn=reward, timeout_s=_HUNG_BOUND_S * 5))

    async def main():
        followers = [None, None]

        async def follower(i):
            followers[i] = await scorer.score(_group(2), {"answer": "1"})

        async with trio.open_nursery() as nursery:
            leader = trio.CancelScope()

            async def lead():
                with leader:
                    await scorer.score(_group(2), {"answer": "1"})

            nursery.start_soon(lead)
            await trio.sleep(0)  # the leader is gathering
            for i in range(2):
                nursery.start_soon(follower, i)
            await trio.to_thread.run_sync(entered.wait, 5.0)
            leader.cancel()
            gate.set()
        return followers, leader.cancelled_caught

    followers, cancelled = trio.run(main)
    assert cancelled
    assert [[s.reward for s in g] for g in followers] == [[0.0, 1.0], [0.0, 1.0]]


# ---------------------------------------------------------------- hostile plug-ins


def test_fifty_hung_sync_rewards_leave_the_loops_threads_free():
    release = threading.Event()

    def hangs(sample, record):
        release.wait(3600)  # hangs until the test ends: abandoned at its bound
        return 1.0

    async def main():
        scorer = GroupScorer(Reward(fn=hangs, timeout_s=0.02, on_error="zero", max_threads=4))
        scored = await scorer.score(_group(50), {"answer": "1"})
        with trio.fail_after(10):  # the training step's hop to a thread: served, not queued behind hung rewards
            assert await trio.to_thread.run_sync(lambda: "trained") == "trained"
        return scored

    try:
        scored = trio.run(main)
    finally:
        release.set()
    errors = [s.metadata[REWARD_ERROR_KEY] for s in scored]
    assert sum("took longer than 0.02 s" in e for e in errors) == 4  # one per thread of the pool
    assert all("all 4 threads for user code are held by calls abandoned" in e for e in errors[4:])


def test_an_async_reward_that_blocks_the_event_loop_is_named():
    async def blocks(sample, record):
        time.sleep(0.1)  # noqa: ASYNC251 (the mistake under test)
        return 1.0

    scored = _score(Reward(fn=blocks, timeout_s=0.01, on_error="zero"), samples=_group(1))
    assert "blocks took" in scored[0].metadata[REWARD_ERROR_KEY]
    assert "must not block; make it sync" in scored[0].metadata[REWARD_ERROR_KEY]


def test_a_reward_editing_its_record_in_place_changes_no_other_samples_grading():
    def pops(sample, record):
        answers = record["answers"]
        answer = answers.pop()  # the mistake under test: edits the record it was handed
        record["seen"] = True
        return float(sample.response == answer)

    async def async_pops(sample, record):
        return pops(sample, record)

    @batched_reward
    def batched_pops(samples, records):
        return [pops(s, r) for s, r in zip(samples, records, strict=True)]

    for fn in (pops, async_pops, batched_pops):
        record = {"answers": ["0", "1"]}
        scored = _score(Reward.of(fn, on_error="zero"), samples=_group(2), record=record)
        assert [s.reward for s in scored] == [0.0, 1.0], fn
        assert record == {"answers": ["0", "1"]}


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0], (1.0, 2.0, 3.0), np.array([1.0, 2.0, 3.0])])
def test_a_batched_reward_may_return_any_one_dimensional_sequence(values):
    scored = _score(Reward(fn=lambda s, r: values, batched=True))
    assert [s.reward for s in scored] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "values, message",
    [
        (np.ones((3, 1)), r"1-D sequence of 3 numbers .* got ndarray of shape \(3, 1\)"),
        ({"a": 1.0}, "1-D sequence of 3 numbers .* got dict of length 1"),
        ("123", "1-D sequence of 3 numbers .* got str of length 3"),
        (np.ones(2), "must return 3 numbers, one per sample, got ndarray of length 2"),
    ],
)
def test_a_batched_reward_of_another_shape_is_refused_naming_its_type_and_length(values, message):
    scored = _score(Reward(fn=lambda s, r: values, batched=True, on_error="zero"))
    assert all(re.search(message, s.metadata[REWARD_ERROR_KEY]) for s in scored), scored[0].metadata
