"""PPO with a critic in the RL loop: it raises a toy reward, the critic learns (its loss falls), it is
checkpointed beside the policy and a resumed run gets it back exactly, and under torchrun one must be
given."""

import dataclasses

import pytest
import torch
from test_rl_loop import _run, starts_with_seven

from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.rl.models import default_critic
from rollouts.types import CriticConfig, OptimizerConfig


def test_ppo_with_a_critic_raises_a_toy_reward(tiny_run_inputs, tmp_path):
    state, history = _run(
        tiny_run_inputs, tmp_path, algorithm=ALGORITHMS["ppo"], steps=12, lr=1e-2, reward=starts_with_seven
    )
    rewards = [h["reward_mean"] for h in history]
    assert state.step == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    assert all("vf_loss" in h and "value_mean" in h for h in history)
    assert (tmp_path / "checkpoints" / "critic" / "step_12" / "state.json").is_file()


def test_a_resumed_ppo_run_continues_with_the_critic_it_saved(tiny_run_inputs, tmp_path, monkeypatch):
    import rollouts.loops.rl.state as critic_module

    algorithm = ALGORITHMS["ppo"]
    _run(tiny_run_inputs, tmp_path, algorithm=algorithm, steps=2, lr=1e-2, reward=starts_with_seven)
    from rollouts.backends import read_weights

    saved = read_weights(tmp_path / "checkpoints" / "critic" / "step_2")
    loaded = {}
    load = critic_module.load_critic

    def recording_load(critic, path):
        load(critic, path)
        loaded.update({k: v.detach().clone() for k, v in critic.model.state_dict().items()})

    monkeypatch.setattr("rollouts.loops.rl.state.load_critic", recording_load)
    _run(tiny_run_inputs, tmp_path, algorithm=algorithm, steps=3, lr=1e-2, reward=starts_with_seven, resume=True)
    assert loaded and all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_under_torchrun_a_critic_must_be_given(tiny_run_inputs):
    from rollouts.backends import build_components
    from rollouts.types import RLConfig

    components = build_components(tiny_run_inputs / "model", OptimizerConfig(), num_training_steps=1)
    config = RLConfig(algorithm=ALGORITHMS["ppo"], critic=CriticConfig())
    with pytest.raises(ValueError, match="critic_components"):
        default_critic(components, config, world=2)
    assert default_critic(components, dataclasses.replace(config, algorithm=ALGORITHMS["grpo"]), world=2) is None
    with pytest.raises(ValueError, match="clip_range"):
        CriticConfig(clip_range=0.0)
