"""Partial rollouts on the in-process engine: a response aborted for a weight sync continues on the new
weights, each token's log-prob from the weights that generated it (rollouts-backends + rollouts-sync)."""

from __future__ import annotations

import copy

import anyio
import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollouts.backends import InProcessEngine
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
