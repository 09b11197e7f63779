"""The adaptive KL controller in the RL loop (Ziegler et al. 2019; verl's AdaptiveKLController):
with `AlgorithmConfig.kl_target` set, the KL coefficient of each step is the controller's state,
updated from the KL the step observed and carried through checkpoints, so a resumed run continues
with the coefficient it had. Without a target the coefficient stays `kl_coef`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rollouts.loops.run.distributed import global_sum, rank_world
from rollouts.losses import KLControllerState, adaptive_kl_update
from rollouts.types import RLConfig

__all__ = ["KL_CONTROLLER_KEY", "initial_kl_state", "next_kl_state", "with_kl_coef"]

KL_CONTROLLER_KEY = "kl_controller"
"""The checkpoint's `extra` entry holding the controller's state."""


def initial_kl_state(config: RLConfig, extra: Mapping[str, Any]) -> KLControllerState | None:
    """The controller's state at the start of a run: from the checkpoint resumed, else kl_coef; None
    without a target (the coefficient is fixed)."""
    if config.algorithm.kl_target is None:
        return None
    saved = extra.get(KL_CONTROLLER_KEY)
    if saved is not None:
        return KLControllerState(coef=float(saved["coef"]))
    return KLControllerState(coef=config.algorithm.kl_coef)


def with_kl_coef(config: RLConfig, state: KLControllerState | None) -> RLConfig:
    """The config one step trains with: the controller's coefficient in place of kl_coef."""
    if state is None or state.coef == config.algorithm.kl_coef:
        return config
    return dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, kl_coef=state.coef))


def next_kl_state(
    state: KLControllerState | None, config: RLConfig, metrics: Mapping[str, float]
) -> KLControllerState | None:
    """The controller after a step with these metrics: the KL in the reward (already over the whole
    batch) or in the loss (averaged over ranks, so every rank keeps the same coefficient)."""
    if state is None:
        return None
    algorithm = config.algorithm
    assert algorithm.kl_target is not None
    if algorithm.kl_placement == "reward":
        observed = metrics.get("kl_reward")
    else:
        local = metrics.get("kl")
        observed = None if local is None else global_sum(local) / rank_world()[1]
    if observed is None:  # nothing was trained this step: the coefficient stays
        return state
    return adaptive_kl_update(
        state, observed_kl=max(float(observed), 0.0), target_kl=algorithm.kl_target, horizon=algorithm.kl_horizon
    )
