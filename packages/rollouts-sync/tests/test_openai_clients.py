"""The prompt log-probs and chat clients against the fake server: log-probs aligned with the fake
model's own, in order across batches; chat replies, retries of a failing server, and bad answers named."""

import math

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.sync import ChatClient, EngineError, PromptLogprobsClient
from rollouts.sync.fake_server import FakeEngineState, Fault, serve_fake_engine


@settings(max_examples=15, deadline=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=9), min_size=1, max_size=10),
    batch=st.integers(1, 4),
)
def test_prompt_logprobs_are_the_models_own_in_order_whatever_the_batching(sequences, batch):
    async def main():
        state = FakeEngineState()
        async with serve_fake_engine(state) as server:
            async with PromptLogprobsClient(server.url, max_batch=batch, timeout_s=10) as client:
                return await client.sequence_logprobs(sequences), state

    out, state = trio.run(main)
    assert [len(row) for row in out] == [len(ids) for ids in sequences]
    for ids, row in zip(sequences, out, strict=True):
        assert row[0] == 0.0
        for t in range(1, len(ids)):
            assert math.isclose(row[t], float(state.logprobs_V(ids[:t])[ids[t]]), rel_tol=1e-12)


def test_prompt_logprobs_refuse_bad_input_and_name_bad_answers():
    async def main():
        async with serve_fake_engine() as server:
            async with PromptLogprobsClient(server.url, timeout_s=5) as client:
                with pytest.raises(ValueError, match="non-empty"):
                    await client.sequence_logprobs([[1], []])
                with pytest.raises(EngineError, match="is this a vLLM server"):
                    client._parse({"choices": [{"index": 0, "text": ""}]}, [[1, 2]])
                with pytest.raises(EngineError, match="no log-prob of token 2 at position 1"):
                    client._parse(
                        {"choices": [{"index": 0, "prompt_logprobs": [None, {"3": {"logprob": -1}}]}]}, [[1, 2]]
                    )
                with pytest.raises(EngineError, match="2 prompt log-probs for a sequence of 3"):
                    client._row([None, {}], [1, 2, 3])

    trio.run(main)


def test_chat_replies_come_from_the_script_and_a_failing_server_is_retried_then_named():
    def script(messages):
        if "boom" in messages[-1]["content"]:
            raise RuntimeError("judge crashed")
        return f"echo {messages[-1]['content']}"

    async def main():
        state = FakeEngineState(chat_reply=script, faults=[Fault(kind="status", path="/v1/chat", status=503)])
        async with serve_fake_engine(state) as server:
            async with ChatClient(server.url, max_retries=1, timeout_s=5) as client:
                # the first attempt gets the injected 503, the retry the reply
                assert await client.complete([{"role": "user", "content": "hi"}]) == "echo hi"
                with pytest.raises(EngineError, match=r"HTTP 500.*judge crashed"):
                    await client.complete([{"role": "user", "content": "boom"}])
        return state

    state = trio.run(main)
    assert state.chat_requests[0] == [{"role": "user", "content": "hi"}]
    assert ("POST", "/v1/chat/completions") in state.calls


def test_a_chat_server_that_never_answers_is_bounded_by_the_timeout():
    async def main():
        state = FakeEngineState(faults=[Fault(kind="delay", path="/v1/chat", delay_s=30, times=3)])
        async with serve_fake_engine(state) as server:
            async with ChatClient(server.url, model="fake-model", max_retries=0, timeout_s=0.5) as client:
                with trio.fail_after(10), pytest.raises(EngineError, match="timed out"):
                    await client.complete([{"role": "user", "content": "x"}])

    trio.run(main)
