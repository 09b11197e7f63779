"""Partial rollouts on the in-process engine: a response aborted for a weight sync continues on the new
weights, each token's log-prob from the weights that generated it (rollouts-backends + rollouts-sync)."""

from __future__ import annotations

import copy

import anyio
import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollouts.backends import InProcessEngine
from rollouts.loops.rollouts.functions import single_turn_rollout
from rollouts.sync.partial import continue_partials, token_versions
from rollouts.types import SamplingParams, Status

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def tiny(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).float().eval()


def teacher_forced(model, tokens, start):
    """Log-prob of tokens[t] given tokens[:t] for t >= start."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lp[start - 1 :].numpy()


def test_a_response_aborted_for_a_sync_continues_on_the_new_weights(tmp_path):
    v0, v1 = tiny(0), tiny(1)
    v1.save_pretrained(tmp_path / "v1", safe_serialization=True)
    engine = InProcessEngine(copy.deepcopy(v0), shares_training_model=False, eos_token_ids=(), weight_version=0)
    budget = 12
    params = SamplingParams(n=2, max_new_tokens=budget, temperature=1.0, seed=3)

    async def run():
        engine.abort()  # the sync's abort: each row stops after its next token
        partials = await engine.generate(PROMPTS, params)
        await engine.update_weights_from_disk(str(tmp_path / "v1"), 1)  # clears the abort
        done = await continue_partials(engine, partials, SamplingParams(max_new_tokens=budget, temperature=1.0, seed=4))
        return partials, done

    partials, done = anyio.run(run)
    for p, s in zip(partials, done, strict=True):
        assert p.status is Status.ABORTED and p.metadata["partial"] and p.response_length == 1
        assert s.tokens[: len(p.tokens)] == p.tokens
        n_prompt = s.num_prompt_tokens
        k = p.response_length
        versions = token_versions(s)
        assert versions == (0,) * k + (1,) * (s.response_length - k) and s.weight_version == 0
        assert s.response_length == budget or s.tokens[-1] == 1  # the budget, unless EOS ended it
        # every token's log-prob is the one of the weights that generated it
        np.testing.assert_allclose(
            s.rollout_logprobs[:k], teacher_forced(v0, list(s.tokens[: n_prompt + k]), n_prompt), atol=1e-4
        )
        np.testing.assert_allclose(s.rollout_logprobs[k:], teacher_forced(v1, list(s.tokens), n_prompt + k), atol=1e-4)


# ---------------------------------------------------------------- through the RL loop

B, N, MAX_NEW, CUT = 3, 2, 8, 3  # groups per step, samples per group, response budget, tokens before the sync


def _partial_run(tmp_path, monkeypatch, *, num_steps, partial=True):
    """The RL loop (overlap, in-process engine with its own weights) where each sync lands while the
    next batch is generating: the generation of batch b >= 1 stops after CUT tokens until the sync's
    abort (event-driven both ways: training of step b-1 waits until batch b is there). Returns
    (per-step metrics, per-step trained samples, fresh generate calls per prompt id)."""
    import threading

    import rollouts.backends.sampling.engine as inprocess
    import rollouts.loops.rl.step as step_module
    from rollouts.backends import build_components
    from rollouts.data import DataBuffer
    from rollouts.loops.engines.coalescing import CoalescingEngine
    from rollouts.loops.evaluation import Evaluation
    from rollouts.loops.recipes.tiny import build_tiny_model
    from rollouts.loops.rl.loop import RunOutputs, run_rl_training
    from rollouts.loops.rl.models import RLModels
    from rollouts.loops.run.loggers import NullLogger
    from rollouts.types import OptimizerConfig, RLConfig, RolloutConfig

    mid = {b: threading.Event() for b in range(num_steps)}  # batch b reached the middle of its generation
    fresh_calls: dict[int, int] = {}
    real_generate, real_update = inprocess.generate, step_module.rl_update

    def batch_of(prompt):
        return (prompt[0] - 3) * 8 + (prompt[1] - 3) if len(prompt) == 2 else None  # None: a continuation

    def gated_generate(model, prompts, *, should_abort, **kw):
        ids = [batch_of(p) for p in prompts]
        fresh = [i for i in ids if i is not None]
        for i in fresh:
            fresh_calls[i] = fresh_calls.get(i, 0) + 1
        batch = max((i // B for i in fresh), default=0)
        checks = 0

        def check():
            nonlocal checks
            checks += 1
            if batch >= 1 and checks == CUT and not should_abort():
                mid[batch].set()
                assert should_abort.__self__.wait(60), "the sync's abort never came"  # the engine's Event
            return should_abort()

        return real_generate(model, prompts, should_abort=check, **kw)

    trained, eval_statuses = [], []

    def recording_update(components, state, samples, config, **kw):
        trained.append(list(samples))
        if state.step + 1 < num_steps:  # the next batch is generating: the sync lands mid-way
            assert mid[state.step + 1].wait(60), "the next batch never reached the middle"
        return real_update(components, state, samples, config, **kw)

    monkeypatch.setattr(inprocess, "generate", gated_generate)
    monkeypatch.setattr(step_module, "rl_update", recording_update)
    model = build_tiny_model(32, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    config = RLConfig(
        num_steps=num_steps,
        overlap=True,
        max_tokens_per_micro_batch=64,
        rollout=RolloutConfig(
            batch_size=B,
            samples_per_prompt=N,
            partial=partial,
            sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0),
        ),
        optimizer=OptimizerConfig(schedule="constant", lr=1e-3),
    )
    components = build_components(model, config.optimizer, num_training_steps=num_steps)
    engine = CoalescingEngine(InProcessEngine(copy.deepcopy(model), shares_training_model=False, eos_token_ids=()))
    records = [{"prompt": f"p{i}", "id": i} for i in range(40)]
    evaluation = Evaluation(
        records=tuple({"prompt": f"e{i}", "id": i, "eval": True} for i in range(2)),
        every_steps=1,
        sampling=SamplingParams(n=2, max_new_tokens=MAX_NEW, temperature=1.0, seed=1),
    )

    def reward(sample, record):
        if record.get("eval"):  # evaluation has the engine to itself: never cut short by an abort
            eval_statuses.append(sample.status)
        return float(sample.tokens[-1] % 2)

    _, history = run_rl_training(
        RLModels(policy=components, engine=engine),
        DataBuffer(records, shuffle=False),
        config,
        reward=reward,
        encode_prompt=lambda r: [3 + r["id"] // 8, 3 + r["id"] % 8] + ([9] if r.get("eval") else []),
        output=RunOutputs(run_dir=tmp_path, logger=NullLogger()),
        evaluation=evaluation,
    )
    return history, trained, fresh_calls, eval_statuses


def test_a_sync_mid_generation_aborts_it_and_the_loop_continues_the_partial_samples(tmp_path, monkeypatch):
    num_steps = 3
    history, trained, fresh_calls, eval_statuses = _partial_run(tmp_path, monkeypatch, num_steps=num_steps)
    assert len(eval_statuses) == 2 * 2 * num_steps and Status.ABORTED not in eval_statuses
    assert all("eval_reward_mean" in m for m in history)
    ids = [sorted({s.metadata["id"] for s in samples}) for samples in trained]
    assert ids == [list(range(b * B, (b + 1) * B)) for b in range(num_steps)]  # none lost, none trained twice
    assert fresh_calls == dict.fromkeys(range(num_steps * B), 1)  # each prompt started once: continued, not restarted
    assert all(len(samples) == B * N for samples in trained)
    assert [m["groups_partial"] for m in history] == [0] + [B] * (num_steps - 1)
    # each partial group is asked for again (more when the evaluation's pause held a request back)
    assert all(m["groups_requested"] >= B + m["groups_partial"] for m in history)
    for b, samples in enumerate(trained[1:], start=1):  # generated across the sync after step b-1
        for s in samples:
            (old, cut), (new, rest) = s.metadata["version_segments"]
            assert (old, new) == (b - 1, b) and cut >= 1 and cut + rest == s.response_length == MAX_NEW
            assert token_versions(s) == (b - 1,) * cut + (b,) * rest
            assert s.weight_version == b - 1 and s.status is Status.TRUNCATED  # the oldest version: staleness 1
            assert len(s.rollout_logprobs) == MAX_NEW
    assert all(m["num_too_stale"] == 0 and m["num_trained"] == B * N for m in history)
    assert all(m["weight_version"] == i + 1 for i, m in enumerate(history))


def test_partial_rollouts_are_refused_where_a_response_cannot_be_continued():
    from rollouts.loops.rollouts.functions import check_partial_rollouts, tool_rollout
    from rollouts.types import AlgorithmConfig, RLConfig, RolloutConfig

    with pytest.raises(ValueError, match="rollout.partial"):
        RLConfig(rollout=RolloutConfig(partial=True))  # without overlap a sync never meets generation
    tools = tool_rollout(tool_parser=lambda text: None, tool_executor=lambda call: "")
    check_partial_rollouts(RLConfig(overlap=True, rollout=RolloutConfig(partial=True)), tools)  # continued in place
    first_n = RLConfig(overlap=True, rollout=RolloutConfig(partial=True, tail="first_n", over_sampling_factor=2.0))
    check_partial_rollouts(first_n, single_turn_rollout)
    with pytest.raises(ValueError, match="first_n.*cannot be carried"):  # an episode cannot wait for the next step
        check_partial_rollouts(first_n, tools)
    remax = RLConfig(
        overlap=True, rollout=RolloutConfig(partial=True), algorithm=AlgorithmConfig(advantage_estimator="remax")
    )
    with pytest.raises(ValueError, match="remax"):
        check_partial_rollouts(remax, single_turn_rollout)
