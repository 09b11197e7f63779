"""On-policy distillation into a LoRA student: at its first step (its adapter adds zero) it is the
full model, so its loss and reverse KL are the full-model student's; trained, its adapter moves,
its base weights do not, and its reverse KL to a teacher it can represent (the base model with a
random adapter) falls."""

from __future__ import annotations

import json

import pytest
import torch
from dp_rl_cases import batch, config
from run_configs import tiny_rl_config

from rollouts.backends import DISTILL_DIVERGENCE_METRIC, InProcessEngine, build_components, load_hf_model
from rollouts.backends.train.lora import apply_lora
from rollouts.data import DataBuffer
from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.distill import REVERSE_KL_METRIC, Distillation, check_teacher
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.rl.step import rl_update
from rollouts.loops.run.loggers import NullLogger
from rollouts.types import LoraConfig, OptimizerConfig, TrainingState

LORA = LoraConfig(rank=8, alpha=16.0)


def _tiny(seed):
    return build_tiny_model(
        64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
        max_position_embeddings=64, seed=seed,
    )  # fmt: skip


@pytest.mark.parametrize(("estimate", "metric"), [("sampled", REVERSE_KL_METRIC), ("full", DISTILL_DIVERGENCE_METRIC)])
def test_a_lora_students_first_step_is_the_full_models(estimate, metric):
    teacher = build_components(_tiny(1).eval(), OptimizerConfig(), num_training_steps=1)
    distill = Distillation(teacher=teacher, coef=0.5, mode="add", estimate=estimate)
    settings = config(ALGORITHMS["grpo"])
    got = {}
    for name, lora in [("full", None), ("lora", LORA)]:
        student = build_components(_tiny(0), settings.optimizer, num_training_steps=1, lora=lora)
        _, got[name] = rl_update(student, TrainingState(), batch(), settings, distill=distill)
    # x @ W + (alpha / r) * (x @ A) @ B with B = 0 adds exact zeros: the same floats, not just close
    assert got["lora"][metric] == got["full"][metric] != 0.0
    assert got["lora"]["loss"] == got["full"]["loss"]


def test_a_lora_student_moves_its_adapter_alone_and_its_reverse_kl_falls(tiny_run_inputs, tmp_path):
    from transformers import AutoTokenizer

    model_dir = tiny_run_inputs / "model"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    records = [json.loads(line) for line in (tiny_run_inputs / "prompts.jsonl").read_text().splitlines()]
    teacher_model = apply_lora(load_hf_model(model_dir), LORA)  # the base with an adapter the student can learn
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in teacher_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    teacher = build_components(teacher_model.eval(), OptimizerConfig(), num_training_steps=1)

    torch.manual_seed(0)
    steps = 12
    settings = tiny_rl_config(tokenizer, algorithm=ALGORITHMS["grpo"], steps=steps, lr=3e-3, prompts=8, n=8, seed=1)
    student = build_components(load_hf_model(model_dir), settings.optimizer, num_training_steps=steps, lora=LORA)
    start = {k: v.clone() for k, v in student.model.state_dict().items()}
    engine = CoalescingEngine(InProcessEngine(student.model, tokenizer=tokenizer), max_prompts_per_call=8)
    state, history = run_rl_training(
        RLModels(policy=student, engine=engine, engine_shares_model=True, distill=Distillation(teacher=teacher)),
        DataBuffer(records, seed=0),
        settings,
        reward=lambda sample, record: 0.0,
        encode_prompt=lambda record: tokenizer.encode(record["prompt"], add_special_tokens=False),
        output=RunOutputs(run_dir=tmp_path, logger=NullLogger()),
    )
    assert state.step == steps
    moved = {k for k, v in student.model.state_dict().items() if not torch.equal(v, start[k])}
    assert moved and all(".lora_" in k for k in moved), sorted(moved)[:4]
    kl = [h[REVERSE_KL_METRIC] for h in history]
    # a sampled estimate (it can dip below 0 near the end): compare 3-step means, first and last
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3, kl
    assert kl[0] > 0.05, kl  # the teacher is far enough to learn from


def test_a_teacher_of_another_vocabulary_than_the_lora_student_is_refused():
    student = build_components(_tiny(0), OptimizerConfig(), num_training_steps=1, lora=LORA)
    other = build_components(
        build_tiny_model(
            80, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
            max_position_embeddings=64,
        ),
        OptimizerConfig(),
        num_training_steps=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="vocabulary has 80 tokens and the student's 64"):
        check_teacher(Distillation(teacher=other), student.model)
