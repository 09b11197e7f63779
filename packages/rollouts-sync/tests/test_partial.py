"""Partial rollouts: aborted responses kept with tokens, log-probs and versions, continued after a sync."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from rollouts.sync import HTTPOptions, RetryPolicy, VLLMEngine
from rollouts.sync._common import make_sample
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.sync.partial import (
    continuation_prompt,
    continue_partials,
    join_continuation,
    oldest_version,
    token_versions,
    version_segments,
)
from rollouts.types import Sample, SamplingParams, Status

FAST_RETRY = RetryPolicy(max_retries=2, backoff_base_s=0.01, backoff_max_s=0.02)


def weights_of(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 2), float(version), dtype=np.float32)}


def reference(state: FakeEngineState, prompt: list[int], versions: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and log-probs where token j comes from the weights of versions[j]."""
    ids: list[int] = []
    lps: list[float] = []
    for v in versions:
        state.weights = weights_of(v)
        lp = state.logprobs_V([*prompt, *ids])
        ids.append(int(lp.argmax()))
        lps.append(float(lp[ids[-1]]))
    return ids, lps


@pytest.mark.anyio
async def test_vllm_response_continued_across_a_sync_keeps_each_tokens_logprob(tmp_path):
    budget, cut, prompts = 9, 4, [[1, 2, 3], [4, 5]]
    params = SamplingParams(n=1, max_new_tokens=budget, temperature=0.0)
    for v in (0, 1):
        (tmp_path / f"v{v}").mkdir()
        save_file(weights_of(v), str(tmp_path / f"v{v}" / "model.safetensors"))
    state = FakeEngineState()
    async with (
        serve_fake_engine(state) as server,
        VLLMEngine(server.url, http=HTTPOptions(retry=FAST_RETRY), keep_partial=True) as engine,
    ):
        await engine.update_weights_from_disk(str(tmp_path / "v0"), 0)
        state.abort_after_tokens = cut
        partials = await engine.generate(prompts, params)
        state.abort_after_tokens = None
        await engine.update_weights_from_disk(str(tmp_path / "v1"), 1)
        done = await continue_partials(engine, partials, params)
    for prompt, p, s in zip(prompts, partials, done, strict=True):
        assert p.status is Status.ABORTED and p.metadata["partial"] and p.response_length == cut
        ids, lps = reference(state, prompt, [0] * cut + [1] * (budget - cut))
        assert s.prompt_tokens == tuple(prompt)
        assert s.response_tokens == tuple(ids)  # nothing lost, nothing repeated
        assert s.response_length == budget
        np.testing.assert_allclose(s.rollout_logprobs, lps, rtol=2.0**-24, atol=0)  # float32 storage: half an ulp
        assert s.loss_mask == (0.0,) * len(prompt) + (1.0,) * budget
        assert version_segments(s) == ((0, cut), (1, budget - cut))
        assert s.weight_version == 0 == oldest_version(s)  # staleness bounds apply to the oldest token
        assert s.status is Status.TRUNCATED and "partial" not in s.metadata


@pytest.mark.anyio
async def test_an_aborted_choice_fails_the_request_unless_partials_are_kept():
    state = FakeEngineState(abort_after_tokens=2)
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine:
        with pytest.raises(Exception, match="finish_reason='abort'"):
            await engine.generate([[1]], SamplingParams(max_new_tokens=5, temperature=0.0))


@dataclass
class VersionedEngine:
    """An in-memory InferenceEngine over the fake server's model: `version` picks the weights and
    `abort_after` cuts each response (a partial) the way an abort of a weight sync would."""

    state: FakeEngineState
    version: int = 0
    abort_after: int | None = None

    async def generate(self, prompts, params):
        self.state.weights = weights_of(self.version)
        out = []
        for prompt in prompts:
            ids, lps, finish = self.state.sample(
                list(prompt), max_new_tokens=params.max_new_tokens, temperature=0.0, stop=set(), rng=None
            )
            partial = self.abort_after is not None and len(ids) > self.abort_after
            if partial:
                ids, lps = ids[: self.abort_after], lps[: self.abort_after]
            s = make_sample(
                prompt_ids=prompt,
                response_ids=ids,
                logprobs_R=lps,
                truncated=finish == "length",
                weight_version=self.version,
                engine="mem",
            )
            if partial:
                s = s.with_metadata(partial=True)
                s = Sample(**{**{f: getattr(s, f) for f in s.__dataclass_fields__}, "status": Status.ABORTED})
            out.append(s)
        return out


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(1, 24),
    cuts=st.lists(st.integers(0, 24), min_size=0, max_size=5),
    prompt=st.lists(st.integers(0, 31), min_size=1, max_size=4),
)
def test_any_abort_points_give_the_budget_with_each_tokens_version(budget, cuts, prompt):
    import anyio

    state = FakeEngineState()
    engine = VersionedEngine(state)
    params = SamplingParams(max_new_tokens=budget, temperature=0.0)

    async def run() -> tuple[Sample, list[int]]:
        versions: list[int] = []
        engine.abort_after = cuts[0] if cuts else None
        [s] = await engine.generate([prompt], params)
        versions += [engine.version] * s.response_length
        for k, cut in enumerate([*cuts[1:], None]):
            if not s.metadata.get("partial"):
                break
            engine.version += 1  # a weight sync between the abort and the continuation
            engine.abort_after = cut
            before = s.response_length
            [s] = await continue_partials(engine, [s], params)
            versions += [engine.version] * (s.response_length - before)
            assert k < len(cuts)
        return s, versions

    s, versions = anyio.run(run)
    ids, lps = reference(state, prompt, versions)
    assert s.response_tokens == tuple(ids)
    np.testing.assert_allclose(s.rollout_logprobs, lps, rtol=2.0**-24, atol=0)  # float32 storage: half an ulp
    assert token_versions(s) == tuple(versions)
    assert s.weight_version == versions[0] == oldest_version(s)
    if not s.metadata.get("partial"):
        assert s.response_length == budget  # no EOS in the fake vocab: every response fills its budget
        assert s.status is Status.TRUNCATED


def test_bad_partials_and_continuations_are_refused():
    full = make_sample(
        prompt_ids=[1], response_ids=[2, 3], logprobs_R=[-0.1, -0.2], truncated=True, weight_version=0, engine="e"
    )
    with pytest.raises(ValueError, match="not partial"):
        continuation_prompt(full, 4)
    partial = full.with_metadata(partial=True)
    assert continuation_prompt(partial, 5) == ((1, 2, 3), 3)
    with pytest.raises(ValueError, match="over max_new_tokens=1"):
        continuation_prompt(partial, 1)
    other = make_sample(
        prompt_ids=[1, 2], response_ids=[4], logprobs_R=[-0.3], truncated=True, weight_version=1, engine="e"
    )
    with pytest.raises(ValueError, match="not the partial sample's"):
        join_continuation(partial, other)
    with pytest.raises(ValueError, match="both carry"):
        join_continuation(
            partial,
            make_sample(
                prompt_ids=[1, 2, 3], response_ids=[4], logprobs_R=None, truncated=True, weight_version=1, engine="e"
            ),
        )
    with pytest.raises(ValueError, match="summing to the response length 2"):
        version_segments(full.with_metadata(version_segments=[[0, 1]]))


def test_a_continued_response_text_is_the_partial_text_and_the_continuation():
    partial = make_sample(
        prompt_ids=[1], response_ids=[2, 3], logprobs_R=[-0.1, -0.2], truncated=False, weight_version=0, engine="e"
    )
    partial = replace(partial, response="ab", status=Status.ABORTED, metadata={"partial": True})
    rest = make_sample(
        prompt_ids=[1, 2, 3], response_ids=[4], logprobs_R=[-0.3], truncated=True, weight_version=1, engine="e"
    )
    joined = join_continuation(partial, replace(rest, response="cd"))
    assert joined.response == "abcd" and joined.response_tokens == (2, 3, 4)
    assert token_versions(joined) == (0, 0, 1) and joined.weight_version == 0
