"""On-policy distillation end to end on the demo task, with no task reward: a random-init student of
the demo's shape distilled from a briefly SFT'd demo model comes to answer held-out prompts as the
teacher does, and its reverse KL to the teacher falls."""

from __future__ import annotations

import pytest
import torch

from rollouts.backends import InProcessEngine, build_components
from rollouts.data import DataBuffer, prompt_encoder, tokenize_conversation
from rollouts.loops import NullLogger, RLModels, RunOutputs, evaluate, run_rl_training, run_sft_training
from rollouts.loops.app.demo import DemoConfig, demo_model
from rollouts.loops.recipes.addition import addition_problems, as_conversation
from rollouts.loops.recipes.tiny import build_tokenizer
from rollouts.loops.rl.distill import REVERSE_KL_METRIC, Distillation
from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams, SFTConfig

pytestmark = pytest.mark.slow


def _greedy_answers(model, tokenizer, records):
    engine = InProcessEngine(model, shares_training_model=True, tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(tokenizer.eos_token_id,))
    _, samples = evaluate(engine, records, prompt_encoder(tokenizer, chat=False), lambda s, r: 0.0, params)
    return [s.response for s in samples]


def test_a_student_distilled_with_no_reward_answers_held_out_prompts_as_its_teacher(tmp_path):
    torch.manual_seed(0)
    shape = DemoConfig.quick()
    held_out = addition_problems(64, digits=2, seed=1)
    train = addition_problems(1000, digits=2, seed=2, exclude=frozenset(r["prompt"] for r in held_out))
    tokenizer = build_tokenizer((r["prompt"] + r["answer"] for r in train), vocab_size=32)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}

    teacher_model = demo_model(shape, len(tokenizer), **ids)  # SFT'd briefly on the task's demonstrations
    sft = SFTConfig(
        num_steps=40,
        batch_size=32,
        max_length=32,
        max_tokens_per_micro_batch=4096,
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2, weight_decay=0.0),
        checkpoint=CheckpointConfig(every_steps=0),
    )
    samples = [tokenize_conversation(as_conversation(r), tokenizer, max_length=32) for r in train]
    teacher = build_components(teacher_model, sft.optimizer, num_training_steps=sft.num_steps)
    run_sft_training(teacher, DataBuffer(samples, seed=0), sft, logger=NullLogger(), run_dir=tmp_path / "sft")
    teacher_answers = _greedy_answers(teacher_model, tokenizer, held_out)

    student_model = demo_model(shape, len(tokenizer), **ids)
    with torch.no_grad():  # another random init than the teacher's
        for p in student_model.parameters():
            p.normal_(0.0, 0.02)

    def agreement() -> float:
        answers = _greedy_answers(student_model, tokenizer, held_out)
        return sum(a == b for a, b in zip(answers, teacher_answers, strict=True)) / len(held_out)

    before = agreement()
    config = RLConfig(
        num_steps=80,
        rollout=RolloutConfig(
            batch_size=16,
            samples_per_prompt=4,
            max_concurrency=16,
            # seeded: each request's own seed, so what is sampled does not depend on the order requests run in
            sampling=SamplingParams(
                temperature=1.0, max_new_tokens=5, stop_token_ids=(tokenizer.eos_token_id,), seed=0
            ),
        ),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=0, schedule="constant", weight_decay=0.0),
        checkpoint=CheckpointConfig(every_steps=0),
        max_tokens_per_micro_batch=4096,
    )
    student = build_components(student_model, config.optimizer, num_training_steps=config.num_updates)
    engine = InProcessEngine(student_model, shares_training_model=True, tokenizer=tokenizer)
    _, history = run_rl_training(
        RLModels(policy=student, engine=engine, distill=Distillation(teacher=teacher, coef=1.0)),
        DataBuffer(train, seed=3),
        config,
        reward=lambda sample, record: 0.0,  # no task reward: the teacher alone teaches
        encode_prompt=prompt_encoder(tokenizer, chat=False),
        output=RunOutputs(run_dir=tmp_path / "rl", logger=NullLogger(), resume=False),
        tokenizer=tokenizer,
    )
    after = agreement()
    kl = [h[REVERSE_KL_METRIC] for h in history]
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3, kl
    assert after - before >= 0.2, (before, after, teacher_answers[:8])
