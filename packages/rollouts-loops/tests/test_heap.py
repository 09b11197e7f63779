"""The loops keep their startup objects out of full collections for the run, and only for it."""

import gc

import pytest

from rollouts.loops.run.heap import startup_objects_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self


def test_objects_alive_at_the_start_are_frozen_for_the_block_and_given_back_after():
    before = gc.get_freeze_count()  # 0, or a few hundred on Python 3.12 (frozen at its start)
    with startup_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > before
        with startup_objects_frozen():  # nested: the outer block's objects stay frozen
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() >= frozen
        _Node()  # garbage made during the run is still collected
        assert gc.collect() > 0
    assert gc.get_freeze_count() == 0


def test_unfrozen_on_error():
    with pytest.raises(RuntimeError, match="boom"), startup_objects_frozen():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0
