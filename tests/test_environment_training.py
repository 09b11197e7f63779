"""A multi-turn environment trains through run_rl_training: the episode reward rises over a few steps."""

import json

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
