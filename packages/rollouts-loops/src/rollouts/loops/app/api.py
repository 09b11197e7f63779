"""Run a run file from Python: what `rollouts sft` / `rollouts rl` do, returning the result.

    from rollouts.loops import train

    result = train("examples/grpo_inprocess.toml", sets=["rl.num_steps=10"])
    result.state.step, result.metrics["reward_mean"], result.checkpoints

The config is a TOML path, a mapping of the same tables (`{"model": {"path": ...}, "rl": {...}}`),
or an `RLRun` / `SFTRun` built already; every check of the CLI runs before any work, and failures
raise (ConfigError for the config, RunFailed with its paragraph and the run's state for a run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from rollouts.loops.app.commands import RunResult, cmd_rl, cmd_sft
from rollouts.loops.app.config import RLRun, SFTRun, build_run, load_run
from rollouts.loops.app.overrides import apply_overrides
from rollouts.loops.run.distributed import close_distributed

__all__ = ["RunResult", "train"]

_KINDS: dict[str, type] = {"rl": RLRun, "sft": SFTRun}


def train(
    config: str | Path | Mapping[str, Any] | RLRun | SFTRun,
    *,
    command: Literal["rl", "sft"] | None = None,
    sets: Sequence[str] = (),
) -> RunResult:
    """Run `config` as `rollouts <command>` would (default: 'sft' for an SFTRun, else 'rl'), with
    `sets` as its --set overrides ("rl.num_steps=10"); returns the final state and metrics."""
    if isinstance(config, (RLRun, SFTRun)):
        kind = "sft" if isinstance(config, SFTRun) else "rl"
        if command not in (None, kind):
            raise ValueError(f"command {command!r} does not match the {type(config).__name__} given")
        if sets:
            raise ValueError(
                "sets apply to a path or a mapping; replace fields of a built run with dataclasses.replace"
            )
        run, source = config, f"<{type(config).__name__}>"
    else:
        kind = command or "rl"
        if kind not in _KINDS:
            raise ValueError(f"command must be 'rl' or 'sft', got {command!r}")
        if isinstance(config, (str, Path)):
            run, source = load_run(_KINDS[kind], config, list(sets)), str(config)
        elif isinstance(config, Mapping):
            source = "<mapping>" + (" with --set " + " ".join(sets) if sets else "")
            run = build_run(_KINDS[kind], apply_overrides(config, list(sets)), source=source)
        else:
            raise TypeError(f"config must be a TOML path, a mapping or an RLRun / SFTRun, got {type(config).__name__}")
    ours = not torch.distributed.is_initialized()  # a process group the caller made stays theirs
    clean = False
    try:
        result = cmd_sft(run, source) if isinstance(run, SFTRun) else cmd_rl(run, source)
        clean = True
        return result
    finally:
        if ours:
            close_distributed(clean=clean)
