"""LLM-as-judge rewards against the fake server's scripted chat: the rubric filled in, scores parsed
and normalized (numbers in bounds, labels), identical calls made once per weight version, the
concurrency bound held, and failures counted per sample by cause."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.loops.rollouts.judge import (
    JudgeLimits,
    JudgeParseError,
    JudgeScale,
    judge_reward,
    parse_score,
    render_rubric,
)
from rollouts.loops.rollouts.scoring import GroupScorer, reward_errors, summarize
from rollouts.sync.fake_server import FakeEngineState, Fault, serve_fake_engine
from rollouts.types import Sample


def _sample(response: str, version: int = 0) -> Sample:
    return Sample(
        prompt="2+2=", response=response, tokens=(1, 2, 3), num_prompt_tokens=2, loss_mask=(0.0, 0.0, 1.0)
    ).replace(weight_version=version)


@settings(max_examples=50, deadline=None)
@given(value=st.integers(0, 10), noise=st.sampled_from(["", "step 1 of 3. ", "I give 99 apples, "]))
def test_the_last_number_in_bounds_is_normalized(value, noise):
    assert parse_score(f"{noise}Score: {value}", JudgeScale()) == pytest.approx(value / 10)


def test_labels_patterns_and_unparseable_replies():
    labels = JudgeScale(labels={"good": 1.0, "bad": 0.0})
    assert parse_score("Not bad at all. Verdict: GOOD", labels) == 1.0
    with pytest.raises(JudgeParseError, match="names none of the labels"):
        parse_score("goodish", labels)
    with pytest.raises(JudgeParseError, match=r"outside \[1, 5\]"):
        parse_score("7", JudgeScale(low=1, high=5))
    with pytest.raises(JudgeParseError, match="no number"):
        parse_score("excellent", JudgeScale())
    assert parse_score("3 out of 10 [[8]]", JudgeScale(pattern=r"\[\[(\d+)\]\]")) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="low < high"):
        JudgeScale(low=3, high=3)
    with pytest.raises(ValueError, match=r"JudgeLimits.max_tokens must be an int >= 1, got 0"):
        JudgeLimits(max_tokens=0)


def test_the_rubric_fills_prompt_response_and_record_fields():
    text = render_rubric("Q: {prompt} A: {response} ref: {answer} {{literal}}", _sample("4"), {"answer": "4"})
    assert text == "Q: 2+2= A: 4 ref: 4 {literal}"
    with pytest.raises(KeyError, match="neither prompt, response nor a record field"):
        render_rubric("{missing} {response}", _sample("4"), {})
    with pytest.raises(ValueError, match="must include"):
        judge_reward("http://127.0.0.1:9", template="no response field")


def _judged(script, samples_by_group, *, later=(), max_concurrency=4, faults=(), **options):
    """Score each group (concurrently), then each of `later`, with one judge on a fake server
    answering with `script`."""
    state = FakeEngineState(chat_reply=script, faults=list(faults))

    async def main():
        async with serve_fake_engine(state) as server:
            reward = judge_reward(
                server.url,
                template="Rate 0-10. Q: {prompt} A: {response}",
                limits=JudgeLimits(max_concurrency=max_concurrency, timeout_s=5, max_retries=1),
                **options,
            )
            scorer = GroupScorer(reward)
            out = [None] * len(samples_by_group)

            async def one(i):
                out[i] = await scorer.score(samples_by_group[i], {"answer": "4"})

            async with trio.open_nursery() as nursery:
                for i in range(len(samples_by_group)):
                    nursery.start_soon(one, i)
            for group in later:
                out.append(await scorer.score(group, {}))
            return out

    return trio.run(main), state


def test_scores_come_back_per_sample_and_identical_calls_are_made_once_per_version():
    def script(messages):
        return "Score: 10" if messages[-1]["content"].endswith("A: 4") else "Score: 2"

    groups = [[_sample("4"), _sample("5"), _sample("4")], [_sample("4"), _sample("5")]]
    scored, state = _judged(script, groups)
    assert [[s.reward for s in g] for g in scored] == [[1.0, 0.2, 1.0], [1.0, 0.2]]
    assert len(state.chat_requests) == 2  # "4" and "5", once each
    scored, state = _judged(script, groups, later=[[_sample("4", version=1)], [_sample("4", version=0)]])
    assert scored[-2][0].reward == 1.0
    assert len(state.chat_requests) == 4  # a new weight version asks again, and drops the older calls


def test_at_most_max_concurrency_calls_are_in_flight():
    in_flight, peak = 0, 0

    def script(messages):
        return "5"

    state = FakeEngineState(chat_reply=script)

    async def main():
        nonlocal in_flight, peak
        async with serve_fake_engine(state) as server:
            reward = judge_reward(server.url, template="{response}", limits=JudgeLimits(max_concurrency=2, timeout_s=5))
            from rollouts.loops.rollouts import judge as judge_module

            real = judge_module.ChatClient.complete

            async def counted(self, messages, **kw):
                nonlocal in_flight, peak
                in_flight += 1
                peak = max(peak, in_flight)
                await trio.sleep(0.05)  # hold the slot so that others queue behind it
                try:
                    return await real(self, messages, **kw)
                finally:
                    in_flight -= 1

            judge_module.ChatClient.complete = counted
            try:
                samples = [_sample(str(i)) for i in range(7)]
                return await reward.fn(samples, [{}] * 7)
            finally:
                judge_module.ChatClient.complete = real

    values = trio.run(main)
    assert values == [0.5] * 7 and peak == 2


def test_failures_are_counted_per_sample_by_cause():
    def script(messages):
        content = messages[-1]["content"]
        if content.endswith("A: crash"):
            raise RuntimeError("judge model crashed")
        return "no idea" if "A: vague" in content else "Score: 7"

    groups = [[_sample("fine"), _sample("vague"), _sample("crash"), _sample("vague 2")]]
    # the first attempt of the first call gets a 503 and is retried
    scored, _ = _judged(script, groups, faults=[Fault(kind="status", path="/v1/chat", status=503)])
    samples = scored[0]
    assert [s.reward for s in samples] == [0.7, 0.0, 0.0, 0.0]
    errors = reward_errors(samples)
    assert len(errors) == 3
    assert errors.count("JudgeParseError: the judge's reply holds no number") == 2
    assert "judge model crashed" in errors[1] and errors[1].startswith("EngineError")
    assert "x2" in summarize(errors)
