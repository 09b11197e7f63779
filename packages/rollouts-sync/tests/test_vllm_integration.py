"""Against a real vLLM CPU server: generate with logprobs; weights changed on disk or sent in the body
(bf16 as bf16) are what the engine then serves (greedy tokens and logprobs equal a transformers
float32 forward pass); a tensor corrupted in the engine's worker fails the sync's attestation."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rollouts.sync import AttestationError, HTTPOptions, VLLMEngine, sync_weights_to_engines
from rollouts.sync.raw import bfloat16
from rollouts.sync.testing import reference_greedy
from rollouts.types import SamplingParams, Status

pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 1e-4  # float32 engine vs float32 transformers, both on CPU
PROMPT = [5, 17, 42, 9]
MAX_NEW_TOKENS = 6
GREEDY = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, logprobs=True)


def perturbed_copy(src, dst, *, seed: int, only: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """Copy checkpoint `src` to `dst` with new random values (all tensors, or only those named)."""
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(seed)
    changed = {}
    for name, w in weights.items():
        if only is None or name in only:
            changed[name] = (w + rng.standard_normal(w.shape).astype(np.float32) * 0.3).astype(np.float32)
    save_file({**weights, **changed}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return changed


def assert_matches_reference(sample, model_dir, python, *more):
    """`sample` (and each of `more`) is transformers' greedy continuation on `model_dir`'s weights."""
    ref_tokens, ref_logprobs = reference_greedy(model_dir, PROMPT, MAX_NEW_TOKENS, python=python)
    for each in (sample, *more):
        assert list(each.response_tokens) == ref_tokens
        np.testing.assert_allclose(each.rollout_logprobs, ref_logprobs, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # once (its three references cost 20 s): trio's in tests/
async def test_generate_sync_from_disk_and_from_tensors(vllm_server, vllm_python, tmp_path):
    v0 = vllm_server.model_dir
    v1 = tmp_path / "model_v1"
    perturbed_copy(v0, v1, seed=1)
    v2 = tmp_path / "model_v2"  # only for the reference: the engine gets v2's new tensors in the body
    changed = perturbed_copy(
        v1,
        v2,
        seed=2,
        only=("lm_head.weight", "model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.bias"),
    )

    async with VLLMEngine(vllm_server.url, http=HTTPOptions(timeout_s=120.0)) as engine:
        assert await engine.health()
        samples = await engine.generate(
            [PROMPT, PROMPT[:2]], SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=3)
        )
        assert len(samples) == 4 and [s.prompt_tokens for s in samples] == [tuple(PROMPT)] * 2 + [tuple(PROMPT[:2])] * 2
        for s in samples:
            assert s.response_length == 4 and s.status is Status.TRUNCATED
            assert all(lp <= 0.0 for lp in s.rollout_logprobs)
        # The server lives for the session: start from v0's weights whatever an earlier test left
        # loaded, under versions above any it used.
        base = (await engine.weight_version() or 0) + 1
        await sync_weights_to_engines([engine], str(v0), base, timeout_s=120.0)
        before = (await engine.generate([PROMPT], GREEDY))[0]
        assert_matches_reference(before, v0, vllm_python)  # warms the prefix cache with v0's KV

        result = await sync_weights_to_engines([engine], str(v1), base + 1, timeout_s=120.0)
        assert result.updated == (engine.name,)
        after_disk = (await engine.generate([PROMPT], GREEDY))[0]
        assert after_disk.weight_version == base + 1
        assert_matches_reference(after_disk, v1, vllm_python)

        await engine.update_weights_from_tensors(changed, base + 2)  # partial: 3 tensors, no shared path
        assert await engine.weight_version() == base + 2
        after_body = (await engine.generate([PROMPT], GREEDY))[0]
        assert after_body.weight_version == base + 2
        assert_matches_reference(after_body, v2, vllm_python)
        assert after_body.rollout_logprobs != after_disk.rollout_logprobs


@pytest.mark.anyio
async def test_a_bf16_http_sync_serves_the_bf16_weights_and_attestation_catches_a_corrupted_one(
    vllm_server, vllm_python, vllm_fault_file, tmp_path
):
    """The server runs float32; the weights travel as bf16 (2 bytes each) and the engine then serves
    their float32 values, as transformers does from the same bf16 values."""
    v0 = vllm_server.model_dir
    weights = load_file(str(v0 / "model.safetensors"))
    rng = np.random.default_rng(7)
    sent = {n: bfloat16(w + rng.standard_normal(w.shape).astype(np.float32) * 0.3) for n, w in weights.items()}
    reference = tmp_path / "bf16_as_float32"
    shutil.copytree(v0, reference)
    widened = {n: (t.view().astype(np.uint32) << 16).view(np.float32) for n, t in sent.items()}  # exact
    save_file(widened, str(reference / "model.safetensors"), metadata={"format": "pt"})

    async with VLLMEngine(vllm_server.url, http=HTTPOptions(timeout_s=120.0)) as engine:
        base = (await engine.weight_version() or 0) + 1
        upload = await engine.update_weights_from_tensors(sent, base)
        assert upload.tensor_bytes == sum(2 * w.size for w in weights.values())
        # on the wire: the bf16 bytes themselves, fetched once by the one worker, plus the safetensors
        # header (a JSON entry of under 200 bytes per tensor) and a request body of one URL
        assert upload.tensor_bytes < upload.wire_bytes < upload.tensor_bytes + 200 * len(sent) + 1000
        served = (await engine.generate([PROMPT], GREEDY))[0]

        corrupted = "model.layers.0.mlp.down_proj.weight"
        vllm_fault_file.write_text(f"corrupt:{corrupted}")
        other = {n: bfloat16(w + rng.standard_normal(w.shape).astype(np.float32) * 0.3) for n, w in weights.items()}
        with pytest.raises(AttestationError) as info:
            await engine.update_weights_from_tensors(other, base + 1)
        assert info.value.mismatched == (corrupted,) and corrupted in str(info.value)
        assert await engine.weight_version() == base  # a sync that failed attestation claims no version
        after = (await engine.generate([PROMPT], GREEDY))[0]
    assert_matches_reference(served, reference, vllm_python, after)  # `other` never loaded


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])  # once: the wire is the same under asyncio
async def test_an_ipc_sync_serves_the_trainers_bf16_weights_and_attestation_catches_a_corrupted_one(
    vllm_server, vllm_python, vllm_fault_file, tmp_path
):
    """A server on this machine copies the trainer's bf16 tensors out of its memory, bucket by bucket
    (/dev/shm on the CPU): none of their bytes in a request body, none left in /dev/shm."""
    torch = pytest.importorskip("torch")
    from rollouts.sync.ipc_handles import shm_dir

    v0 = vllm_server.model_dir
    weights = load_file(str(v0 / "model.safetensors"))
    generator = torch.Generator().manual_seed(11)
    sent = {
        n: (torch.from_numpy(w) + torch.randn(w.shape, generator=generator) * 0.3).to(torch.bfloat16)
        for n, w in weights.items()
    }
    reference = tmp_path / "bf16_as_float32"
    shutil.copytree(v0, reference)
    save_file(
        {n: t.float().numpy() for n, t in sent.items()}, str(reference / "model.safetensors"), metadata={"format": "pt"}
    )

    async with VLLMEngine(vllm_server.url, http=HTTPOptions(timeout_s=120.0), tensor_wire="ipc") as engine:
        base = (await engine.weight_version() or 0) + 1
        bucket_bytes = max(t.numel() * 2 for t in sent.values())  # several buckets
        upload = await engine.update_weights_from_tensors(sent, base, chunk_bytes=bucket_bytes)
        assert upload.tensor_bytes == sum(2 * w.size for w in weights.values()) <= upload.shared_bytes
        assert upload.num_requests > 1 and upload.fetched_bytes == 0 and upload.body_bytes < 2000 * len(sent)
        served = (await engine.generate([PROMPT], GREEDY))[0]

        corrupted = "model.layers.1.self_attn.v_proj.weight"
        vllm_fault_file.write_text(f"corrupt:{corrupted}")
        other = {n: (t.float() + torch.randn(t.shape, generator=generator) * 0.3).bfloat16() for n, t in sent.items()}
        with pytest.raises(AttestationError) as info:
            await engine.update_weights_from_tensors(other, base + 1, chunk_bytes=bucket_bytes)
        assert info.value.mismatched == (corrupted,)
        assert await engine.weight_version() == base
        after = (await engine.generate([PROMPT], GREEDY))[0]
    assert_matches_reference(served, reference, vllm_python, after)  # `other` never loaded
    mine = f"rollouts-ipc-{os.getpid()}-"
    assert not [n for n in os.listdir(shm_dir()) if n.startswith(mine)]  # the file went with the client
