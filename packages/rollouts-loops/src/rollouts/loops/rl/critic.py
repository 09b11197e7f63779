"""PPO's critic in the RL loop: built from the starting model when none is given, saved beside each
policy checkpoint (checkpoints/critic/step_<n>, weights and optimizer) and loaded with it on resume,
so a resumed PPO run continues with the critic it had."""

from __future__ import annotations

from pathlib import Path

from rollouts.backends import CheckpointWriter, TrainingComponents, load_checkpoint, save_checkpoint
from rollouts.backends.train.lora import has_lora
from rollouts.backends.train.value import build_critic
from rollouts.types import RLConfig, TrainingState

__all__ = ["CRITIC_DIR", "default_critic", "load_critic", "save_critic"]

CRITIC_DIR = "critic"
"""The critic's checkpoints: <checkpoints>/critic/step_<n>, beside the policy's step_<n>."""


def default_critic(components: TrainingComponents, config: RLConfig, *, world: int) -> TrainingComponents | None:
    """A critic from the starting policy when the algorithm needs one (GAE), else None."""
    if config.algorithm.advantage_estimator != "gae":
        return None
    if world > 1:
        raise ValueError(
            "under torchrun PPO with a critic needs critic_components on every rank (rollouts.backends."
            "build_critic, sharded like the policy): a sharded policy cannot be copied here"
        )
    if has_lora(components.model):
        raise ValueError("PPO with a critic and LoRA is not supported: give the critic a model of its own path")
    total = config.num_steps * config.algorithm.num_updates_per_batch
    return build_critic(components.model, config.critic.optimizer, num_training_steps=total, device=components.device)


def save_critic(
    critic: TrainingComponents,
    state: TrainingState,
    checkpoints: Path,
    config: RLConfig,
    *,
    writer: CheckpointWriter | None,
) -> None:
    """The critic's checkpoint for this step (before the policy's, so a published policy step has one)."""
    ckpt = config.checkpoint
    save_checkpoint(
        critic,
        state,
        checkpoints / CRITIC_DIR,
        keep_last=ckpt.keep_last,
        save_optimizer=ckpt.save_optimizer,
        writer=writer,
    )


def load_critic(critic: TrainingComponents, policy_checkpoint: Path) -> None:
    """Load the critic saved with `policy_checkpoint` (a ValueError naming it if there is none)."""
    path = policy_checkpoint.parent / CRITIC_DIR / policy_checkpoint.name
    if not (path / "state.json").is_file():
        raise ValueError(f"{policy_checkpoint} has no critic checkpoint beside it ({path}): cannot resume PPO's critic")
    load_checkpoint(critic, path, restore_rng=False)
