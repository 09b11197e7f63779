"""The vLLM reward-model client against the fake server: scores in order across batches, bad
answers named, bad input refused, and every call bounded."""

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.sync._http import EngineError
from rollouts.sync.fake_server import FakeEngineState, Fault, serve_fake_engine
from rollouts.sync.reward_client import VLLMRewardModel


@settings(max_examples=15, deadline=None)
@given(
    inputs=st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=9), min_size=1, max_size=12),
    batch=st.integers(1, 5),
)
def test_scores_come_back_in_order_whatever_the_batching(inputs, batch):
    async def main():
        state = FakeEngineState()
        async with serve_fake_engine(state) as server:
            async with VLLMRewardModel(server.url, max_batch=batch, timeout_s=10) as rm:
                return await rm.score(inputs), state

    scores, state = trio.run(main)
    assert scores == [state.score(ids) for ids in inputs]


def test_a_failing_server_and_a_bad_answer_are_named():
    async def main():
        state = FakeEngineState(faults=[Fault(kind="status", path="/classify", status=500, times=5)])
        async with serve_fake_engine(state) as server:
            async with VLLMRewardModel(server.url, max_retries=1, timeout_s=5) as rm:
                with pytest.raises(EngineError, match="HTTP 500"):
                    await rm.score([[1, 2]])
                with pytest.raises(ValueError, match="non-empty"):
                    await rm.score([[]])
            rm = VLLMRewardModel(server.url)
            with pytest.raises(EngineError, match="expected 2 results"):
                rm._parse({"data": [{"index": 0, "probs": [0.5]}]}, 2)
            with pytest.raises(EngineError, match="num_labels = 1"):
                rm._parse({"data": [{"index": 0, "probs": [0.5, 0.5]}]}, 1)
            await rm.aclose()

    trio.run(main)


def test_a_server_that_never_answers_is_bounded_by_the_timeout():
    async def main():
        state = FakeEngineState(faults=[Fault(kind="delay", path="/classify", delay_s=30.0, times=5)])
        async with serve_fake_engine(state) as server:
            async with VLLMRewardModel(server.url, max_retries=0, timeout_s=0.5) as rm:
                with trio.fail_after(10):
                    with pytest.raises(EngineError, match="timed out after 0.5 s"):
                        await rm.score([[1, 2, 3]])

    trio.run(main)
