"""token_advantages dispatches every per-sample estimator, and the loop refuses the ones it cannot run."""

import dataclasses

import numpy as np
import pytest
import torch

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
