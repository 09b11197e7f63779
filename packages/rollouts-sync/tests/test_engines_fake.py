"""VLLMEngine and SGLangEngine against the fake server: request/response shapes, Samples, weight updates."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from safetensors.numpy import save_file

from rollouts.sync import EngineError, HTTPOptions, RetryPolicy, SGLangEngine, VLLMEngine
from rollouts.sync.fake_http import Fault
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.types import InferenceEngine, SamplingParams, Status

FAST_RETRY = RetryPolicy(max_retries=2, backoff_base_s=0.01, backoff_max_s=0.02)
ENGINES = [VLLMEngine, SGLangEngine]


def write_checkpoint(path, seed: int, names=("w1", "w2")) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {n: rng.standard_normal((4, 3)).astype(np.float32) for n in names}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("engine_cls", ENGINES)
@pytest.mark.anyio
async def test_generate_prompt_major_with_logprobs(engine_cls, tmp_path):
    prompts = [[1, 2, 3], [4, 5], [6]]
    params = SamplingParams(n=2, max_new_tokens=5, temperature=0.0, logprobs=True)

    state = FakeEngineState()
    async with serve_fake_engine(state) as server, engine_cls(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine:
        assert isinstance(engine, InferenceEngine)
        samples = await engine.generate(prompts, params)
    assert len(samples) == 6
    for k, s in enumerate(samples):
        prompt = prompts[k // 2]
        ids, lps = state.greedy(prompt, 5)
        assert s.prompt_tokens == tuple(prompt)
        assert s.response_tokens == tuple(ids)
        assert s.num_prompt_tokens == len(prompt)
        assert s.loss_mask == (0.0,) * len(prompt) + (1.0,) * len(ids)
        # Samples store log-probs as float32: rounding to nearest is within half an ulp (2**-24 relative)
        np.testing.assert_allclose(s.rollout_logprobs, lps, rtol=2.0**-24, atol=0)
        assert s.status is Status.TRUNCATED  # no EOS in the fake vocab: max_new_tokens reached


@pytest.mark.parametrize("engine_cls", ENGINES)
@pytest.mark.anyio
async def test_stop_token_completes_and_no_logprobs(engine_cls):
    state = FakeEngineState()
    async with serve_fake_engine(state) as server, engine_cls(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine:
        first = state.greedy([7, 7], 3)[0]
        stop = first[1]
        samples = await engine.generate(
            [[7, 7]], SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=(stop,), logprobs=False)
        )
    s = samples[0]
    assert s.rollout_logprobs is None
    assert s.response_tokens[-1] == stop
    assert s.status is (Status.COMPLETED if first.index(stop) < 2 else Status.TRUNCATED)


def test_vllm_request_body_has_token_id_options():
    engine = VLLMEngine("http://127.0.0.1:1")
    body = engine.completion_request([[1, 2]], SamplingParams(n=3, max_new_tokens=4, temperature=0.5, seed=9), "m")
    assert body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 0 and body["n"] == 3 and body["max_tokens"] == 4 and body["seed"] == 9
    assert body["prompt"] == [[1, 2]]


def test_sglang_request_repeats_prompts_prompt_major():
    body = SGLangEngine.generate_request([[1], [2, 3]], SamplingParams(n=2))
    assert body["input_ids"] == [[1], [1], [2, 3], [2, 3]]
    assert body["sampling_params"]["n"] == 1 and body["return_logprob"] is True


@pytest.mark.anyio
async def test_sglang_seeded_copies_of_a_prompt_get_their_own_seeds():
    body = SGLangEngine.generate_request([[1], [2, 3]], SamplingParams(n=2, seed=7))
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [7, 8, 9, 10]

    async with serve_fake_engine(FakeEngineState()) as server, SGLangEngine(server.url) as engine:
        params = SamplingParams(n=6, max_new_tokens=8, temperature=1.0, seed=3)
        first = await engine.generate([[1, 2]], params)
        again = await engine.generate([[1, 2]], params)
    assert len({s.tokens for s in first}) > 1  # a group with something to learn from
    assert [s.tokens for s in first] == [s.tokens for s in again]  # and still reproducible


@pytest.mark.parametrize("engine_cls", ENGINES)
@pytest.mark.anyio
async def test_update_weights_from_disk_changes_tokens_and_version(engine_cls, tmp_path):
    write_checkpoint(tmp_path / "v1", seed=1)
    write_checkpoint(tmp_path / "v2", seed=2)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    state = FakeEngineState()
    async with serve_fake_engine(state) as server, engine_cls(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine:
        assert await engine.weight_version() is None  # "default" before any update
        await engine.update_weights_from_disk(str(tmp_path / "v1"), 1)
        before = (await engine.generate([[3, 4]], params))[0]
        assert before.weight_version == 1
        await engine.update_weights_from_disk(str(tmp_path / "v2"), 2)
        after = (await engine.generate([[3, 4]], params))[0]
        assert await engine.weight_version() == 2 and after.weight_version == 2
        assert after.response_tokens == tuple(state.greedy([3, 4], 6)[0])
        assert before.response_tokens != after.response_tokens
        assert state.num_cache_resets == 2 and not state.paused
        paths = [target.split("?")[0] for _, target in state.calls]
        if engine_cls is VLLMEngine:
            i = paths.index("/collective_rpc")
            assert paths[i - 1 : i + 5] == [
                "/pause",
                "/collective_rpc",  # the files read and held, answering their checksums (attestation)
                "/collective_rpc",  # the checksums agree: the reload
                "/reset_prefix_cache",
                "/update_weight_version",
                "/resume",
            ]
        else:
            i = paths.index("/update_weights_from_disk")
            assert paths[i - 1 : i + 3] == [
                "/pause_generation",
                "/update_weights_from_disk",
                "/flush_cache",
                "/continue_generation",
            ]


@pytest.mark.parametrize("engine_cls", ENGINES)
@pytest.mark.anyio
async def test_failed_update_resumes_and_names_the_error(engine_cls, tmp_path):
    state = FakeEngineState()
    async with serve_fake_engine(state) as server, engine_cls(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine:
        with pytest.raises(EngineError) as info:
            await engine.update_weights_from_disk(str(tmp_path / "missing"), 1)
        assert server.url in str(info.value)
        assert "missing" in str(info.value)
        assert not state.paused  # resumed even though the update failed
        assert await engine.weight_version() is None


@pytest.mark.anyio
async def test_update_from_tensors_partial(tmp_path):
    full = write_checkpoint(tmp_path / "v1", seed=1)

    state = FakeEngineState()
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine:
        await engine.update_weights_from_disk(str(tmp_path / "v1"), 1)
        new_w2 = np.full((4, 3), 0.5, np.float32)
        await engine.update_weights_from_tensors({"w2": new_w2}, 2, chunk_bytes=1)
        assert await engine.weight_version() == 2
        np.testing.assert_array_equal(state.weights["w1"], full["w1"])  # untouched
        np.testing.assert_array_equal(state.weights["w2"], new_w2)
        with pytest.raises(ValueError, match="non-empty"):
            await engine.update_weights_from_tensors({}, 3)


@pytest.mark.parametrize("engine_cls", ENGINES)
@pytest.mark.anyio
async def test_api_key_only_in_authorization_header(engine_cls, caplog):
    secret = "sk-very-secret-123"

    async def main():
        state = FakeEngineState(api_key=secret)
        async with serve_fake_engine(state) as server:
            async with engine_cls(server.url, api_key=secret, http=HTTPOptions(retry=FAST_RETRY)) as engine:
                assert secret not in repr(engine) and secret not in engine.name
                assert await engine.health()
                await engine.generate([[1]], SamplingParams(max_new_tokens=2))
            async with engine_cls(server.url, api_key="wrong", http=HTTPOptions(retry=FAST_RETRY)) as bad:
                with pytest.raises(EngineError) as info:
                    await bad.generate([[1]], SamplingParams(max_new_tokens=2))
                assert info.value.status == 401
                assert len([c for c in state.calls if c[0] == "POST"]) >= 1
        assert all(secret not in target for _, target in state.calls)
        assert f"Bearer {secret}" in state.auth_headers
        assert secret not in str(info.value)

    with caplog.at_level(logging.DEBUG):
        await main()
    assert secret not in caplog.text


@pytest.mark.anyio
async def test_bad_input_raises_at_the_edge():
    engine = VLLMEngine("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="empty"):
        await engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\]"):
        await engine.generate([[1, -2]], SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        await engine.generate([[1]], {"n": 2})
    with pytest.raises(ValueError, match="credentials"):
        VLLMEngine("http://user:pw@127.0.0.1:1")
    with pytest.raises(ValueError, match="weight_version"):
        await engine.update_weights_from_disk("/x", -1)


@pytest.mark.parametrize("finish", ["abort", "error", None])
def test_a_vllm_choice_that_did_not_finish_is_an_error_not_a_sample(finish):
    from rollouts.sync.vllm import parse_completion_response

    def choice(index, reason):
        return {
            "index": index,
            "text": "",
            "token_ids": [5, 6],
            "finish_reason": reason,
            "logprobs": {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.1, -0.2]},
        }

    params = SamplingParams(n=2, max_new_tokens=2)
    good = parse_completion_response(
        {"choices": [choice(0, "stop"), choice(1, "length")]}, [[1, 2]], params, weight_version=1, engine="e"
    )
    assert [s.status for s in good] == [Status.COMPLETED, Status.TRUNCATED]
    with pytest.raises(EngineError, match=rf"choice 1 ended with finish_reason={finish!r}"):
        parse_completion_response(
            {"choices": [choice(0, "stop"), choice(1, finish)]}, [[1, 2]], params, weight_version=1, engine="e"
        )


def test_the_worker_extension_hint_is_given_for_a_missing_or_older_extension_only():
    from rollouts.sync import EngineError
    from rollouts.sync.tensor_rpc import with_extension_hint

    def hint(text: str, method: str = "rollouts_commit") -> bool:
        error = EngineError(f"http://e: /collective_rpc failed: {text}", engine="http://e", url="u", status=500)
        return "--worker-extension-cls" in str(with_extension_hint(error, method))

    assert hint("NotImplementedError: Method 'rollouts_commit' is not implemented.")  # vLLM's words
    assert hint("TypeError: rollouts_load_dir() got an unexpected keyword argument 'hold'", "rollouts_load_dir")
    assert not hint("RuntimeError: commit of receive 'ab': none is held (a later receive dropped it)")
    assert not hint("NotImplementedError: Method 'reload_weights' is not implemented.", "reload_weights")


@pytest.mark.anyio
async def test_sglang_pauses_with_a_mode_in_the_body_and_reads_the_version_where_its_server_has_it(tmp_path):
    """SGLang >= 0.5.8 refuses /pause_generation without a JSON body naming the mode; 0.5.23 has no
    /get_weight_version (its /model_info reports the version)."""
    write_checkpoint(tmp_path / "v1", seed=1)
    state = FakeEngineState()
    state.faults.append(Fault(kind="status", path="/get_weight_version", status=404, times=99))
    async with (
        serve_fake_engine(state) as server,
        SGLangEngine(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine,
    ):
        await engine.update_weights_from_disk(str(tmp_path / "v1"), 3)
        assert await engine.weight_version() == 3
    paths = [target.split("?")[0] for _, target in state.calls]
    assert paths.count("/get_weight_version") == 1 and paths.count("/model_info") == 2  # asked once, then not
    with pytest.raises(ValueError, match="pause_mode must be one of"):
        SGLangEngine("http://127.0.0.1:9", pause_mode="wait")  # vLLM's mode, not SGLang's
