"""On-policy distillation end to end on the demo task, with no task reward: a student of the demo's
shape, SFT'd too briefly to answer (about 4% held out), distilled from the demo's SFT'd model
(72%) with the full-vocabulary divergence (GKD's generalized JSD) on its own samples, gains at least
20 points of held-out accuracy, and its divergence to the teacher falls.

The sampled-token estimate (the advantage coef * (teacher - student log-prob)) does not get there
from such a student in a CPU test's budget: one token's log-ratio is too noisy a signal against
a confident teacher, where the whole distribution at each position is exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollouts.backends import DISTILL_DIVERGENCE_METRIC, InProcessEngine, build_components, load_hf_model
from rollouts.data import DataBuffer, prompt_encoder
from rollouts.loops import ALGORITHMS, NullLogger, RLModels, RunOutputs, run_rl_training
from rollouts.loops.app.demo import DemoConfig, demo_model, demo_task, held_out_accuracy, run_demo_sft
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.rl.distill import Distillation
from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams

pytestmark = pytest.mark.slow

STUDENT_SFT_STEPS = 300
"""Too few for the demo's model to answer (its accuracy stays near 0), enough to write answers' shape."""


def test_a_student_distilled_with_no_reward_gains_20_points_of_held_out_accuracy(quick_demo, tmp_path):
    config = DemoConfig.quick()
    task = demo_task(config)  # the demo's problems and tokenizer
    tokenizer = task.tokenizer
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(0)

    demo_dir, _ = quick_demo
    teacher_model = load_hf_model(demo_dir / "sft_model")  # the demo's SFT stage, before its RL
    assert teacher_model.config.vocab_size == len(tokenizer)
    student_model = demo_model(config, len(tokenizer), **ids)
    brief = dataclasses.replace(config, sft_steps=STUDENT_SFT_STEPS)
    run_demo_sft(student_model, task, brief, run_dir=tmp_path / "student", logger=NullLogger())

    def accuracy(model) -> float:
        return held_out_accuracy(InProcessEngine(model, shares_training_model=True, tokenizer=tokenizer), task, config)

    teacher_accuracy, before = accuracy(teacher_model), accuracy(student_model)
    rl = RLConfig(
        num_steps=200,
        # one response to each of 64 prompts a step (the more problems the student meets, the sooner
        # it learns the teacher's addition), so an estimator that needs no group, and no KL to a reference
        algorithm=dataclasses.replace(ALGORITHMS["reinforce_pp"], kl_coef=0.0),
        rollout=RolloutConfig(
            batch_size=64,
            samples_per_prompt=1,
            max_concurrency=64,
            # seeded: each request's own seed, so what is sampled does not depend on the order requests run in
            sampling=SamplingParams(
                temperature=1.0, max_new_tokens=config.digits + 3, stop_token_ids=(tokenizer.eos_token_id,), seed=0
            ),
        ),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", weight_decay=0.0, max_grad_norm=1.0),
        checkpoint=CheckpointConfig(every_steps=0),
        max_tokens_per_micro_batch=4096,
        seed=0,
    )
    teacher = build_components(teacher_model.eval(), rl.optimizer, num_training_steps=1)  # never stepped
    student = build_components(student_model, rl.optimizer, num_training_steps=rl.num_updates)
    engine = CoalescingEngine(
        InProcessEngine(student_model, shares_training_model=True, tokenizer=tokenizer), max_prompts_per_call=64
    )
    _, history = run_rl_training(
        RLModels(
            policy=student,
            engine=engine,
            engine_shares_model=True,
            # GKD's generalized JSD (beta 0.5, TRL's default): the reverse KL (beta 1) gains 50 points in
            # 200 steps with two sampling seeds of three, but with the third it has not left its
            # plateau by then; the JSD gained 31 to 45 points with each of four seeds
            distill=Distillation(teacher=teacher, estimate="full", beta=0.5),
        ),
        DataBuffer(list(task.train), seed=3),
        rl,
        reward=lambda sample, record: 0.0,  # no task reward: the teacher alone teaches
        encode_prompt=prompt_encoder(tokenizer, chat=False),
        output=RunOutputs(run_dir=tmp_path / "rl", logger=NullLogger(), resume=False),
        tokenizer=tokenizer,
    )
    after = accuracy(student_model)
    divergence = [h[DISTILL_DIVERGENCE_METRIC] for h in history]
    assert sum(divergence[-10:]) / 10 < 0.85 * sum(divergence[:10]) / 10, divergence[::20]
    assert after - before >= 0.2, (before, after, teacher_accuracy)
