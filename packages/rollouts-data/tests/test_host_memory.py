"""HostMemoryPool: memory is reused only once no array views it, never while one does."""

import gc
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data import pack_samples
from rollouts.data.host_memory import HostMemoryPool, carve
from rollouts.types import Sample


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_take_gives_aligned_writable_uninitialised_bytes():
    pool = HostMemoryPool()
    block = pool.take(1000)
    assert block.dtype == np.uint8 and block.shape == (1000,) and block.flags.writeable
    assert _address(block) % 64 == 0
    block[:] = 7
    assert pool.allocations == 1 and pool.free_bytes == 0


def test_memory_returns_only_when_every_view_is_gone():
    pool = HostMemoryPool()
    block = pool.take(4096)
    first = _address(block)
    view = block[100:200].view(np.int32).reshape(5, 5)
    exported = memoryview(block[8:16])
    del block
    assert pool.free_bytes == 0  # views are alive: nothing returned
    other = pool.take(4096)
    assert _address(other) != first and pool.allocations == 2
    del view
    assert pool.free_bytes == 0  # the memoryview still sees it
    exported.release()
    del exported
    assert pool.free_bytes > 0
    again = pool.take(4096)
    assert _address(again) == first and pool.allocations == 2  # reused, not allocated


def test_free_memory_is_bounded_and_clear_gives_it_back():
    pool = HostMemoryPool(max_free_bytes=3 << 20)
    blocks = [pool.take(1 << 20) for _ in range(5)]  # 1 MiB each (the smallest allocation)
    del blocks
    gc.collect()
    assert pool.free_bytes == 3 << 20  # the two longest-unused were dropped
    pool.clear()
    assert pool.free_bytes == 0
    nothing = HostMemoryPool(max_free_bytes=0)
    block = nothing.take(10)
    del block
    assert nothing.free_bytes == 0


def test_memory_is_reused_only_within_its_size_class():
    """A small array never takes (and holds) a step's large block: allocations are powers of two
    from 1 MiB, and a free one serves requests of its own class only."""
    pool = HostMemoryPool()
    small, big = pool.take(1 << 20), pool.take(4 << 20)
    small_address, big_address = _address(small), _address(big)
    del small, big
    tiny = pool.take(1000)
    assert _address(tiny) == small_address
    assert _address(pool.take((3 << 20) + 1)) == big_address  # 4 MiB class
    assert pool.allocations == 2
    pool.take(100)  # the 1 MiB block is taken (tiny is alive): a new one, not the 4 MiB block
    assert pool.allocations == 3


def test_a_collection_inside_the_pool_never_deadlocks():
    """The last view of an array may die in a garbage collection that starts anywhere, inside the
    pool's own locked section included: returning its memory must not wait for that lock."""
    pool = HostMemoryPool()
    finished = threading.Event()

    def churn() -> None:
        thresholds = gc.get_threshold()
        try:
            for threshold in range(1, 12):  # collections start at every point of take, in turn
                gc.set_threshold(threshold, 1, 1)
                for i in range(400):
                    block = pool.take(10)
                    cycle: list = [block]
                    cycle.append(cycle)  # only the collector frees it
                    del block, cycle
                    _ = [[] for _ in range(i % 13)]
                    pool.take(10)
        finally:
            gc.set_threshold(*thresholds)
        finished.set()

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert finished.is_set(), "the pool deadlocked on its own lock"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="nbytes"):
        HostMemoryPool().take(bad)
    with pytest.raises(ValueError, match="max_free_bytes"):
        HostMemoryPool(max_free_bytes=bad)


def test_carve_cuts_aligned_arrays_of_each_dtype():
    pool = HostMemoryPool()
    a, b, c = carve(pool, [(3, np.dtype(np.int64)), (5, np.dtype(np.float32)), (0, np.dtype(np.int64))])
    assert (a.dtype, a.shape, b.dtype, b.shape, c.shape) == (np.int64, (3,), np.float32, (5,), (0,))
    assert _address(b) % 64 == 0 and _address(b) - _address(a) == 64
    a[:] = -1
    b[:] = 2.5
    assert a.tolist() == [-1, -1, -1] and b.tolist() == [2.5] * 5
    del a, c
    assert pool.free_bytes == 0  # b keeps the whole allocation taken


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(st.tuples(st.just("take"), st.integers(0, 3 << 20)), st.tuples(st.just("drop"), st.integers(0, 50))),
        max_size=40,
    ),
    max_free=st.sampled_from([0, 2 << 20, 1 << 30]),
)
def test_live_arrays_never_share_memory(ops, max_free):
    """Whatever the order of takes and drops, every live array keeps the bytes written into it,
    and the pool never holds more than its bound."""
    pool = HostMemoryPool(max_free_bytes=max_free)
    live: list[tuple[np.ndarray, int]] = []
    for stamp, (op, value) in enumerate(ops):
        if op == "take":
            block = pool.take(value)
            block[:] = stamp % 251
            live.append((block[: value // 2 + 1] if value else block, stamp % 251))  # a view only
            del block
        elif live:
            live.pop(value % len(live))
        for view, expected in live:
            assert not view.size or (view.min() == expected and view.max() == expected)
        assert pool.free_bytes <= max_free


def test_threads_taking_and_dropping_never_share_memory():
    pool = HostMemoryPool()
    errors: list[str] = []

    def work(k: int) -> None:
        for i in range(200):
            block = pool.take(1000 + 100 * k)
            block[:] = k
            if block.min() != k or block.max() != k:
                errors.append(f"thread {k} round {i} saw another thread's bytes")
            del block

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors


def _assert_same(micro_batches, others):
    for a, b in zip(micro_batches, others, strict=True):
        for name, array in a.token_arrays().items():
            np.testing.assert_array_equal(array, b.get(name), err_msg=name)
        np.testing.assert_array_equal(a.cu_seqlens, b.cu_seqlens)
        np.testing.assert_array_equal(a.sample_indices, b.sample_indices)


def test_packing_into_reused_memory_writes_every_entry():
    """A step packed into memory that held garbage equals the same step packed into fresh memory."""
    samples = [
        Sample(
            tokens=list(range(1, n + 1)),
            num_prompt_tokens=2,
            loss_mask=[0.0, 0.0] + [1.0] * (n - 2),
            advantage=0.5,
            rollout_logprobs=[-0.25] * (n - 2),
        )
        for n in (5, 9, 17, 3, 30)
    ]
    pool = HostMemoryPool()
    fresh = pack_samples(samples, max_tokens=32, pad_to_multiple_of=8, memory=HostMemoryPool())
    garbage = pool.take(1 << 20)
    garbage[:] = 0xFF  # int64 -1, float32 NaN
    del garbage
    reused = pack_samples(samples, max_tokens=32, pad_to_multiple_of=8, memory=pool)
    assert pool.allocations == 1
    _assert_same(fresh, reused)
    del reused
    pack_samples(samples, max_tokens=32, memory=pool)
    assert pool.allocations == 1  # the previous step's memory, reused
