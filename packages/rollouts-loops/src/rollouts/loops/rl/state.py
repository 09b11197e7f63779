"""What an RL run carries from one step to the next, and its checkpoints.

Models: the policy (weights, optimizer, scheduler, RNG) in the checkpoint, with a moving KL
reference beside its weights (reference.safetensors; an EMA reference in bf16 / fp16 with its
float32 accumulators, reference_average.safetensors) and PPO's critic in a checkpoint of its own
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

import safetensors.torch
import torch
import trio
from torch.distributed.tensor import DTensor, distribute_tensor

from rollouts.backends import CheckpointWriter, TrainingComponents, load_checkpoint, save_checkpoint
from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.loops.engines.rollout_process import RemoteRolloutManager
from rollouts.loops.rl.generation import serves_other_weights, shared_metadata, sync_engine
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.distributed import broadcast_json, global_sum, rank_world
from rollouts.loops.run.run_dir import CHECKPOINTS_DIR, Stateful, load_parts, parts_state, resume_if_possible
from rollouts.losses import KLControllerState, adaptive_kl_update, ema_accumulators, ema_update_
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
    "ReferenceAverage",
    "update_reference",
]

REFERENCE_MODEL = "reference"
"""The name a moving reference's weights have in a checkpoint (reference.safetensors)."""
REFERENCE_AVERAGE = "reference_average"
"""The float32 accumulators of an EMA reference in bf16 / fp16, beside its weights in a checkpoint
(reference_average.safetensors, under the parameters' names)."""
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
    the KL the step observed, over a horizon of steps or of the sequences trained
    (`AlgorithmConfig.kl_horizon_unit`). Without a target the coefficient stays `kl_coef` and
    nothing is saved."""

    def __init__(self, config: RLConfig) -> None:
        algorithm = config.algorithm
        adaptive = algorithm.kl_target is not None
        self.state = KLControllerState(coef=algorithm.kl_coef) if adaptive else None
        sequences = config.rollout.batch_size * config.rollout.samples_per_prompt
        if adaptive and algorithm.kl_horizon_unit == "samples" and sequences > algorithm.kl_horizon:
            # refused at the start rather than at the first update
            raise ValueError(
                f"AlgorithmConfig.kl_horizon ({algorithm.kl_horizon}) must be >= the sequences of a step "
                f"({sequences}) when kl_horizon_unit is 'samples': one update would move the coefficient "
                "by more than the horizon allows"
            )

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
        # the sequences trained: every rank trains the same batch, so the count is the step's
        samples = int(metrics.get("num_trained", 0)) if algorithm.kl_horizon_unit == "samples" else None
        if observed is None or samples == 0:  # nothing was trained this step: the coefficient stays
            return
        self.state = adaptive_kl_update(
            self.state,
            observed_kl=max(float(observed), 0.0),
            target_kl=algorithm.kl_target,
            horizon=algorithm.kl_horizon,
            num_samples=samples,
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


def _models_to_save(
    config: ReferenceConfig, reference: TrainingComponents | None, average: ReferenceAverage
) -> dict[str, torch.nn.Module]:
    """`saved_models` and, for an EMA reference narrower than float32, its accumulators (a module
    whose buffers are the full tensors, under the parameters' names). Collective under FSDP2."""
    models = saved_models(config, reference)
    if reference is None or config.update != "ema":
        return models
    copies = {n: _full(a) for n, a in average.copies().items()}
    if copies:
        models[REFERENCE_AVERAGE] = _tensor_module(copies)
    return models


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU (a DTensor gathered from every rank)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).to("cpu", copy=True)


def _tensor_module(tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state dict is `tensors` under their dotted names (buffers in nested modules)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = module.get_submodule(part)
        module.register_buffer(leaf, tensor)
    return root


class ReferenceAverage:
    """An EMA reference's running average in float32 (rollouts.losses.ema_accumulators): float32
    copies of its bf16 / fp16 parameters, which small EMA steps would round away in the parameters
    themselves (float32 parameters are their own). Owned by the run: made at its start, loaded from
    a resumed checkpoint, moved by `update_reference`, saved with each checkpoint."""

    def __init__(self, reference: TrainingComponents | None, config: ReferenceConfig) -> None:
        self.params = {} if reference is None else dict(reference.model.named_parameters())
        self.accumulators = ema_accumulators(self.params) if config.update == "ema" and self.params else {}

    def copies(self) -> dict[str, torch.Tensor]:
        """The accumulators that are copies (of bf16 / fp16 parameters): what a checkpoint keeps."""
        return {n: a for n, a in self.accumulators.items() if a is not self.params[n]}

    def load(self, checkpoint: Path | None) -> None:
        """The accumulators saved with `checkpoint` (a resumed run continues bit for bit); a checkpoint
        without them (a float32 reference, an older run) keeps the copies of the loaded reference."""
        if not self.accumulators or checkpoint is None:
            return
        # the copies were made from the reference before it loaded: remake them from the loaded one
        self.accumulators = ema_accumulators(self.params)
        path = checkpoint / f"{REFERENCE_AVERAGE}.safetensors"
        if not path.is_file():
            return
        saved = safetensors.torch.load_file(str(path))  # its size and CRC-32 were checked with the checkpoint
        expected = set(self.copies())
        if saved.keys() != expected:
            differ = sorted(saved.keys() ^ expected)[:5]
            raise ValueError(f"{path} does not fit the reference's bf16 / fp16 parameters: these differ: {differ}")
        for name, tensor in saved.items():
            accumulator = self.accumulators[name]
            if isinstance(accumulator, DTensor):  # this rank's shard of the full tensor
                tensor = distribute_tensor(
                    tensor.to(accumulator.device), accumulator.device_mesh, accumulator.placements
                )
            accumulator.copy_(tensor)


@torch.no_grad()
def update_reference(
    reference: TrainingComponents,
    policy: TrainingComponents,
    config: ReferenceConfig,
    *,
    step: int,
    average: ReferenceAverage | None = None,
) -> bool:
    """Move the reference after RL step `step` (1-based, in batches); returns whether it changed.

    EMA: reference <- ema_decay * reference + (1 - ema_decay) * policy, parameter by parameter
    (sharded parameters shard by shard: both models are sharded alike), accumulated in float32 for
    bf16 / fp16 parameters (rollouts.losses.ema_update_), whose small steps would round away.
    Reset: a copy of the policy every `reset_every_steps` steps.
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
    if config.update == "ema":
        # without the run's average, this step alone accumulates in float32 (small steps may round away)
        accumulators = ema_accumulators(ref_params) if average is None else average.accumulators
        ema_update_(ref_params, accumulators, policy_params, decay=config.ema_decay)
        return True
    for name, ref in ref_params.items():
        ref.copy_(policy_params[name].detach())
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
    average: ReferenceAverage,
) -> TrainingState:
    """The state of a resumed run (its models and parts loaded from the run directory's checkpoint),
    or of a fresh one; a resumed run's engine then serves the restored weights, and so does a fresh
    run's engine found serving a version of its own (a server kept up from another run: not the
    weights it was started with, which a fresh run's first batches would otherwise be sampled from)."""
    state, extra, resumed = resume_if_possible(
        models.policy,
        files.run_dir,
        resume=resume,
        resume_from=resume_from,
        models=saved_models(config.reference, models.reference),
    )
    if models.critic is not None and resumed is not None:
        load_critic(models.critic, resumed)
    average.load(resumed)
    load_parts(parts, _flat_pending_batch(extra, state.step // config.algorithm.num_updates_per_batch))
    rank0 = rank_world()[0] == 0  # the engine's rank
    stale = state.step == 0 and broadcast_json(
        await serves_other_weights(models.engine, state, shares_model=bool(models.engine_shares_model))
        if rank0
        else None
    )
    if state.step > 0 or stale:  # the engine serves the run's weights (every rank: they export or gather)
        state, _ = await sync_engine(
            models.policy,
            models.engine,
            state,
            files.run_dir,
            shares_model=bool(models.engine_shares_model),
            lock=lock,
            version=state.weight_version,
            writer=files.writer,
        )
    return state


async def save(
    models: RLModels,
    parts: Mapping[str, Stateful],
    state: TrainingState,
    config: RLConfig,
    files: RunFiles,
    average: ReferenceAverage,
) -> None:
    """A checkpoint of the run at `state`, on every rank alike: the critic first, then the policy
    with its moving reference and the parts; flushed on the writer's thread while training goes on."""
    ckpt, checkpoints = config.checkpoint, files.run_dir / CHECKPOINTS_DIR
    extra = parts_state(parts)
    more = _models_to_save(config.reference, models.reference, average)  # gathered here: collective under FSDP2
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
            models=more,
        )
    )
