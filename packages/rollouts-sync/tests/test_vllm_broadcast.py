"""The broadcast transport against a real vLLM CPU server (gloo with its worker, the session's server):
bf16 weights sent in several buckets are what the engine then serves."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the `broadcast` extra
from safetensors.torch import load_file, save_file  # noqa: E402

from rollouts.sync import AttestationError, BroadcastOptions, HTTPOptions, VLLMEngine  # noqa: E402
from rollouts.sync.broadcast import BroadcastSync  # noqa: E402
from rollouts.sync.testing import reference_greedy  # noqa: E402
from rollouts.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 1e-4  # float32 engine vs float32 transformers, both on CPU
PROMPT = [5, 17, 42, 9]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=True)


@pytest.mark.anyio
async def test_a_broadcast_sync_serves_the_trainers_bf16_weights(vllm_server, vllm_python, vllm_fault_file, tmp_path):
    """bf16 on the wire (the bf16 model's bytes, in 8 KiB buckets); the float32 engine then serves exactly
    the bf16 values: greedy tokens equal transformers' on them and log-probs agree to float32 tolerance.
    A later sync corrupted in the worker fails attestation naming the tensor, and is never loaded: the
    engine serves the weights before it."""
    weights = load_file(str(vllm_server.model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    sent = {n: (w + torch.randn(w.shape, generator=generator) * 0.3).bfloat16() for n, w in weights.items()}
    reference = tmp_path / "sent"  # the same values, exact in float32, as a model directory
    shutil.copytree(vllm_server.model_dir, reference)
    save_file({n: t.float() for n, t in sent.items()}, str(reference / "model.safetensors"), metadata={"format": "pt"})

    async with VLLMEngine(vllm_server.url, http=HTTPOptions(timeout_s=120.0)) as engine:
        version = (await engine.weight_version() or 0) + 1
        sync = BroadcastSync(BroadcastOptions(bucket_bytes=8 * 1024))
        await sync.connect([engine])
        result = await sync.push(sent, version)
        assert result.updated == (engine.name,) and await engine.weight_version() == version
        assert sync.last_num_bytes == sum(t.numel() * 2 for t in sent.values())  # bf16: 2 bytes each
        sample = (await engine.generate([PROMPT], GREEDY))[0]

        corrupted = "model.layers.0.self_attn.o_proj.weight"
        vllm_fault_file.write_text(f"corrupt:{corrupted}")
        other = {n: (w + torch.randn(w.shape, generator=generator) * 0.3).bfloat16() for n, w in weights.items()}
        with pytest.raises(AttestationError) as info:
            await sync.push(other, version + 1)
        assert info.value.mismatched == (corrupted,) and await engine.weight_version() == version
        after = (await engine.generate([PROMPT], GREEDY))[0]
    tokens, logprobs = reference_greedy(reference, PROMPT, GREEDY.max_new_tokens, python=vllm_python)
    for served in (sample, after):  # `other` never loaded
        assert list(served.response_tokens) == tokens
        np.testing.assert_allclose(served.rollout_logprobs, logprobs, rtol=0, atol=LOGPROB_ATOL)
