"""LoRA adapters synced to a real vLLM CPU server through its runtime LoRA endpoints, and the merged
fallback: after each sync vLLM's greedy tokens equal transformers' with the same adapter and its
log-probs agree within 1e-4."""

import httpx
import numpy as np
import pytest
import torch
import trio
from run_configs import reset_vllm_weights

from rollouts.backends import build_components
from rollouts.backends.train.lora import syncs_adapter
from rollouts.loops.rl.generation import sync_engine
from rollouts.sync import HTTPOptions, VLLMEngine
from rollouts.types import LoraConfig, OptimizerConfig, SamplingParams, TrainingState

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]
NEW_TOKENS = 6
# float32 on both sides: vLLM applies the adapter as x @ A^T @ B^T * scale beside the base matmul and
# transformers (PEFT) the same; they differ only in summation order, ~1e-6 on these log-probs.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def lora_server(tiny_run_inputs, vllm_for_tiny_model):
    """The session's server (started with --max-lora-rank 8), serving the model's own weights."""
    reset_vllm_weights(vllm_for_tiny_model.url, tiny_run_inputs / "model")
    return vllm_for_tiny_model


def _components(inputs, *, sync, seed):
    components = build_components(
        inputs / "model", OptimizerConfig(), num_training_steps=1, lora=LoraConfig(rank=8, alpha=16.0, sync=sync)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a visible adapter (B = 0 would change nothing)
        for name, param in components.model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return components


def _transformers_greedy(model, prompt):
    """Greedy ids (up to EOS) and their log-probs from full forwards of the LoRA model (no KV cache)."""
    model.eval()
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
            if token == model.config.eos_token_id:  # vLLM stops there too
                break
    return ids[len(prompt) :], logprobs


async def _sync_and_generate(components, engine, run_dir, version):
    state = TrainingState(weight_version=version - 1)
    state, _ = await sync_engine(components, engine, state, run_dir, shares_model=False, lock=trio.Lock())
    assert state.weight_version == version and await engine.weight_version() == version
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, logprobs=True)
    return await engine.generate(PROMPTS, params)


def _assert_matches(samples, model):
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        tokens, logprobs = _transformers_greedy(model, prompt)
        assert list(sample.tokens[len(prompt) :]) == tokens
        np.testing.assert_allclose(sample.rollout_logprobs, logprobs, rtol=0, atol=LOGPROB_ATOL)


def _served(url):
    return sorted(m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"])


def test_adapter_sync_serves_the_trained_adapter_and_replaces_the_old_one(tiny_run_inputs, lora_server, tmp_path):
    engine = VLLMEngine(lora_server.url, http=HTTPOptions(timeout_s=120.0))
    first = _components(tiny_run_inputs, sync="adapter", seed=1)
    assert syncs_adapter(first.model)
    samples = trio.run(_sync_and_generate, first, engine, tmp_path, 1)
    assert engine.adapter == "rollouts-v1"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file() and not (tmp_path / "weights").exists()
    _assert_matches(samples, first.model)

    second = _components(tiny_run_inputs, sync="adapter", seed=2)
    samples = trio.run(_sync_and_generate, second, engine, tmp_path, 2)
    assert engine.adapter == "rollouts-v2"
    assert "rollouts-v1" not in _served(lora_server.url) and "rollouts-v2" in _served(lora_server.url)
    _assert_matches(samples, second.model)

    # a trainer restarted from an earlier step reaches version 2 again: the server holds that name already
    restarted = VLLMEngine(lora_server.url, http=HTTPOptions(timeout_s=120.0))
    samples = trio.run(_sync_and_generate, second, restarted, tmp_path, 2)
    assert restarted.adapter == "rollouts-v2"
    _assert_matches(samples, second.model)


def test_an_adapter_above_the_servers_max_rank_is_refused_with_the_fix(tiny_run_inputs, lora_server, tmp_path):
    from rollouts.sync import EngineError

    engine = VLLMEngine(lora_server.url, http=HTTPOptions(timeout_s=120.0))
    components = build_components(
        tiny_run_inputs / "model", OptimizerConfig(), num_training_steps=1, lora=LoraConfig(rank=16)
    )
    with pytest.raises(EngineError, match=r"--max-lora-rank >= the adapter's rank") as info:
        trio.run(_sync_and_generate, components, engine, tmp_path, 4)
    assert info.value.status == 500 and "rank" in info.value.text, info.value.text  # what vLLM 0.32 answers


def test_an_adapter_sent_by_broadcast_serves_the_trained_adapter(tiny_run_inputs, lora_server, tmp_path):
    """engine.sync = 'broadcast' with model.lora.sync = 'adapter': the adapter's tensors alone go by
    broadcast (attested), the workers write them on the engine's host, vLLM serves them as a runtime
    adapter, and nothing of the adapter is read from the trainer's disk by the engine."""
    from rollouts.loops.engines.broadcast import BroadcastWeights
    from rollouts.sync import BroadcastOptions

    inner = VLLMEngine(lora_server.url, http=HTTPOptions(timeout_s=120.0))
    engine = BroadcastWeights(inner, BroadcastOptions(bucket_bytes=4096, bucket_timeout_s=60.0))
    for version, seed in ((5, 5), (6, 6)):  # the second replaces the first, over the same group
        components = _components(tiny_run_inputs, sync="adapter", seed=seed)
        samples = trio.run(_sync_and_generate, components, engine, tmp_path / f"v{version}", version)
        assert inner.adapter == f"rollouts-v{version}" and engine.sync.last_num_bytes > 4096  # several buckets
        _assert_matches(samples, components.model)
    served = _served(lora_server.url)
    assert "rollouts-v6" in served and "rollouts-v5" not in served


def test_merged_sync_serves_the_same_policy_as_full_weights(tiny_run_inputs, lora_server, tmp_path):
    """Last: it replaces the server's base weights."""
    _merged(tiny_run_inputs, lora_server, tmp_path)


def _merged(tiny_run_inputs, lora_server, tmp_path):
    engine = VLLMEngine(lora_server.url, http=HTTPOptions(timeout_s=120.0))
    components = _components(tiny_run_inputs, sync="merged", seed=3)
    samples = trio.run(_sync_and_generate, components, engine, tmp_path, 3)
    assert engine.adapter is None and (tmp_path / "weights" / "model.safetensors").is_file()
    _assert_matches(samples, components.model)
