"""What counts as correct in `accuracy`, pass@k and maj@k: reward >= RLConfig.correct_min_reward
(1.0 by default) or the sample's metadata["correct"] flag, never merely a reward above 0."""

import pytest
import trio

from rollouts.loops.evaluation import evaluate_groups, group_metrics, is_correct, majority_correct
from rollouts.loops.rl.step import rl_step, rollout_metrics
from rollouts.loops.rollouts.scoring import Reward
from rollouts.types import RLConfig, RolloutBatch, Sample, SamplingParams, TrainingState


def _sample(response, reward, **metadata):
    return Sample(
        tokens=(1, 2), num_prompt_tokens=1, loss_mask=(0.0, 1.0), response=response, reward=reward, metadata=metadata
    )


def _partial_credit(responses, answer):
    """1.0 for the right number, 0.2 for any other number: the reward shape that looked all right."""
    return [_sample(r, 1.0 if r == answer else 0.2) for r in responses]


def test_partial_credit_is_not_correct_in_pass_at_k():
    groups = [
        _partial_credit(["3", "4"], "7"),  # no answer right
        _partial_credit(["7", "5"], "7"),  # one of two right
    ]
    metrics = group_metrics(groups)
    assert metrics["eval_reward_mean"] == pytest.approx((0.2 + 0.2 + 1.0 + 0.2) / 4)
    assert metrics["eval_pass@1"] == pytest.approx((0 + 1 / 2) / 2)  # the fraction right, not 1
    assert metrics["eval_pass@2"] == pytest.approx(1 / 2)
    greedy = group_metrics([_partial_credit(["3"], "7"), _partial_credit(["9"], "8")])
    assert greedy["eval_pass@1"] == 0.0


def test_the_threshold_moves_what_counts():
    groups = [_partial_credit(["3", "4"], "7"), _partial_credit(["7", "5"], "7")]
    assert group_metrics(groups, min_reward=0.2)["eval_pass@1"] == 1.0
    assert group_metrics(groups, min_reward=1.5)["eval_pass@1"] == 0.0
    assert not is_correct(_sample("x", None))  # unscored is never correct


def test_maj_at_k_counts_the_majority_answer_only_when_it_is_correct():
    wrong_majority = _partial_credit(["5", "5", "7"], "7")  # two votes for a wrong number, one right
    assert not majority_correct(wrong_majority)
    assert majority_correct(wrong_majority, min_reward=0.2)
    metrics = group_metrics([wrong_majority, _partial_credit(["7", "7", "5"], "7")])
    assert metrics["eval_maj@3"] == pytest.approx(1 / 2)
    assert metrics["eval_pass@3"] == 1.0


def test_a_correct_flag_in_metadata_decides_over_the_threshold():
    assert is_correct(_sample("7", 0.3, correct=True))
    assert not is_correct(_sample("7", 5.0, correct=False))
    with pytest.raises(TypeError, match=r"metadata\['correct'\] must be a bool, got 1"):
        is_correct(_sample("7", 1.0, correct=1))


def test_step_accuracy_is_the_fraction_at_or_above_the_threshold():
    samples = tuple(s.replace(group_index=0, index=i) for i, s in enumerate(_partial_credit(["3", "7", "4", "5"], "7")))
    batch = RolloutBatch(samples=samples)
    metrics = rollout_metrics(batch, TrainingState())
    assert metrics["reward_mean"] == pytest.approx(0.4)
    assert metrics["accuracy"] == pytest.approx(1 / 4)  # reward > 0 gave 1.0
    assert rollout_metrics(batch, TrainingState(), min_reward=0.2)["accuracy"] == 1.0


def test_rl_step_reads_the_threshold_from_the_config():
    """Samples too stale to train: rl_step only measures them, with RLConfig.correct_min_reward."""
    samples = tuple(
        s.replace(group_index=0, index=i, weight_version=0)
        for i, s in enumerate(_partial_credit(["3", "7", "4", "5"], "7"))
    )
    state = TrainingState(weight_version=5)
    for threshold, accuracy in [(1.0, 0.25), (0.2, 1.0)]:
        config = RLConfig(correct_min_reward=threshold)
        _, metrics = rl_step(None, state, RolloutBatch(samples=samples), config)  # type: ignore[arg-type]
        assert metrics["num_trained"] == 0
        assert metrics["accuracy"] == accuracy


class _Engine:
    """Answers every prompt with the same responses, in order."""

    def __init__(self, responses):
        self.responses = responses

    async def generate(self, prompts, params):
        return [
            Sample(tokens=(1, 2), num_prompt_tokens=1, loss_mask=(0.0, 1.0), response=self.responses[i % params.n])
            for i in range(len(prompts) * params.n)
        ]


def test_an_evaluation_with_partial_credit_reports_the_fraction_right():
    def reward(sample, record):
        if sample.response == record["answer"]:
            return 1.0
        return 0.2 if sample.response.isdigit() else 0.0

    records = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "2+2=", "answer": "4"}]
    groups = trio.run(
        evaluate_groups,
        _Engine(["7", "9"]),
        records,
        lambda r: [1],
        Reward.of(reward),
        SamplingParams(n=2, temperature=1.0),
    )
    metrics = group_metrics(groups)
    assert metrics["eval_pass@1"] == pytest.approx(1 / 4)  # one right answer of four responses
    assert metrics["eval_pass@2"] == pytest.approx(1 / 2)
    assert metrics["eval_maj@2"] == pytest.approx(1 / 2)  # ties: the first seen, "7"
