"""ReMax in the loop: the group generator adds a greedy rollout per prompt as the baseline (scored,
not trained on), and the advantages are each sample's reward minus that baseline."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.micro_batches import token_advantages
from rollouts.loops.rollouts.functions import GREEDY_REWARD_KEY, RolloutContext, group_generator
from rollouts.loops.rollouts.scoring import GroupScorer, Reward
from rollouts.types import LossMask, Sample, SamplingParams


def _context():
    return RolloutContext(
        engine=SimpleNamespace(name="stub"),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
        encode_prompt=lambda record: [1, 2],
        tokenizer=None,
        vocab_size=None,
        max_sample_tokens=None,
    )


def _rollout(responses):
    """A rollout function answering from `responses`: 'greedy' at temperature 0, else the list in order."""

    def rollout(record, ctx):
        n = ctx.sampling.n
        texts = ["greedy"] if ctx.sampling.temperature == 0 else responses[:n]
        assert len(texts) == n
        return [
            Sample(tokens=[1, 2, 3], num_prompt_tokens=2, loss_mask=LossMask.prompt_response(2, 1), response=t)
            for t in texts
        ]

    return rollout


def _reward(values):
    return Reward.of(lambda sample, record: values[sample.response])


@settings(max_examples=30, deadline=None)
@given(rewards=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=6), greedy=st.sampled_from([0.0, 1.0]))
def test_the_greedy_reward_is_the_baseline_and_the_greedy_rollout_is_not_trained(rewards, greedy):
    responses = [f"r{i}" for i in range(len(rewards))]
    values = {**dict(zip(responses, rewards, strict=True)), "greedy": greedy}
    generate = group_generator(_rollout(responses), _context(), GroupScorer(_reward(values)), greedy_baseline=True)
    samples = trio.run(lambda: generate({"prompt": "p"}, len(rewards)))
    assert [s.response for s in samples] == responses  # the greedy one is not among them
    assert all(s.metadata[GREEDY_REWARD_KEY] == greedy for s in samples)
    samples = [dataclasses.replace(s, group_index=0) for s in samples]
    masks = {i: np.frombuffer(s.loss_mask.buffer, np.float32) for i, s in enumerate(samples)}
    advantages = token_advantages(samples, ALGORITHMS["remax"], masks=masks)
    for i, r in enumerate(rewards):
        np.testing.assert_allclose(advantages[i], np.full(3, r - greedy, dtype=np.float32))


def test_remax_without_the_greedy_reward_is_refused_naming_the_fix():
    sample = Sample(tokens=[1, 2], num_prompt_tokens=1, loss_mask=[0.0, 1.0], reward=1.0, group_index=0)
    with pytest.raises(ValueError, match="greedy_baseline=True"):
        token_advantages([sample], ALGORITHMS["remax"], masks={0: np.ones(2, np.float32)})


def test_a_failing_greedy_reward_marks_the_group():
    def reward(sample, record):
        if sample.response == "greedy":
            raise RuntimeError("grader down")
        return 1.0

    generate = group_generator(_rollout(["a", "b"]), _context(), GroupScorer(Reward.of(reward)), greedy_baseline=True)
    samples = trio.run(lambda: generate({"prompt": "p"}, 2))
    assert all("greedy baseline" in s.metadata["reward_error"] for s in samples)
