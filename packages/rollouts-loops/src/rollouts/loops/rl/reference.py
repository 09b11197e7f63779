"""The KL reference model's updates during RL (RLConfig.reference): frozen (the starting weights),
an exponential moving average of the policy, or a reset to the policy every N steps. A moving
reference is saved with every checkpoint and loaded on resume, so a resumed run continues with
exactly the reference it had.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from rollouts.backends import TrainingComponents
from rollouts.backends.train.lora import has_lora, reference_components
from rollouts.types import ReferenceConfig

__all__ = ["REFERENCE_MODEL", "check_reference_update", "default_reference", "saved_models", "update_reference"]

REFERENCE_MODEL = "reference"
"""The name a moving reference's weights have in a checkpoint (reference.safetensors)."""


def check_reference_update(config: ReferenceConfig, components: TrainingComponents) -> None:
    """Refuse updates the run cannot make, before any work."""
    if config.update != "frozen" and has_lora(components.model):
        raise ValueError(
            f"RLConfig.reference.update {config.update!r} needs a reference of its own, but with LoRA the "
            "reference is the same weights with the adapter switched off; use update 'frozen'"
        )


def default_reference(components: TrainingComponents) -> TrainingComponents:
    """The KL reference when none is given: with LoRA the same weights with the adapter off (no copy);
    otherwise the starting weights, copied before a resume loads later ones into `components`."""
    if has_lora(components.model):
        return reference_components(components)
    return dataclasses.replace(components, model=copy.deepcopy(components.model).eval())


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
