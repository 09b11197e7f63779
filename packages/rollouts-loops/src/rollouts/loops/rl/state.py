"""What an RL run carries from one step to the next, and its checkpoints.

Models: the policy (weights, optimizer, scheduler, RNG) in the checkpoint, with a moving KL
reference beside its weights (reference.safetensors) and PPO's critic in a checkpoint of its own
(checkpoints/critic/step_<n>, written first, so a published policy step always has its critic).

Parts: the rest of the run's state, each an object with `state_dict()` / `load_state_dict()` in
one dict (`run_parts`) that `save` writes into state.json's extra and `restore` loads back, under
their names: "buffer" (the prompt stream), "manager" (the rollout manager's carry-over and partial
groups), "pending_batch" (the batch generated ahead, with overlap) and "kl_controller" (the
adaptive KL coefficient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from rollouts.backends import CheckpointWriter, TrainingComponents, load_checkpoint, save_checkpoint
from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.loops.engines.rollout_process import RemoteRolloutManager
from rollouts.loops.rl.generation import shared_metadata, sync_engine
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.distributed import global_sum, rank_world
from rollouts.loops.run.run_dir import CHECKPOINTS_DIR, Stateful, load_parts, parts_state, resume_if_possible
from rollouts.losses import KLControllerState, adaptive_kl_update
from rollouts.types import ReferenceConfig, RLConfig, RolloutBatch, Sample, TrainingState

__all__ = [
    "CRITIC_DIR",
    "REFERENCE_MODEL",
    "KLController",
    "PendingBatch",
    "RunFiles",
    "restore",
    "run_parts",
    "save",
    "update_reference",
]

REFERENCE_MODEL = "reference"
"""The name a moving reference's weights have in a checkpoint (reference.safetensors)."""
CRITIC_DIR = "critic"
"""The critic's checkpoints: <checkpoints>/critic/step_<n>, beside the policy's step_<n>."""

Manager = AsyncRolloutManager | RemoteRolloutManager


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFiles:
    """Where a run's files go."""

    run_dir: Path
    writer: CheckpointWriter
    """Finishes checkpoints and deletes old exports off the loop's path; closed when the run ends."""
    tokenizer: Any = None
    """Saved with each checkpoint, so a checkpoint loads as a model on its own."""


# ---------------------------------------------------------------- the parts


class PendingBatch:
    """The batch generated ahead of a checkpoint (overlap), saved with its samples and counts: a
    resumed run trains it first, at the weight versions it was generated with, and logs its counts."""

    def __init__(self) -> None:
        self.batch: RolloutBatch | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.batch is None:
            return {}
        samples = [s.to_dict() for s in self.batch.samples]
        return {"step": self.batch.step, "samples": samples, "metadata": shared_metadata(self.batch)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch = None
        if state:
            samples = tuple(Sample.from_dict(d) for d in state["samples"])
            self.batch = RolloutBatch(samples=samples, step=state["step"], metadata=dict(state["metadata"]))


class KLController:
    """The adaptive KL controller (Ziegler et al. 2019; verl's AdaptiveKLController): with
    `AlgorithmConfig.kl_target` set, each step trains with the controller's coefficient, moved by
    the KL the step observed. Without a target the coefficient stays `kl_coef` and nothing is saved."""

    def __init__(self, config: RLConfig) -> None:
        adaptive = config.algorithm.kl_target is not None
        self.state = KLControllerState(coef=config.algorithm.kl_coef) if adaptive else None

    def step_config(self, config: RLConfig) -> RLConfig:
        """The config one step trains with: the controller's coefficient in place of kl_coef."""
        if self.state is None or self.state.coef == config.algorithm.kl_coef:
            return config
        return dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, kl_coef=self.state.coef))

    def observe(self, config: RLConfig, metrics: Mapping[str, float]) -> None:
        """Move the coefficient by a step's KL: in the reward (already over the whole batch) or in
        the loss (averaged over ranks, so every rank keeps the same coefficient)."""
        if self.state is None:
            return
        algorithm = config.algorithm
        assert algorithm.kl_target is not None
        if algorithm.kl_placement == "reward":
            observed = metrics.get("kl_reward")
        else:
            local = metrics.get("kl")
            observed = None if local is None else global_sum(local) / rank_world()[1]
        if observed is None:  # nothing was trained this step: the coefficient stays
            return
        self.state = adaptive_kl_update(
            self.state,
            observed_kl=max(float(observed), 0.0),
            target_kl=algorithm.kl_target,
            horizon=algorithm.kl_horizon,
        )

    def state_dict(self) -> dict[str, Any]:
        return {} if self.state is None else {"coef": self.state.coef}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.state is not None and state:
            self.state = KLControllerState(coef=float(state["coef"]))


def run_parts(
    buffer: DataBuffer, manager: Manager | None, pending: PendingBatch, kl: KLController
) -> dict[str, Stateful]:
    """The parts of the run's saved state, in the order they load: the buffer before the manager
    (a remote manager sends the buffer's position along). Rank 0 alone holds the buffer and manager."""
    parts: dict[str, Stateful] = {"pending_batch": pending}
    if manager is not None:
        parts.update(buffer=buffer, manager=manager)
    if kl.state is not None:
        parts["kl_controller"] = kl
    return parts


def _flat_pending_batch(extra: Mapping[str, Any], step: int) -> Mapping[str, Any]:
    """A checkpoint may keep the batch generated ahead flat: its samples under "pending_batch" and
    its counts under "pending_batch_metadata"; read as the PendingBatch part's state."""
    if not isinstance(extra.get("pending_batch"), list):
        return extra
    metadata = extra.get("pending_batch_metadata", {})
    return {**extra, "pending_batch": {"step": step, "samples": extra["pending_batch"], "metadata": metadata}}


# ---------------------------------------------------------------- the models beside the policy


def saved_models(config: ReferenceConfig, reference: TrainingComponents | None) -> dict[str, torch.nn.Module]:
    """The models a checkpoint holds besides the policy: the reference, when it moves."""
    if reference is None or config.update == "frozen":
        return {}
    return {REFERENCE_MODEL: reference.model}


@torch.no_grad()
def update_reference(
    reference: TrainingComponents, policy: TrainingComponents, config: ReferenceConfig, *, step: int
) -> bool:
    """Move the reference after RL step `step` (1-based, in batches); returns whether it changed.

    EMA: reference <- ema_decay * reference + (1 - ema_decay) * policy, parameter by parameter
    (sharded parameters shard by shard: both models are sharded alike). Reset: a copy of the policy
    every `reset_every_steps` steps.
    """
    if config.update == "frozen" or (config.update == "reset" and step % config.reset_every_steps != 0):
        return False
    ref_params = dict(reference.model.named_parameters())
    policy_params = dict(policy.model.named_parameters())
    if ref_params.keys() != policy_params.keys():
        missing = sorted(ref_params.keys() ^ policy_params.keys())[:5]
        raise ValueError(
            f"the reference and the policy differ in parameters ({missing}): cannot move one toward the other"
        )
    for name, ref in ref_params.items():
        source = policy_params[name].detach()
        if config.update == "ema":
            ref.lerp_(source.to(ref.dtype), 1.0 - config.ema_decay)
        else:
            ref.copy_(source)
    return True


def load_critic(critic: TrainingComponents, policy_checkpoint: Path) -> None:
    """Load the critic saved with `policy_checkpoint` (a ValueError naming it if there is none)."""
    path = policy_checkpoint.parent / CRITIC_DIR / policy_checkpoint.name
    if not (path / "state.json").is_file():
        raise ValueError(f"{policy_checkpoint} has no critic checkpoint beside it ({path}): cannot resume PPO's critic")
    load_checkpoint(critic, path, restore_rng=False)


# ---------------------------------------------------------------- restore and save


async def restore(
    models: RLModels,
    parts: Mapping[str, Stateful],
    config: RLConfig,
    files: RunFiles,
    *,
    resume: bool,
    resume_from: str | Path | None,
    lock: trio.Lock,
) -> TrainingState:
    """The state of a resumed run (its models and parts loaded from the run directory's checkpoint),
    or of a fresh one; a resumed run's engine then serves the restored weights."""
    state, extra, resumed = resume_if_possible(
        models.policy,
        files.run_dir,
        resume=resume,
        resume_from=resume_from,
        models=saved_models(config.reference, models.reference),
    )
    if models.critic is not None and resumed is not None:
        load_critic(models.critic, resumed)
    load_parts(parts, _flat_pending_batch(extra, state.step // config.algorithm.num_updates_per_batch))
    if state.step > 0:  # a resumed run: the engine serves the restored weights, under their own version
        state, _ = await sync_engine(
            models.policy,
            models.engine,
            state,
            files.run_dir,
            shares_model=models.engine_shares_model,
            lock=lock,
            version=state.weight_version,
            writer=files.writer,
        )
    return state


async def save(
    models: RLModels, parts: Mapping[str, Stateful], state: TrainingState, config: RLConfig, files: RunFiles
) -> None:
    """A checkpoint of the run at `state`, on every rank alike: the critic first, then the policy
    with its moving reference and the parts; flushed on the writer's thread while training goes on."""
    ckpt, checkpoints = config.checkpoint, files.run_dir / CHECKPOINTS_DIR
    extra = parts_state(parts)
    if models.critic is not None:
        critic = models.critic
        await trio.to_thread.run_sync(
            lambda: save_checkpoint(
                critic,
                state,
                checkpoints / CRITIC_DIR,
                keep_last=ckpt.keep_last,
                save_optimizer=ckpt.save_optimizer,
                writer=files.writer,
            )
        )
    await trio.to_thread.run_sync(
        lambda: save_checkpoint(
            models.policy,
            state,
            checkpoints,
            extra=extra,
            keep_last=ckpt.keep_last,
            save_optimizer=ckpt.save_optimizer,
            tokenizer=files.tokenizer,
            writer=files.writer,
            models=saved_models(config.reference, models.reference),
        )
    )
