"""token_advantages dispatches every per-sample estimator, counts a split episode once in its group's
baseline, and the loop refuses the ones it cannot run."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data.rollout import EPISODE_KEY
from rollouts.loops.micro_batches import token_advantages
from rollouts.losses import gpg_advantages, group_advantages, passk_advantages, rloo_advantages
from rollouts.types import AlgorithmConfig, Sample

_REFERENCE = {
    "grpo": lambda r, g: group_advantages(r, g),
    "rloo": rloo_advantages,
    "gpg": gpg_advantages,
    "grpo_passk": lambda r, g: passk_advantages(r, g, scale="group"),
}


@pytest.mark.parametrize("estimator", sorted(_REFERENCE))
def test_each_estimator_reaches_the_loss_as_its_own_advantages(estimator):
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    samples = [
        Sample(tokens=(1, 2, 3), num_prompt_tokens=1, loss_mask=(0.0, 1.0, 1.0), reward=r, group_index=i // 4)
        for i, r in enumerate(rewards)
    ]
    masks = {i: np.array([0.0, 1.0, 1.0], dtype=np.float32) for i in range(len(samples))}
    algorithm = dataclasses.replace(AlgorithmConfig(), advantage_estimator=estimator)
    got = token_advantages(samples, algorithm, masks=masks)
    want = _REFERENCE[estimator](torch.tensor(rewards), torch.arange(8) // 4)
    for i, value in enumerate(want.tolist()):
        np.testing.assert_allclose(got[i], np.full(3, value, dtype=np.float32), rtol=1e-6, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(
    estimator=st.sampled_from(sorted(_REFERENCE)),
    groups=st.lists(
        st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.integers(1, 3)), min_size=2, max_size=4),
        min_size=1,
        max_size=3,
    ),
)
def test_a_split_episode_counts_once_in_its_groups_baseline(estimator, groups):
    """Episodes (reward, pieces): split into `pieces` Samples sharing an episode id, every piece gets
    the advantage the episode has unsplit, and the group's other episodes keep theirs."""
    whole, split, episode_of = [], [], []
    for g, episodes in enumerate(groups):
        for e, (reward, pieces) in enumerate(episodes):
            whole.append(Sample(tokens=(1, 2), num_prompt_tokens=1, loss_mask=(0.0, 1.0), reward=reward, group_index=g))
            for p in range(pieces):  # ids repeat across groups: an id names an episode within its group
                meta = {EPISODE_KEY: f"e{e}", "episode_piece": p}
                split.append(
                    Sample(
                        tokens=(1, 2),
                        num_prompt_tokens=1,
                        loss_mask=(0.0, 1.0),
                        reward=reward,
                        group_index=g,
                        metadata=meta,
                    )
                )
                episode_of.append(len(whole) - 1)
    algorithm = dataclasses.replace(AlgorithmConfig(), advantage_estimator=estimator)
    mask = np.array([0.0, 1.0], dtype=np.float32)
    want = token_advantages(whole, algorithm, masks=dict.fromkeys(range(len(whole)), mask))
    got = token_advantages(split, algorithm, masks=dict.fromkeys(range(len(split)), mask))
    for i, e in enumerate(episode_of):
        np.testing.assert_array_equal(got[i], want[e])  # the same arithmetic on the same episodes: bit for bit
