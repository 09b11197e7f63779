"""RLConfig's checks of the responses per prompt: one key counts, and peer baselines need peers."""

import pytest

from rollouts.types import AlgorithmConfig, RLConfig, RolloutConfig, SamplingParams, from_dict
from rollouts.types.configs import PEER_BASELINE_ESTIMATORS


def test_sampling_n_that_disagrees_with_samples_per_prompt_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"sampling\.n must be 1 \(unset\) or equal samples_per_prompt \(4\).*got 8"):
        RolloutConfig(samples_per_prompt=4, sampling=SamplingParams(n=8))
    with pytest.raises(ValueError, match=r"RLConfig\.rollout: RolloutConfig\.sampling\.n"):
        from_dict(RLConfig, {"rollout": {"samples_per_prompt": 4, "sampling": {"n": 2}}})


@pytest.mark.parametrize("n", [1, 4])
def test_sampling_n_left_at_1_or_equal_to_samples_per_prompt_is_accepted(n):
    assert RolloutConfig(samples_per_prompt=4, sampling=SamplingParams(n=n)).samples_per_prompt == 4


@pytest.mark.parametrize("estimator", sorted(PEER_BASELINE_ESTIMATORS))
def test_a_peer_baseline_with_one_response_per_prompt_is_refused(estimator):
    """A group of one has no other responses to compare with: GRPO's advantage is 0 or the raw reward."""
    with pytest.raises(ValueError, match=rf"samples_per_prompt must be >= 2 with '{estimator}' advantages.*got 1"):
        RLConfig(
            rollout=RolloutConfig(samples_per_prompt=1),
            algorithm=AlgorithmConfig(advantage_estimator=estimator),
        )


def test_the_default_grpo_config_from_a_mapping_refuses_one_response_per_prompt():
    with pytest.raises(ValueError, match=r"RLConfig\.rollout\.samples_per_prompt"):
        from_dict(RLConfig, {"rollout": {"samples_per_prompt": 1}})


@pytest.mark.parametrize("estimator", ["reinforce_pp", "remax", "gae"])
def test_estimators_with_their_own_baseline_take_one_response_per_prompt(estimator):
    config = RLConfig(
        rollout=RolloutConfig(samples_per_prompt=1), algorithm=AlgorithmConfig(advantage_estimator=estimator)
    )
    assert config.rollout.samples_per_prompt == 1


def test_correct_min_reward_defaults_to_1_and_must_be_finite():
    assert RLConfig().correct_min_reward == 1.0
    assert RLConfig(correct_min_reward=0.5).correct_min_reward == 0.5
    with pytest.raises(ValueError, match="correct_min_reward"):
        RLConfig(correct_min_reward=float("nan"))
