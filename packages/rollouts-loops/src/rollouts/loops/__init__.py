"""rollouts-loops: the SFT and RL loops as a library, their plug points, loggers and evaluation.

    from rollouts.loops import run_rl_training, Reward, tool_rollout

Names load on first use (PEP 562), so `import rollouts.loops` stays cheap until a loop is needed.
The `rollouts` command, its TOML configs and the demo live in `rollouts.loops.app`, built on these.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # the loops and their steps
    "run_rl_training": "rl",
    "rl_step": "step",
    "RLHooks": "rl",
    "sync_engine": "generation",
    "BatchSource": "generation",
    "rl_update": "policy_update",
    "token_advantages": "per_token",
    "default_loss_fn": "policy_update",
    "AdvantageFn": "per_token",
    "run_sft_training": "sft",
    "sft_step": "sft",
    "grpo_minimal": "rl_minimal",
    # plug points and their built-ins
    "Reward": "scoring",
    "RewardError": "scoring",
    "batched_reward": "scoring",
    "RolloutContext": "rollout_fns",
    "RolloutFn": "rollout_fns",
    "single_turn_rollout": "rollout_fns",
    "tool_rollout": "rollout_fns",
    "run_tool_rollout": "multiturn",
    "environment_rollout": "environments",
    "environment_reward": "environments",
    "CalculatorEnv": "environments",
    "OpenEnvAdapter": "environments",
    "load_object": "plugins",
    "resolve_function": "plugins",
    "PluginError": "plugins",
    "ALGORITHMS": "algorithms",
    "algorithm_preset": "algorithms",
    # evaluation
    "Evaluation": "evaluation",
    "evaluate": "evaluation",
    "evaluate_groups": "evaluation",
    "group_metrics": "evaluation",
    "pass_at_k": "evaluation",
    # engines, run directories, processes
    "CoalescingEngine": "engines",
    "remote_engine": "engines",
    "RolloutProcess": "rollout_process",
    "RemoteRolloutManager": "rollout_process",
    "resume_if_possible": "run_dir",
    "CHECKPOINTS_DIR": "run_dir",
    "WEIGHTS_DIR": "run_dir",
    "init_distributed": "distributed",
    "close_distributed": "distributed",
    # metrics loggers
    "JsonlLogger": "loggers",
    "ConsoleLogger": "loggers",
    "MultiLogger": "loggers",
    "NullLogger": "loggers",
    "WandbLogger": "loggers",
    "TensorboardLogger": "loggers",
    "read_jsonl": "loggers",
}

__all__ = sorted(_EXPORTS)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollouts-loops")  # written once, in pyproject.toml
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollouts.loops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rollouts.loops.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
