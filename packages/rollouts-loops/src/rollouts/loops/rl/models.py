"""The models of an RL run: the policy, the engine that samples it, and the two models some
algorithms add, a KL reference and PPO's critic. `RLModels` names them; `with_defaults` builds the
reference and the critic a run needs and was not given, from the starting policy, after
`check_models` has refused what the run cannot do with them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from rollouts.backends import InProcessEngine, TrainingComponents
from rollouts.backends.train.lora import has_lora, reference_components
from rollouts.backends.train.value import build_critic
from rollouts.types import InferenceEngine, RLConfig

__all__ = ["RLModels", "check_models", "default_critic", "default_reference", "with_defaults"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RLModels:
    """The models one RL run trains and samples from."""

    policy: TrainingComponents
    """The trained model with its optimizer (rollouts.backends.build_components)."""
    engine: InferenceEngine | None
    """Samples the rollouts on rank 0 (any InferenceEngine); other ranks may pass None."""
    engine_shares_model: bool | None = None
    """The engine samples from `policy.model` itself: no export at a sync, and no overlap. None
    (default): read off the engine, an InProcessEngine (possibly inside a CoalescingEngine) sharing
    when its model is `policy.model`; other engines do not share unless this says True."""
    reference: TrainingComponents | None = None
    """The KL reference; default: the starting weights (with LoRA: the adapter switched off)."""
    critic: TrainingComponents | None = None
    """PPO's value model (advantage_estimator 'gae'); default: built from the starting policy."""

    def __post_init__(self) -> None:
        sampler = _in_process_engine(self.engine)
        if sampler is None:  # another engine: only the caller knows
            object.__setattr__(self, "engine_shares_model", bool(self.engine_shares_model))
            return
        shares = sampler.model is self.policy.model
        if self.engine_shares_model is not None and self.engine_shares_model != shares:
            raise ValueError(
                f"RLModels.engine_shares_model={self.engine_shares_model}, but the InProcessEngine samples from "
                + ("policy.model itself" if shares else "a model of its own")
                + " (leave engine_shares_model unset: it is read off the engine)"
            )
        if sampler.shares_training_model != shares:
            raise ValueError(
                f"InProcessEngine(shares_training_model={sampler.shares_training_model}) samples from "
                + ("policy.model itself: pass shares_training_model=True" if shares else "a model of its own")
                + ("" if shares else ", whose weights would never be updated: pass shares_training_model=False")
            )
        object.__setattr__(self, "engine_shares_model", shares)


def _in_process_engine(engine: object) -> InProcessEngine | None:
    """The InProcessEngine `engine` is, or wraps (CoalescingEngine's `inner`), else None."""
    for _ in range(4):  # wrappers nest shallowly
        if isinstance(engine, InProcessEngine):
            return engine
        engine = getattr(engine, "inner", None)
    return None


def check_models(models: RLModels, config: RLConfig, *, rank: int, world: int) -> None:
    """Refuse, before any work, models the run cannot train with."""
    if config.overlap and models.engine_shares_model:
        raise ValueError("overlap needs an engine with its own copy of the weights; engine_shares_model=True")
    if rank == 0 and models.engine is None:
        raise ValueError("rank 0 generates: it needs an engine")
    if world > 1 and models.engine_shares_model:
        raise ValueError("under torchrun the engine needs its own weights (rank 0 samples; the model is sharded)")
    lora = has_lora(models.policy.model)
    if world > 1 and config.algorithm.needs_reference and models.reference is None and not lora:
        raise ValueError(
            "under torchrun a KL term needs RLModels.reference on every rank: the starting model, "
            "sharded like the trained one (a sharded model cannot be copied here)"
        )
    if config.reference.update != "frozen" and lora:
        raise ValueError(
            f"RLConfig.reference.update {config.reference.update!r} needs a reference of its own, but with LoRA "
            "the reference is the same weights with the adapter switched off; use update 'frozen'"
        )


def with_defaults(models: RLModels, config: RLConfig, *, world: int) -> RLModels:
    """`models` with the reference and the critic the algorithm needs, built where none was given
    (before a resume loads later weights into the policy)."""
    reference = models.reference
    if config.algorithm.needs_reference and reference is None:
        reference = default_reference(models.policy)
    critic = models.critic if models.critic is not None else default_critic(models.policy, config, world=world)
    return dataclasses.replace(models, reference=reference, critic=critic)


def default_reference(components: TrainingComponents) -> TrainingComponents:
    """The KL reference when none is given: with LoRA the same weights with the adapter off (no copy);
    otherwise a copy of the starting weights."""
    if has_lora(components.model):
        return reference_components(components)
    return dataclasses.replace(components, model=copy.deepcopy(components.model).eval())


def default_critic(components: TrainingComponents, config: RLConfig, *, world: int) -> TrainingComponents | None:
    """A critic from the starting policy when the algorithm needs one (GAE), else None."""
    if config.algorithm.advantage_estimator != "gae":
        return None
    if world > 1:
        raise ValueError(
            "under torchrun PPO with a critic needs RLModels.critic on every rank (critic_components from "
            "rollouts.backends.build_critic, sharded like the policy): a sharded policy cannot be copied here"
        )
    if has_lora(components.model):
        raise ValueError("PPO with a critic and LoRA is not supported: give the critic a model of its own path")
    return build_critic(
        components.model, config.critic.optimizer, num_training_steps=config.num_updates, device=components.device
    )
