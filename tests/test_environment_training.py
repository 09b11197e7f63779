"""A multi-turn environment trains through run_rl_training: the episode reward rises over a few steps."""

import json

import pytest
import torch

from rollouts.backends import InProcessEngine, build_components, load_hf_model
from rollouts.data import DataBuffer
from rollouts.loops import (
    CoalescingEngine,
    NullLogger,
    RLHooks,
    RLModels,
    RunOutputs,
    environment_reward,
    environment_rollout,
    run_rl_training,
    tool_rollout,
)
from rollouts.types import CheckpointConfig, EnvStep, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams


class SevensEnv:
    """Two turns; each turn that starts with "7" earns 0.5; the environment answers "=" in between."""

    def reset(self, record):
        return record["prompt"]

    def step(self, text, ids):
        self.turns = getattr(self, "turns", 0) + 1
        return EnvStep(observation="=", reward=0.5 if text.startswith("7") else 0.0, done=self.turns == 2)


def test_a_toy_multi_turn_environment_trains(tiny_run_inputs, tmp_path):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    model = load_hf_model(tiny_run_inputs / "model")
    records = [json.loads(line) for line in (tiny_run_inputs / "prompts.jsonl").read_text().splitlines()]
    config = RLConfig(
        num_steps=12,
        max_tokens_per_micro_batch=512,
        rollout=RolloutConfig(
            batch_size=8,
            samples_per_prompt=8,
            max_concurrency=8,
            request_timeout_s=120.0,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(tokenizer.eos_token_id,)),
        ),
        optimizer=OptimizerConfig(lr=1e-2, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    components = build_components(model, config.optimizer, num_training_steps=12)
    engine = CoalescingEngine(InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=64)
    state, history = run_rl_training(
        RLModels(policy=components, engine=engine, engine_shares_model=True),
        DataBuffer(records, seed=0),
        config,
        reward=environment_reward,
        encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
        output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=False),
        hooks=RLHooks(rollout=environment_rollout(SevensEnv, max_turns=2, max_total_tokens=64)),
        tokenizer=tokenizer,
    )
    rewards = [h["reward_mean"] for h in history]
    assert state.step == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
    assert all(r <= 1.0 for r in rewards)


class TwoTurns:
    """Two model turns with "=" shown in between; the reward is left to the run's reward function."""

    def reset(self, record):
        return record["prompt"]

    def step(self, text, ids):
        self.turns = getattr(self, "turns", 0) + 1
        return EnvStep(observation="=", done=self.turns == 2)


def _seeded_multi_turn_run(tiny_run_inputs, run_dir, rollout, *, concurrency):
    """Two seeded GRPO steps of `rollout` at `concurrency`: each step's episodes by prompt, the
    steps' grad norms and the final weights."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    model = load_hf_model(tiny_run_inputs / "model")
    records = [json.loads(line) for line in (tiny_run_inputs / "prompts.jsonl").read_text().splitlines()]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, seed=3, stop_token_ids=(tokenizer.eos_token_id,))
    config = RLConfig(
        num_steps=2,
        max_tokens_per_micro_batch=512,
        rollout=RolloutConfig(
            batch_size=4, samples_per_prompt=4, max_concurrency=concurrency, request_timeout_s=120.0, sampling=sampling
        ),
        optimizer=OptimizerConfig(lr=1e-2, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    episodes: dict[str, list[tuple[int, ...]]] = {}

    def reward(sample, record):  # varies with the tokens: distinct episodes give a gradient
        episodes.setdefault(record["prompt"], []).append(tuple(sample.tokens))
        return float(sum(sample.response_tokens) % 3)

    _, history = run_rl_training(
        RLModels(
            policy=build_components(model, config.optimizer, num_training_steps=2),
            engine=CoalescingEngine(InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=64),
        ),
        DataBuffer(records, seed=0),
        config,
        reward=reward,
        encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
        output=RunOutputs(run_dir=run_dir, logger=NullLogger(), resume=False),
        hooks=RLHooks(rollout=rollout(tokenizer)),
        tokenizer=tokenizer,
    )
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return {p: sorted(e) for p, e in episodes.items()}, [h["grad_norm"] for h in history], weights


def _environment(tokenizer):
    return environment_rollout(TwoTurns, max_turns=2, max_total_tokens=64)


def _tools(tokenizer):
    return tool_rollout(tool_parser=lambda text: text or None, tool_executor=lambda call: "=", max_turns=2)


@pytest.mark.parametrize("rollout", [_environment, _tools], ids=["environment", "tools"])
def test_a_seeded_multi_turn_group_differs_learns_and_repeats_at_any_concurrency(tiny_run_inputs, tmp_path, rollout):
    alone = _seeded_multi_turn_run(tiny_run_inputs, tmp_path / "c1", rollout, concurrency=1)
    together = _seeded_multi_turn_run(tiny_run_inputs, tmp_path / "c4", rollout, concurrency=4)
    episodes, grad_norms, weights = alone
    assert all(len(set(group)) > 1 for group in episodes.values()), episodes  # a group's episodes differ
    assert all(g > 0.0 for g in grad_norms), grad_norms
    assert together[0] == episodes and together[1] == grad_norms  # the same episodes, one at a time or together
    for name, tensor in weights.items():
        torch.testing.assert_close(together[2][name], tensor, rtol=0, atol=0, msg=name)


_FAILING_ENVIRONMENT = """
import asyncio

from rollouts.loops import environment_rollout
from rollouts.types import EnvStep


class Sandbox:
    def reset(self, record):
        return record["prompt"]

    async def step(self, text, ids):
        await asyncio.sleep(0.01)  # asyncio code, under the trio loops
        raise ConnectionError("the sandbox at 10.0.0.7 is gone")


rollout = environment_rollout(Sandbox, max_turns=2, max_total_tokens=64, step_timeout_s=5.0)
"""


def test_rollouts_rl_shows_an_environments_failure_counted_by_cause(tiny_run_inputs, tmp_path, capsys):
    from run_configs import rl_toml

    from rollouts.loops.app.cli import main
    from rollouts.loops.run.loggers import read_jsonl

    user = tmp_path / "sandbox_env.py"
    user.write_text(_FAILING_ENVIRONMENT)
    extra = f'[hooks]\nrollout = "{user}:rollout"\n'
    config = rl_toml(tiny_run_inputs, tmp_path / "out", tiny_run_inputs / "model", extra=extra)
    config.write_text(config.read_text().replace('fn = "exact_match"', 'fn = "environment"'))
    assert main(["rl", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    cause = (
        "EnvironmentFailure: environment Sandbox, step at turn 1: Sandbox.step raised ConnectionError: "
        "the sandbox at 10.0.0.7 is gone"
    )
    assert f"causes: '{cause}' x4" in err, err  # the step's 4 groups, each failed by the same cause
    assert "ExceptionGroup" not in err and "request_timeout_s" not in err
    records = read_jsonl(tmp_path / "out" / "metrics_rl.jsonl")
    assert records and all(f"'{cause}' x4" == r["failure_causes"] for r in records), records
