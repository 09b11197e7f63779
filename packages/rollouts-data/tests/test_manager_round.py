"""The rollout manager's round as values: the prompt queue's pure draw/requeue, Counts, settle, the gate."""

import functools

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data.manager_gate import Gate, Hold, TailCut
from rollouts.data.manager_round import (
    Counts,
    PromptQueue,
    add_carry,
    draw,
    requeue,
    restart_stale,
    settle,
    take_carry,
)
from rollouts.types import Sample, Status

FIELDS = ("requested", "kept_new", "carried_over", "filtered", "failed", "aborted", "partial", "restarted", "retries")


def group(tag, *, version=0, partial=False):
    return tuple(
        Sample(
            tokens=[1, 2],
            num_prompt_tokens=1,
            loss_mask=[0, 1],
            weight_version=version,
            status=Status.ABORTED if partial else Status.COMPLETED,
            metadata={"tag": tag, **({"partial": True} if partial else {})},
        )
        for _ in range(2)
    )


positions = st.one_of(st.none(), st.integers(0, 10_000))
pending_entries = st.tuples(positions, st.integers(0, 99))
held_entries = st.builds(
    lambda pos, prompt, version: (pos, prompt, group(prompt, version=version, partial=True)),
    positions,
    st.integers(0, 99),
    st.integers(0, 5),
)
queues = st.builds(
    PromptQueue,
    carry=st.lists(held_entries, max_size=5).map(tuple),
    pending=st.lists(pending_entries, max_size=6).map(tuple),
    partial=st.lists(held_entries, max_size=6).map(tuple),
)
counts = st.builds(Counts, **{name: st.integers(0, 1000) for name in (*FIELDS, "from_carry_over")})


def requeue_all(queue, requests):
    return functools.reduce(requeue, requests, queue)


@settings(max_examples=100, deadline=None)
@given(queue=queues, num=st.integers(1, 15))
def test_draw_then_requeue_restores_the_queue(queue, num):
    requests, num_restarted, rest = draw(queue, num, train_version=None, max_staleness=None)
    assert num_restarted == 0 and len(requests) == min(num, len(queue.partial) + len(queue.pending))
    assert rest.carry == queue.carry  # a draw never touches the carry-over cache
    back = requeue_all(rest, requests)
    # what was drawn goes back behind what was not: the same queue, rotated by the draw
    k = min(num, len(queue.partial))
    assert back.partial == queue.partial[k:] + queue.partial[:k]
    j = min(num - k, len(queue.pending))
    assert back.pending == queue.pending[j:] + queue.pending[:j]
    if num >= len(queue.partial) + len(queue.pending):
        assert back == queue


@settings(max_examples=100, deadline=None)
@given(queue=queues, num=st.integers(1, 15), train_version=st.integers(0, 8), max_staleness=st.integers(0, 3))
def test_draw_serves_partial_groups_first_and_restarts_only_the_too_stale(queue, num, train_version, max_staleness):
    requests, num_restarted, rest = draw(queue, num, train_version=train_version, max_staleness=max_staleness)
    drawn_partial = queue.partial[:num]
    assert [(pos, prompt) for pos, prompt, _ in requests[: len(drawn_partial)]] == [
        (pos, prompt) for pos, prompt, _ in drawn_partial
    ]
    stale = [train_version - g[0].weight_version > max_staleness for _, _, g in drawn_partial]
    assert [r[2] is None for r in requests[: len(drawn_partial)]] == stale and num_restarted == sum(stale)
    assert all(r[2] is None for r in requests[len(drawn_partial) :])  # pending prompts are generated anew
    # nothing lost: the restarted come back as pending prompts (their tokens discarded), the rest as they were
    back = requeue_all(rest, requests)
    assert len(back.partial) + len(back.pending) == len(queue.partial) + len(queue.pending)
    assert len(back.pending) == len(queue.pending) + num_restarted


@settings(max_examples=100, deadline=None)
@given(a=counts, b=counts, c=counts)
def test_counts_add_up_associatively_with_zero_as_identity(a, b, c):
    assert (a + b) + c == a + (b + c)
    assert a + b == b + a and a + Counts() == a
    assert (a + b).to_metadata() == {k: a.to_metadata()[k] + b.to_metadata()[k] for k in a.to_metadata()}


@settings(max_examples=100, deadline=None)
@given(increments=st.lists(st.tuples(st.sampled_from(FIELDS), st.integers(0, 50)), max_size=30))
def test_counts_sum_as_the_mutated_counts_dict_did(increments):
    old = dict.fromkeys(FIELDS, 0)  # the dict a step used to mutate in place, then report as groups_<name>
    old["from_carry_over"] = 0
    for name, amount in increments:
        old[name] += amount
    total = sum((Counts(**{name: amount}) for name, amount in increments), Counts())
    assert total.to_metadata() == {f"groups_{k}": v for k, v in old.items()}
    assert list(total.to_metadata()) == [f"groups_{k}" for k in old]  # the same keys, in the same order


def test_counts_refuse_to_add_anything_else():
    with pytest.raises(TypeError):
        Counts() + {"failed": 1}


@settings(max_examples=100, deadline=None)
@given(
    queue=queues,
    outcomes=st.lists(st.sampled_from(["none", "failed", "partial", "done"]), max_size=10),
    continuing=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_settle_sorts_every_request_once_and_balances(queue, outcomes, continuing):
    requests = [(i, 100 + i, group(i, partial=True) if continuing[i] else None) for i in range(len(outcomes))]
    made = {"failed": lambda i: f"error {i}", "partial": lambda i: group(i, partial=True), "done": lambda i: group(i)}
    results = {i: made[o](i) for i, o in enumerate(outcomes) if o != "none"}
    after, got, errors, finished = settle(queue, requests, results)
    assert errors == [f"error {i}" for i, o in enumerate(outcomes) if o == "failed"]
    assert [r for r, _ in finished] == [r for r, o in zip(requests, outcomes, strict=False) if o == "done"]
    assert got == Counts(failed=outcomes.count("failed"), aborted=outcomes.count("none") + outcomes.count("partial"),
                         partial=outcomes.count("partial"))  # fmt: skip
    requeued = len(after.partial) + len(after.pending) - len(queue.partial) - len(queue.pending)
    assert requeued == got.aborted and got.aborted + got.failed + len(finished) == len(requests)
    assert after.carry == queue.carry


@settings(max_examples=100, deadline=None)
@given(queue=queues, need=st.integers(0, 8), train_version=st.integers(0, 8), max_staleness=st.integers(0, 3))
def test_stale_carried_groups_are_restarted_first_and_none_is_lost(queue, need, train_version, max_staleness):
    fresh, num_stale = restart_stale(queue, train_version, max_staleness)
    assert fresh.pending[num_stale:] == queue.pending  # the stale prompts go first
    assert len(fresh.carry) + num_stale == len(queue.carry)
    taken, rest = take_carry(fresh, need)
    assert taken == [g for _, _, g in fresh.carry[:need]]
    assert add_carry(rest, fresh.carry[:need]).carry == fresh.carry[need:] + fresh.carry[:need]


def gate(**kw):
    return Gate(**{"tail_cut": None, "request_timeout_s": 1.0, "max_pause_s": 5.0, "source": ""} | kw)


@pytest.mark.anyio
async def test_a_round_is_cut_short_by_a_pause_or_a_held_request_only():
    g = gate()
    with anyio.CancelScope() as scope:
        g.begin_round(scope)
        assert not g.holding()
    assert g.end_round() is False
    async with g.paused(None):  # between rounds: the next round is not cut short by it
        assert g.holds == {Hold.PAUSED}
    with anyio.CancelScope() as scope:
        g.begin_round(scope)
        async with g.paused(None):
            assert g.holding()
    assert g.end_round() is True and g.holds == frozenset()


@pytest.mark.anyio
async def test_a_tail_cut_holds_until_the_round_ends_then_resumes_the_engine():
    calls = []
    g = gate(tail_cut=TailCut(interrupt=lambda: calls.append("abort"), resume=lambda: calls.append("resume")))
    with anyio.CancelScope() as scope:
        g.begin_round(scope)
        g.cut_tail()
        assert calls == ["abort"] and g.holding()
    assert g.end_round() is True and calls == ["abort", "resume"] and not g.holds


@pytest.mark.anyio
async def test_an_abort_between_steps_cancels_the_next_round_and_is_taken_once():
    g = gate()
    g.abort()
    with anyio.CancelScope() as scope:
        g.begin_round(scope)
        await anyio.sleep(10)  # cancelled at once by the abort waiting
    assert scope.cancelled_caught and g.end_round() is False
    assert g.take_abort() is True and g.take_abort() is False and not g.aborted


@pytest.mark.anyio
async def test_paused_blocks_do_not_nest():
    g = gate()
    async with g.paused(None):
        with pytest.raises(RuntimeError, match="do not nest"):
            async with g.paused(None):
                pass
