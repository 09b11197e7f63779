import dataclasses
import math

import numpy as np
import pytest
import torch
import trio
from helpers import fresh_components, tiny_model, train_steps
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import (
    InProcessEngine,
    export_weights,
    generate,
    sample_next_tokens,
)
from rollouts.types import InferenceEngine, SamplingParams, Status, TrainingState

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def _teacher_forced_logprobs(model, sample, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(sample.tokens[1:])[:, None])[:, 0]
    return lp[sample.num_prompt_tokens - 1 :].numpy()


def test_greedy_matches_transformers_generate(model):
    samples = generate(model, PROMPTS, SamplingParams(n=1, max_new_tokens=8, temperature=0.0))
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert list(sample.tokens) == ref[0].tolist()
        assert sample.status == Status.TRUNCATED and sample.response_length == 8


def test_sampled_logprobs_equal_teacher_forced_logprobs(model):
    """At temperature t without truncation, the reported log-probs are the model's at t."""
    for temperature in (1.0, 0.7):
        samples = generate(model, PROMPTS, SamplingParams(n=2, max_new_tokens=6, temperature=temperature, seed=3))
        for s in samples:
            np.testing.assert_allclose(s.rollout_logprobs, _teacher_forced_logprobs(model, s, temperature), atol=1e-4)


def test_layout_and_determinism(model):
    a = generate(model, PROMPTS, SamplingParams(n=3, max_new_tokens=5, seed=11))
    b = generate(model, PROMPTS, SamplingParams(n=3, max_new_tokens=5, seed=11))
    c = generate(model, PROMPTS, SamplingParams(n=3, max_new_tokens=5, seed=12))
    assert a == b and a != c
    assert [s.group_index for s in a] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for s in a:
        prompt = PROMPTS[s.group_index]
        assert list(s.prompt_tokens) == prompt and s.num_prompt_tokens == len(prompt)
        assert s.loss_mask == (0.0,) * len(prompt) + (1.0,) * s.response_length
        assert all(lp <= 0.0 for lp in s.rollout_logprobs)


def test_stop_tokens_complete_a_sample_and_are_kept(model):
    free = generate(model, PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=5))
    stop = free[0].response_tokens[2]
    samples = generate(model, PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=5, stop_token_ids=(stop,)))
    first = samples[0]
    assert first.status == Status.COMPLETED and first.response_tokens[-1] == stop
    assert first.response_tokens == free[0].response_tokens[: first.response_length]
    for s in samples:
        assert (s.status == Status.COMPLETED) == (stop in s.response_tokens)
        if s.status == Status.TRUNCATED:
            assert s.response_length == 6
        else:
            assert s.response_tokens.index(stop) == s.response_length - 1
    # Finished rows leave the batch: the others still get the right tokens (teacher-forced check).
    for s in samples:
        np.testing.assert_allclose(s.rollout_logprobs, _teacher_forced_logprobs(model, s), atol=1e-4)


def test_bad_requests_are_rejected(model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[1, 500]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[3]], SamplingParams(max_new_tokens=2, top_p=0.0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, [[3]], SamplingParams(max_new_tokens=10_000))


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, width=32), min_size=6, max_size=6),
    temperature=st.floats(0.2, 2.0),
    top_p=st.floats(0.05, 1.0),
    top_k=st.sampled_from([-1, 1, 2, 4]),
    seed=st.integers(0, 2**31),
)
def test_sampled_token_lies_in_the_truncated_set(logits, temperature, top_p, top_k, seed):
    logits_B_V = torch.tensor([logits], dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    token, logprob = sample_next_tokens(logits_B_V, temperature=temperature, top_p=top_p, top_k=top_k, generator=g)
    probs = torch.softmax(logits_B_V[0] / temperature, -1)
    rank = int((probs > probs[token]).sum())
    if top_k > 0:
        assert rank < top_k
    mass_above = float(probs[probs > probs[token]].sum())
    assert mass_above < top_p + 1e-5
    # Truncation renormalizes: the log-prob can only rise above the untruncated one.
    assert math.isfinite(float(logprob)) and float(logprob) <= 1e-6
    assert float(logprob) >= float(torch.log(probs[token])) - 1e-5


def test_engine_follows_the_protocol_and_syncs_weights(tmp_path):
    training = fresh_components()
    engine = InProcessEngine(training.model)
    assert isinstance(engine, InferenceEngine)
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)

    async def scenario():
        samples = await engine.generate(PROMPTS[:2], params)
        assert len(samples) == 4 and all(s.weight_version == 0 for s in samples)
        no_lp = await engine.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=2, logprobs=False))
        assert no_lp[0].rollout_logprobs is None
        await engine.update_weights_from_disk(str(tmp_path / "unused"), 1)  # shared model: no-op
        assert await engine.weight_version() == 1 and await engine.health()

        separate = InProcessEngine(tiny_model(seed=5), shares_training_model=False)
        train_steps(training, TrainingState(), 1)
        directory, _ = export_weights(training, tmp_path / "w")
        await separate.update_weights_from_disk(str(directory), 1)
        assert await separate.weight_version() == 1
        expected = [dataclasses.replace(s, weight_version=1) for s in await engine.generate(PROMPTS, params)]
        assert await separate.generate(PROMPTS, params) == expected
        with pytest.raises(ValueError, match="only grow"):
            await separate.update_weights_from_disk(str(directory), 0)

    trio.run(scenario)


@settings(max_examples=30, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 2**62), min_size=3, max_size=3),
    order=st.permutations([0, 1, 2]),
    active=st.lists(st.booleans(), min_size=9, max_size=9),
    top_p=st.sampled_from([1.0, 0.9]),
)
def test_each_prompts_rows_draw_from_its_own_stream_whatever_the_batch(seeds, order, active, top_p):
    """With one generator per prompt, a prompt's rows get the tokens they get alone with its seed, in
    any batch order and with any rows already finished: which requests share a batch cannot change
    what a seeded prompt samples. (Same logits on both sides: a batched forward pass may round the
    logits differently, which the loop-level test covers.)"""
    g = torch.Generator().manual_seed(0)
    logits = {i: torch.randn(3, 50, generator=g) for i in range(3)}  # 3 rows per prompt
    rows = {i: [r for r in range(3) if active[3 * i + r]] or [0] for i in range(3)}

    def draw(prompts):
        gens = {i: torch.Generator().manual_seed(seeds[i]) for i in prompts}
        logits_B_V = torch.cat([logits[i][rows[i]] for i in prompts])
        runs = [(gens[i], len(rows[i])) for i in prompts]
        tokens, _ = sample_next_tokens(logits_B_V, temperature=1.0, top_p=top_p, top_k=-1, generator=runs)
        out, start = {}, 0
        for i in prompts:
            out[i] = tokens[start : start + len(rows[i])].tolist()
            start += len(rows[i])
        return out

    batched = draw(order)
    for i in range(3):
        assert batched[i] == draw([i])[i]


def test_a_batched_generate_gives_each_seeded_prompt_its_own_samples(model):
    """End to end on prompts of one length (no padding): batched with per-prompt seeds, each prompt
    samples what it samples alone (the model's rows do not interact)."""
    prompts = [[5, 6, 7], [12, 13, 14], [9, 8, 7]]
    kwargs = {"n": 2, "max_new_tokens": 5, "temperature": 1.0, "stop_token_ids": (3, 17)}
    alone = [generate(model, [p], SamplingParams(seed=100 + i, **kwargs)) for i, p in enumerate(prompts)]
    batched = generate(model, prompts, SamplingParams(**kwargs), seeds=[100, 101, 102])
    for i in range(3):
        got = batched[2 * i : 2 * i + 2]
        assert [s.tokens for s in got] == [s.tokens for s in alone[i]]
        # Log-probs agree up to the batched forward's float32 rounding: a few ulps of logits of size
        # ~10 (ulp 1e-6) through five steps.
        for a, b in zip(got, alone[i], strict=True):
            np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=1e-4)


def test_one_seed_per_prompt_must_match_the_prompts(model):
    with pytest.raises(ValueError, match="one int/None per prompt"):
        generate(model, PROMPTS, seeds=[1, 2])
    engine = InProcessEngine(model)
    a = trio.run(engine.generate_seeded, PROMPTS[:2], SamplingParams(n=2, max_new_tokens=4), [5, 6])
    b = trio.run(engine.generate, PROMPTS[1:2], SamplingParams(n=2, max_new_tokens=4, seed=6))
    assert [s.tokens for s in a[2:]] == [s.tokens for s in b]


def test_trainer_log_probs_describe_the_truncated_distribution_the_sampler_drew_from(model):
    """T = 0.7, top_p = 0.9, top_k = 20: the in-process sampler reports log-probs after truncation;
    the trainer, given the same settings, computes the same ones (without them it would compare
    against the full softmax: biased ratios and KL)."""
    from helpers import packed_batch

    from rollouts.backends import build_components, compute_logprobs
    from rollouts.types import OptimizerConfig

    settings_ = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
    samples = generate(model, PROMPTS, SamplingParams(n=4, max_new_tokens=8, seed=5, **settings_))
    components = build_components(model, OptimizerConfig(), num_training_steps=1)
    diffs, full_diffs = [], []
    for s in samples:
        mb = packed_batch([s.tokens], num_prompt=s.num_prompt_tokens)
        for dist, out in ((settings_, diffs), ({"temperature": 0.7}, full_diffs)):
            (lp,) = compute_logprobs(components, [mb], **dist)
            trainer = lp[0, s.num_prompt_tokens : len(s.tokens)]
            out.extend(abs(float(a) - float(b)) for a, b in zip(trainer, s.rollout_logprobs, strict=True))
    assert sum(diffs) / len(diffs) <= 1e-3 and max(diffs) < 1e-4  # float32 rounding only
    assert sum(full_diffs) / len(full_diffs) > 1e-3  # the untruncated softmax is another distribution


@pytest.mark.parametrize("abort_at", [1, 3, 7])
def test_an_aborted_generate_keeps_partials_that_continue_to_the_same_response(model, abort_at):
    budget = 10
    full = generate(model, PROMPTS, SamplingParams(n=2, max_new_tokens=budget, temperature=0.0))
    steps = iter(range(1, 100))
    partials = generate(
        model,
        PROMPTS,
        SamplingParams(n=2, max_new_tokens=budget, temperature=0.0),
        should_abort=lambda: next(steps) >= abort_at,
    )
    for f, p in zip(full, partials, strict=True):
        assert p.status is Status.ABORTED and p.metadata["partial"] is True
        assert p.response_length == abort_at and p.tokens == f.tokens[: p.num_prompt_tokens + abort_at]
        np.testing.assert_allclose(p.rollout_logprobs, f.rollout_logprobs[:abort_at], atol=1e-5)
        [rest] = generate(model, [list(p.tokens)], SamplingParams(max_new_tokens=budget - abort_at, temperature=0.0))
        assert p.response_tokens + rest.response_tokens == f.response_tokens  # nothing lost or repeated
        np.testing.assert_allclose(
            [*p.rollout_logprobs, *rest.rollout_logprobs], f.rollout_logprobs, atol=1e-4
        )  # prefill of prompt + partial vs the KV cache: float rounding only
        assert p.response_length + rest.response_length == budget


def test_rows_that_stopped_before_an_abort_stay_completed(model):
    first = generate(model, PROMPTS, SamplingParams(n=1, max_new_tokens=2, temperature=0.0))
    stop = first[0].response_tokens[0]  # prompt 0 stops at its first token
    calls = iter(range(100))
    out = generate(
        model,
        PROMPTS,
        SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,)),
        should_abort=lambda: next(calls) >= 1,
    )
    assert out[0].status is Status.COMPLETED and out[0].response_length == 1 and "partial" not in out[0].metadata
    for s in out[1:]:
        assert s.status in (Status.ABORTED, Status.COMPLETED)
        assert s.response_length <= 2


def test_engine_abort_cuts_generations_until_resumed_or_synced(model, tmp_path):
    engine = InProcessEngine(model, weight_version=0)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)

    async def run():
        engine.abort()
        cut = await engine.generate(PROMPTS, params)
        again = await engine.generate(PROMPTS, params)  # still aborted: nothing cleared it
        engine.resume()
        whole = await engine.generate(PROMPTS, params)
        engine.abort()
        await engine.update_weights_from_disk(str(tmp_path), 1)  # a weight update clears the abort
        synced = await engine.generate(PROMPTS, params)
        return cut, again, whole, synced

    cut, again, whole, synced = trio.run(run)
    assert all(s.status is Status.ABORTED and s.response_length == 1 and s.metadata["partial"] for s in cut + again)
    assert all(s.status is not Status.ABORTED and "partial" not in s.metadata for s in whole + synced)
    assert [s.tokens[: len(c.tokens)] for s, c in zip(whole, cut, strict=True)] == [c.tokens for c in cut]
