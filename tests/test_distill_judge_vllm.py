"""On-policy distillation's served teacher and the LLM judge against one real vLLM CPU server: the
teacher's prompt log-probs are transformers' log-probs of the same model, and so are the
distillation advantages they give; the judge's scores are its chat replies parsed (or their parse
failures, counted by cause), identical calls are made once, and a call past its time limit fails
alone, in bounded time. The tiny model's replies are arbitrary: what is checked is the plumbing."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import torch
import trio
from run_configs import reset_vllm_weights

from rollouts.backends import build_components, compute_logprobs, load_hf_model
from rollouts.data import unpack_values
from rollouts.loops.micro_batches import plan_shard
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.distill import REVERSE_KL_METRIC, Distillation, EngineTeacher, distill_advantages
from rollouts.loops.rollouts.judge import JudgeLimits, JudgeParseError, JudgeScale, judge_reward, parse_score
from rollouts.loops.rollouts.scoring import GroupScorer, reward_errors
from rollouts.sync import ChatClient
from rollouts.types import OptimizerConfig, Sample

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Both sides compute in float32 from the same weights; only the order of the sums differs (vLLM's
# CPU kernels, torch's). A log-prob near -log(V) = -3.5 of this one-layer model comes from sums of
# at most 128 products, each order-dependent by a few float32 ulps (6e-8 relative): about 1e-6.
LOGPROB_ATOL = 1e-5
SEQUENCES = [[3, 4, 5, 6, 7, 8], [9, 2], [5] * 20, [2, 12, 13, 11, 10], [7, 7]]


@pytest.fixture(scope="module")
def served(tiny_run_inputs, vllm_for_tiny_model):
    """The session's vLLM server of the tiny model, serving the model's own weights (other tests sync
    theirs into it)."""
    reset_vllm_weights(vllm_for_tiny_model.url, tiny_run_inputs / "model")
    return vllm_for_tiny_model


def _transformers_logprobs(model, ids):
    """[T] log p(token t | tokens < t) under `model` (entry 0: 0.0, as the teacher gives it)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    picked = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return np.concatenate([[0.0], picked.numpy()])


def test_the_served_teachers_log_probs_are_transformers_log_probs(tiny_run_inputs, served):
    model = load_hf_model(tiny_run_inputs / "model")
    teacher = EngineTeacher(served.url, timeout_s=60, max_batch=2, vocab_size=model.config.vocab_size)
    rows = teacher.sequence_logprobs(SEQUENCES)  # three requests: at most 2 sequences each
    assert [len(r) for r in rows] == [len(s) for s in SEQUENCES]
    for ids, row in zip(SEQUENCES, rows, strict=True):
        np.testing.assert_allclose(row, _transformers_logprobs(model, ids), rtol=0, atol=LOGPROB_ATOL)


def test_distillation_advantages_from_the_served_teacher_are_the_in_process_teachers(tiny_run_inputs, served):
    """The same model as a served teacher and as an in-process one: the same advantages and reverse KL,
    whatever the packing (samples split over micro-batches)."""
    teacher_model = load_hf_model(tiny_run_inputs / "model")
    vocab = teacher_model.config.vocab_size
    student = build_components(
        build_tiny_model(
            vocab, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128,
            max_position_embeddings=64, seed=3,
        ),
        OptimizerConfig(),
        num_training_steps=1,
    )  # fmt: skip
    samples = [
        Sample(tokens=tuple(ids), num_prompt_tokens=1, loss_mask=(0.0,) + (1.0,) * (len(ids) - 1)) for ids in SEQUENCES
    ]
    shard = plan_shard(student, samples, max_tokens_per_micro_batch=24)
    mbs = list(shard.micro_batches)
    real = mbs[: shard.num_real]
    assert shard.num_real > 1  # the packing is exercised
    masks = unpack_values(real, [mb.loss_mask for mb in real])
    old = compute_logprobs(student, mbs)
    task = {i: np.zeros(len(masks[i]), dtype=np.float32) for i in masks}
    in_process = build_components(teacher_model.eval(), OptimizerConfig(), num_training_steps=1)
    got = {}
    for name, teacher in [("served", EngineTeacher(served.url, timeout_s=60, vocab_size=vocab)), ("local", in_process)]:
        got[name] = distill_advantages(
            Distillation(teacher=teacher), task, shard=shard, micro_batches=mbs, student=old, masks=masks
        )
    (served_adv, served_metrics), (local_adv, local_metrics) = got["served"], got["local"]
    assert set(served_adv) == set(local_adv) == set(range(len(SEQUENCES)))
    for i in local_adv:
        np.testing.assert_allclose(served_adv[i], local_adv[i], rtol=0, atol=LOGPROB_ATOL)
    assert served_metrics[REVERSE_KL_METRIC] == pytest.approx(local_metrics[REVERSE_KL_METRIC], abs=LOGPROB_ATOL)


async def _requests_finished(url):
    """vLLM's own count of the requests it has finished (its /metrics)."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        text = (await client.get(f"{url}/metrics")).text
    lines = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    assert lines, "vLLM's /metrics has no vllm:request_success_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _sample(response: str) -> Sample:
    return Sample(
        prompt="12+34=", response=response, tokens=(1, 2, 3), num_prompt_tokens=2, loss_mask=(0.0, 0.0, 1.0)
    ).replace(weight_version=0)


# The tiny tokenizer knows digits, "+" and "=" only (it drops other characters), and the context is
# 64 tokens: a short rubric of what it can read.
TEMPLATE = "{prompt}{answer}={response}="


def test_the_judge_scores_vllm_chat_replies_once_per_call_and_counts_parse_failures(served):
    responses = ["64", "46", "7", "64", "123", "7", "46"]  # 4 distinct rubrics, 3 repeats
    record = {"answer": "46"}
    scale = JudgeScale(low=0, high=100)
    reward = judge_reward(
        served.url,
        template=TEMPLATE,
        scale=scale,
        # replies of at most 16 tokens: the server refuses a max_tokens over its 64-token context
        limits=JudgeLimits(timeout_s=60, max_retries=0, max_concurrency=2, group_timeout_s=300, max_tokens=16),
    )

    async def main():
        before = await _requests_finished(served.url)
        with trio.fail_after(300):
            scored = await GroupScorer(reward).score([_sample(r) for r in responses], record)
        made = await _requests_finished(served.url) - before
        async with ChatClient(served.url, timeout_s=60, max_retries=0) as client:  # the same calls, made directly
            replies = {
                r: await client.complete(
                    [{"role": "user", "content": TEMPLATE.format(prompt="12+34=", response=r, **record)}],
                    max_tokens=16,
                )
                for r in set(responses)
            }
        return scored, made, replies

    scored, made, replies = trio.run(main)
    assert made == len(set(responses))  # identical calls of one weight version: made once
    want_errors = []
    for sample, response in zip(scored, responses, strict=True):
        try:  # greedy replies: the judge's call got the same text as the direct one
            assert sample.reward == pytest.approx(parse_score(replies[response], scale)), replies[response]
        except JudgeParseError as e:
            assert sample.reward == 0.0
            want_errors.append(f"JudgeParseError: {e}")
    assert reward_errors(scored) == want_errors, replies


def test_a_judge_call_past_its_time_limit_fails_alone_in_bounded_time(served):
    reward = judge_reward(
        served.url,
        template=TEMPLATE,
        limits=JudgeLimits(timeout_s=0.001, max_retries=1, max_concurrency=2, group_timeout_s=60, max_tokens=16),
    )

    async def main():
        with trio.fail_after(60):
            return await GroupScorer(reward).score([_sample("1"), _sample("2"), _sample("3")], {"answer": "3"})

    start = time.perf_counter()
    scored = trio.run(main)
    elapsed = time.perf_counter() - start
    errors = reward_errors(scored)
    # 3 calls, 2 at a time, 2 attempts of 1 ms each plus the retry's back-off: seconds, not the group's 60 s
    assert elapsed < 30, elapsed
    assert [s.reward for s in scored] == [0.0] * 3 and len(errors) == 3, errors
    assert all(e.startswith("EngineError") and "tim" in e.lower() for e in errors), errors
