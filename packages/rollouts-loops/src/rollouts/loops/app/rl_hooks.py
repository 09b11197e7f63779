"""The RL run file's [reward] and [hooks] as functions, checked before any work: the built-in
rewards, plug-in files (a relative path read beside the run file), and reward models."""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from pathlib import Path
from typing import Any

from rollouts.backends import load_tokenizer
from rollouts.data import DataBuffer
from rollouts.loops.agents.endpoint import EndpointLimits
from rollouts.loops.agents.rollout import agent_reward, agent_rollout
from rollouts.loops.app.config import BUILTIN_REWARDS, ConfigError, RLRun
from rollouts.loops.engines.rollout_process import check_crossing, records_to_jsonl
from rollouts.loops.plugins import PluginError, resolve_function
from rollouts.loops.rollouts.judge import JudgeLimits, JudgeScale, judge_reward
from rollouts.loops.rollouts.reward_models import (
    ClassifierRewardModel,
    chat_encoder,
    check_reward_model_dir,
    reward_model_reward,
    weighted_reward,
)
from rollouts.loops.rollouts.rewards import builtin_reward
from rollouts.loops.rollouts.scoring import Reward
from rollouts.sync.reward_client import VLLMRewardModel


def _beside(spec: str, source: str) -> str:
    """A "path/to/file.py:name" spec with a relative path read from the run file's directory, as
    the file's other paths are; one found only from the current directory keeps that meaning."""
    module, sep, name = spec.rpartition(":")
    if not (sep and module.endswith(".py")) or Path(module).is_absolute():
        return spec
    beside = Path(source).parent / module
    return f"{beside}:{name}" if beside.is_file() or not Path(module).is_file() else spec


# Parameter names of a reward written for peers that pass strings (TRL's reward(prompts, completions,
# **kwargs)): it binds two positional arguments, so only its names tell it apart before step 1.
_STRING_REWARD_PARAMETERS = frozenset({"prompts", "completions", "prompt", "completion"})


def _refuse_string_rewards(fn: Any, what: str) -> None:
    try:
        names = list(inspect.signature(fn).parameters)[:2]
    except (TypeError, ValueError):  # a builtin without a signature
        return
    if _STRING_REWARD_PARAMETERS & set(names):
        raise PluginError(
            f"reward.fn: {getattr(fn, '__name__', fn)!r}({', '.join(names)}, ...) reads like a reward over "
            f"strings (TRL's reward(prompts, completions, **kwargs)); here it must be {what}, getting a "
            "Sample (sample.response is the completion's text) and the prompt record"
        )


def resolve_hooks(run: RLRun, source: str) -> dict[str, Any]:
    """run_rl_training's plug-point arguments from [reward] and [hooks], checked before any work."""

    spec = run.reward
    try:
        if spec.fn == "judge":
            reward = _judge(spec, source)
        else:
            reward = Reward(
                fn=_reward_fn(run, source),
                batched=spec.batched,
                on_error=spec.on_error,
                timeout_s=spec.timeout_s,
                max_threads=spec.max_threads,
            )
        if spec.models:
            reward = _with_reward_models(reward, spec, source)
        hooks: dict[str, Any] = {"reward": reward}
        # the loss is always called with the step's counts as keywords (rollouts-backends' forward_backward)
        counts = ("num_tokens", "num_sequences")
        for key, arg, arity, keywords, what in (
            ("rollout", "rollout", 2, (), "rollout(record, ctx) -> list[Sample]"),
            ("filter", "filter_fn", 1, (), "filter(group) -> str | None"),
            ("advantages", "advantage_fn", 2, (), "advantages(rewards_N, groups_N) -> advantages_N"),
            ("loss", "loss_fn", 2, counts, "loss(logprobs_B_T, batch, *, num_tokens, num_sequences)"),
        ):
            path = getattr(run.hooks, key)
            if path:
                hooks[arg] = resolve_function(
                    _beside(path, source), key=f"hooks.{key}", num_positional=arity, what=what, keywords=keywords
                )
        if run.agent.fn:
            hooks.update(_agent_hooks(run, source, hooks["reward"]))
    except PluginError as e:
        raise ConfigError(f"{source}: {e}") from e
    return hooks


def _agent_hooks(run: RLRun, source: str, reward: Reward) -> dict[str, Any]:
    """[agent]: the agent's rollout, and the reward it returns (the run's reward where it returns None)."""
    spec = run.agent
    fn = resolve_function(
        _beside(spec.fn, source), key="agent.fn", num_positional=2, what="run(base_url, record) -> float | None"
    )
    limits = EndpointLimits(
        max_turns=spec.max_turns, max_total_tokens=spec.max_total_tokens, request_timeout_s=spec.request_timeout_s
    )
    rollout = agent_rollout(fn, timeout_s=spec.timeout_s, limits=limits, name=spec.fn)
    return {"rollout": rollout, "reward": agent_reward(reward)}


def _reward_fn(run: RLRun, source: str) -> Any:
    """reward.fn as a function: a built-in, or one named by import path (checked for its arity)."""
    spec = run.reward
    if spec.fn in BUILTIN_REWARDS:
        return builtin_reward(spec.fn, answer_key=run.data.answer_key)
    what = "reward(samples, records) -> list[float]" if spec.batched else "reward(sample, record) -> float"
    fn = resolve_function(_beside(spec.fn, source), key="reward.fn", num_positional=2, what=what)
    _refuse_string_rewards(fn, what)
    return fn


def _judge(spec: Any, source: str) -> Reward:
    """The [reward.judge] LLM judge as a Reward (its API key read from the environment now)."""
    judge = spec.judge
    try:
        return judge_reward(
            judge.url,
            template=judge.template,
            model=judge.model or None,
            api_key_env=judge.api_key_env,
            scale=JudgeScale(
                low=judge.low,
                high=judge.high,
                labels={label.label: label.score for label in judge.labels},
                pattern=judge.pattern,
            ),
            system=judge.system,
            limits=JudgeLimits(
                timeout_s=judge.timeout_s,
                max_retries=judge.max_retries,
                max_concurrency=judge.max_concurrency,
                group_timeout_s=judge.group_timeout_s,
                max_tokens=judge.max_tokens,
            ),
            on_error=spec.on_error,
        )
    except ValueError as e:
        raise ConfigError(f"{source}: reward.judge: {e}") from e


def _with_reward_models(verifier: Any, spec: Any, source: str) -> Any:
    """`verifier` weighted by reward.weight plus each [[reward.models]] score by its weight; every
    model directory checked (and loaded, for those scored in process) before any work."""

    parts = [(verifier, spec.weight)] if spec.weight != 0 else []
    for i, model in enumerate(spec.models):
        try:
            if model.path:
                check_reward_model_dir(model.path)
                scorer: Any = ClassifierRewardModel.load(model.path, batch_size=model.batch_size)
                pad: int | None = scorer.pad_token_id
            else:
                scorer = VLLMRewardModel(model.url, timeout_s=model.timeout_s, max_batch=model.batch_size)
                pad = _pad_token_id(model.tokenizer_path)
            encode = (
                chat_encoder(load_tokenizer(model.tokenizer_path or model.path)) if model.encode == "chat" else None
            )
        except (OSError, ValueError) as e:
            raise ConfigError(f"{source}: reward.models[{i}]: {e}") from e
        if pad is None:
            warnings.warn(
                f"{source}: reward.models[{i}] ({model.url}) has no tokenizer_path to read its pad id from: the "
                "server scores the last token even where it is a pad id, not the last non-pad token",
                stacklevel=2,
            )
        reward = reward_model_reward(scorer, encode=encode, pad_token_id=pad, timeout_s=model.timeout_s)
        parts.append((reward, model.weight))
    if not parts:
        raise ConfigError(f"{source}: reward.weight is 0 and there is no reward model: nothing would score the samples")
    return dataclasses.replace(
        weighted_reward(parts, timeout_s=max(m.timeout_s for m in spec.models)), on_error=spec.on_error
    )


def _pad_token_id(directory: str) -> int | None:
    """The pad id of the reward model whose files are in `directory` (none: None): its config.json's,
    the id its sequence classifier pools by, else its tokenizer's."""
    if not directory:
        return None
    config = Path(directory) / "config.json"
    pad = json.loads(config.read_text()).get("pad_token_id") if config.is_file() else None
    if pad is None:
        pad = load_tokenizer(directory).pad_token_id
    return None if pad is None else int(pad)


def check_rollout_process(run: RLRun, hooks: dict[str, Any], records: list[Any], source: str) -> None:
    """With engine.kind = "rollout_process", refuse before any work what cannot cross to the engine
    process (partial rollouts, a function without an import path, a record that is not JSON)."""
    if run.engine.kind != "rollout_process":
        return
    try:
        check_crossing(run.rl, Reward.of(hooks["reward"]), hooks.get("rollout"), hooks.get("filter_fn"))
        records_to_jsonl(DataBuffer(records))
    except ValueError as e:  # PluginError included
        raise ConfigError(f"{source}: engine.kind = 'rollout_process': {e}") from e
