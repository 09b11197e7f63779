"""rollouts-loops: the SFT and RL loops as a library, their plug points, loggers and evaluation.

    from rollouts.loops import RLModels, RunOutputs, run_rl_training, Reward, tool_rollout

Names load on first use (PEP 562), so `import rollouts.loops` stays cheap until a loop is needed.
The `rollouts` command, its TOML configs and the demo live in `rollouts.loops.app`, built on these.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

_EXPORTS = {
    # the loops and their steps
    "train": "app.api",
    "RunResult": "app.api",
    "run_rl_training": "rl.loop",
    "rl_step": "rl.step",
    "RLHooks": "rl.loop",
    "RLModels": "rl.models",
    "RunOutputs": "rl.loop",
    "sync_engine": "rl.generation",
    "BatchSource": "rl.generation",
    "rl_update": "rl.step",
    "token_advantages": "micro_batches",
    "default_loss_fn": "rl.step",
    "AdvantageFn": "micro_batches",
    "run_sft_training": "sft",
    "sft_step": "sft",
    "run_dpo_training": "dpo.loop",
    "dpo_step": "dpo.loop",
    "PreferenceData": "dpo.loop",
    "PreferenceLossFn": "dpo.batches",
    "grpo_minimal": "recipes.grpo_minimal",
    # plug points and their built-ins
    "Reward": "rollouts.scoring",
    "RewardError": "rollouts.scoring",
    "batched_reward": "rollouts.scoring",
    "GroupScorer": "rollouts.scoring",
    "exact_match": "rollouts.rewards",
    "math_answer": "rollouts.rewards",
    "builtin_reward": "rollouts.rewards",
    "RolloutContext": "rollouts.functions",
    "RolloutFn": "rollouts.functions",
    "single_turn_rollout": "rollouts.functions",
    "tool_rollout": "rollouts.functions",
    "run_tool_rollout": "rollouts.multiturn",
    "EnvironmentFailure": "rollouts.multiturn",
    "part_seed": "rollouts.multiturn",
    "environment_rollout": "rollouts.environments",
    "environment_reward": "rollouts.environments",
    "CalculatorEnv": "rollouts.environments",
    "OpenEnvAdapter": "rollouts.environments",
    "agent_rollout": "agents.rollout",
    "agent_reward": "agents.rollout",
    "AgentError": "agents.rollout",
    "EndpointLimits": "agents.endpoint",
    "serve_agent_endpoint": "agents.endpoint",
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
    "is_correct": "evaluation",
    "pass_at_k": "evaluation",
    # engines, run directories, processes
    "CoalescingEngine": "engines.coalescing",
    "remote_engine": "engines.remote",
    "RolloutProcess": "engines.rollout_process",
    "RemoteRolloutManager": "engines.rollout_process",
    "resume_if_possible": "run.run_dir",
    "CHECKPOINTS_DIR": "run.run_dir",
    "WEIGHTS_DIR": "run.run_dir",
    "init_distributed": "run.distributed",
    "close_distributed": "run.distributed",
    # metrics loggers
    "JsonlLogger": "run.loggers",
    "ConsoleLogger": "run.loggers",
    "MultiLogger": "run.loggers",
    "NullLogger": "run.loggers",
    "WandbLogger": "run.loggers",
    "TensorboardLogger": "run.loggers",
    "read_jsonl": "run.loggers",
}

__all__ = sorted(_EXPORTS)


def _version() -> str:
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
