"""Pure rollout functions and filters."""

import numpy as np
import pytest

from rollouts.data.filters import (
    check_min_reward,
    check_reasonable_length,
    check_response_diversity,
    check_reward_nonzero_std,
    combine_filters,
)
from rollouts.data.rollout import apply_sample_transforms, assign_groups, batch_metadata, group_samples
from rollouts.types import Sample, Status


def _s(reward=None, response=(5,), status=Status.COMPLETED):
    return Sample(
        tokens=[1, *response], num_prompt_tokens=1, loss_mask=[0] + [1] * len(response), reward=reward, status=status
    )


def test_assign_and_group_round_trip():
    groups = [[_s(), _s()], [_s()], [_s(), _s(), _s()]]
    assigned = assign_groups(groups)
    flat = [s for g in assigned for s in g]
    assert [s.group_index for s in flat] == [0, 0, 1, 2, 2, 2] and [s.index for s in flat] == list(range(6))
    assert group_samples(flat) == assigned
    with pytest.raises(ValueError, match="group_index is None"):
        group_samples([_s()])


def test_apply_sample_transforms_scores_then_filters():
    groups = assign_groups([[_s(response=(5,)), _s(response=(6,))], [_s(response=(5,)), _s(response=(5,))]])
    out = apply_sample_transforms(
        groups, reward_fn=lambda s, record: float(s.tokens[-1] == 6), filter_fn=check_reward_nonzero_std()
    )
    assert len(out.kept) == 1 and [s.reward for s in out.kept[0]] == [0.0, 1.0]
    assert out.filter_reasons == {"reward_std_zero": 2} and out.num_filtered == 2
    with pytest.raises(ValueError, match="finite"):
        apply_sample_transforms(groups, reward_fn=lambda s, record: float("nan"))
    with pytest.raises(TypeError, match="reason string"):
        apply_sample_transforms(groups, filter_fn=lambda g: 3)


def test_filters_and_combinator():
    g_same = [_s(1.0), _s(1.0)]
    g_diff = [_s(0.0, response=(5,)), _s(1.0, response=(6, 7))]
    assert check_reward_nonzero_std()(g_same) == "reward_std_zero" and check_reward_nonzero_std()(g_diff) is None
    assert check_min_reward(0.5)(g_diff) is None and check_min_reward(2.0)(g_diff) == "min_reward"
    assert check_response_diversity(min_unique_fraction=1.0)(g_same) == "low_diversity"
    assert check_response_diversity(min_unique_fraction=1.0)(g_diff) is None
    assert check_reasonable_length(min_response_tokens=2)(g_diff) == "too_short"
    truncated = [_s(0.0, status=Status.TRUNCATED), _s(1.0)]
    assert check_reasonable_length(max_truncated_fraction=0.4)(truncated) == "too_many_truncated"
    assert check_reasonable_length(max_truncated_fraction=0.5)(truncated) is None
    both = combine_filters(check_min_reward(2.0), check_reward_nonzero_std())
    assert both(g_same) == "min_reward" and combine_filters(check_reward_nonzero_std())(g_diff) is None
    with pytest.raises(ValueError, match="no reward"):
        check_reward_nonzero_std()([_s()])
    with pytest.raises(TypeError, match="callable"):
        combine_filters(3)


def test_batch_metadata_matches_numpy():
    samples = [
        _s(r, response=tuple(range(5, 5 + k)), status=st)
        for r, k, st in [(0.0, 1, Status.COMPLETED), (1.0, 3, Status.TRUNCATED), (0.5, 2, Status.COMPLETED)]
    ]
    md = batch_metadata(samples)
    assert md["reward_mean"] == pytest.approx(np.mean([0, 1, 0.5]))
    assert md["reward_std"] == pytest.approx(np.std([0, 1, 0.5]))
    assert md["response_length_mean"] == 2.0 and md["response_length_max"] == 3.0
    assert md["truncation_rate"] == pytest.approx(1 / 3) and md["num_loss_tokens"] == 6
