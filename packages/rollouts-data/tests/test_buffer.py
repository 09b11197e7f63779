"""DataBuffer and its functional twin: determinism, epochs, exact resume."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data import DataBuffer
from rollouts.data.buffer import BufferState, epoch_order, next_prompts


def _naive_stream(num_prompts: int, seed: int, total: int) -> list[int]:
    """Reference: concatenate whole shuffled epochs and take the first `total` entries."""
    out: list[int] = []
    epoch = 0
    while len(out) < total:
        state = BufferState(num_prompts=num_prompts, seed=seed)
        out.extend(int(i) for i in epoch_order(state, epoch))
        epoch += 1
    return out[:total]


@settings(max_examples=40, deadline=None)
@given(
    num_prompts=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=8),
)
def test_stream_equals_concatenated_epochs(num_prompts, seed, sizes):
    buf = DataBuffer(list(range(num_prompts)), seed=seed)
    got = [p for n in sizes for p in buf.get_prompts(n)]
    assert got == _naive_stream(num_prompts, seed, sum(sizes))
    assert buf.epoch_id * num_prompts + buf.sample_offset == sum(sizes)
    assert 0 <= buf.sample_offset < num_prompts


@settings(max_examples=40, deadline=None)
@given(
    num_prompts=st.integers(1, 10),
    seed=st.integers(0, 1000),
    sizes=st.lists(st.integers(1, 15), min_size=2, max_size=8),
    split=st.integers(0, 7),
)
def test_resume_at_any_split_equals_uninterrupted(num_prompts, seed, sizes, split):
    split = min(split, len(sizes) - 1)
    prompts = [f"p{i}" for i in range(num_prompts)]
    uninterrupted = DataBuffer(prompts, seed=seed)
    expected = [uninterrupted.get_prompts(n) for n in sizes]

    first = DataBuffer(prompts, seed=seed)
    got = [first.get_prompts(n) for n in sizes[:split]]
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = DataBuffer(prompts, seed=12345)  # the seed comes from the saved state
    resumed.load_state_dict(saved)
    got += [resumed.get_prompts(n) for n in sizes[split:]]
    assert got == expected


@settings(max_examples=30, deadline=None)
@given(num_prompts=st.integers(1, 10), seed=st.integers(0, 1000), sizes=st.lists(st.integers(1, 15), max_size=6))
def test_functional_twin_agrees_with_class(num_prompts, seed, sizes):
    prompts = list(range(num_prompts))
    buf = DataBuffer(prompts, seed=seed)
    state = BufferState(num_prompts=num_prompts, seed=seed)
    for n in sizes:
        batch, state = next_prompts(prompts, state, n)
        assert batch == buf.get_prompts(n)
        assert state == buf.state


def test_resume_exactly_at_epoch_boundary_continues_with_next_epoch():
    prompts = list(range(8))
    buf = DataBuffer(prompts, seed=3)
    first_epoch = buf.get_prompts(8)
    assert sorted(first_epoch) == prompts
    state = buf.state_dict()
    assert state["epoch_id"] == 1 and state["sample_offset"] == 0
    resumed = DataBuffer(prompts, seed=3)
    resumed.load_state_dict(state)
    nxt = resumed.get_prompts(8)
    assert sorted(nxt) == prompts  # a full epoch, not zero prompts
    assert nxt == buf.get_prompts(8)
    assert nxt != first_epoch  # a fresh shuffle (fixed seed: these two permutations differ)


def test_epochs_are_permutations_and_seeds_differ():
    a = DataBuffer(list(range(50)), seed=1).get_prompts(100)
    b = DataBuffer(list(range(50)), seed=2).get_prompts(100)
    assert sorted(a[:50]) == sorted(a[50:]) == list(range(50))
    assert a != b


def test_no_shuffle_keeps_file_order():
    buf = DataBuffer(["a", "b", "c"], shuffle=False)
    assert buf.get_prompts(5) == ("a", "b", "c", "a", "b")


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="empty"):
        DataBuffer([])
    buf = DataBuffer([1, 2, 3])
    with pytest.raises(ValueError, match="n must be"):
        buf.get_prompts(0)
    other = DataBuffer([1, 2])
    with pytest.raises(ValueError, match="different prompts"):
        other.load_state_dict(buf.state_dict())
    with pytest.raises(ValueError, match="sample_offset"):
        BufferState(num_prompts=3, sample_offset=3)
    with pytest.raises(ValueError, match="keys"):
        buf.load_state_dict({"seed": 0})
    with pytest.raises(ValueError, match="different prompt list"):
        next_prompts([1, 2], BufferState(num_prompts=3), 1)
