"""In-process sampling with a KV cache, and the InferenceEngine adapter around it.

Legend: P prompts, G samples per prompt, B = P * G rows being sampled, R new (response) tokens, L padded
prompt length, V vocabulary.

Each distinct prompt is prefilled once and its KV cache repeated n times; prompts are
left-padded so every row's next token sits in the last column; rows that finish are dropped
from the batch (and the cache) so the remaining ones run at full speed. For Llama-family models
the decode steps run through `FastDecoder` (same arithmetic, preallocated cache, no per-step
module overhead); other models decode through their HF forward.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from rollouts.backends.sampling.decode import FastDecoder, fast_decoder
from rollouts.backends.train.attention import SDPA_IMPLEMENTATIONS
from rollouts.backends.train.components import model_attr
from rollouts.backends.train.inputs import attention_mask_4d
from rollouts.losses import truncation_mask
from rollouts.types import LogProbs, LossMask, Sample, SamplingParams, Status, TokenIds

__all__ = ["check_prompt_ids", "check_prompts", "generate", "prompt_limits", "sample_next_tokens"]

_PAD_TOKEN_ID = 0
"""Filler for left padding; masked out, so any valid id works."""
_DEFAULT_PARAMS = SamplingParams()


def sample_next_tokens(
    logits_B_V: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | Sequence[tuple[torch.Generator, int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] sampled tokens and [B] their log-probs under the sampling distribution (after temperature/top-k/top-p).

    `generator` draws every row's uniform, or a sequence of (generator, k) runs draws the rows in
    order, k rows from each (rows of one prompt from that prompt's own generator).
    Greedy (temperature 0) reports the log-prob under the unscaled model distribution instead of 0.
    """
    logits = logits_B_V.float()
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1] or top_p < 1.0:
        # The same set the trainer renormalises over (rollouts.losses.truncation_mask): the first
        # token always stays, so the distribution is never empty.
        logits = logits.masked_fill(~truncation_mask(logits, top_k=top_k, top_p=top_p), -math.inf)
    logprobs_B_V = torch.log_softmax(logits, dim=-1)
    # Inverse-CDF sampling (one uniform per row; several times faster than torch.multinomial on
    # CPU). u lies in (0, total], so the first index whose CDF reaches u has non-zero probability.
    cdf_B_V = logprobs_B_V.exp().cumsum(dim=-1)
    u_B_1 = (1.0 - _uniforms(cdf_B_V.shape[0], generator, cdf_B_V.device)) * cdf_B_V[:, -1:]
    tokens = torch.searchsorted(cdf_B_V, u_B_1).squeeze(-1).clamp(max=cdf_B_V.shape[-1] - 1)
    return tokens, logprobs_B_V.gather(-1, tokens[:, None]).squeeze(-1)


def _uniforms(
    num_rows: int, generator: torch.Generator | Sequence[tuple[torch.Generator, int]], device: torch.device
) -> torch.Tensor:
    """[B, 1] uniforms in [0, 1): from one generator, or k rows from each (generator, k) in order."""
    if isinstance(generator, torch.Generator):
        return torch.rand((num_rows, 1), generator=generator, device=device)
    parts = [torch.rand((k, 1), generator=g, device=device) for g, k in generator]
    if sum(k for _, k in generator) != num_rows:
        raise ValueError(f"generator runs cover {sum(k for _, k in generator)} rows, expected {num_rows}")
    return torch.cat(parts)


def check_prompts(model: torch.nn.Module, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Raise ValueError naming the first prompt `generate` would refuse for `model`: none at all, an
    empty one, one with ids outside the vocabulary (naming them), or a prompt that with
    `max_new_tokens` would run past the model's positions. Cheap (no tensor work): an engine runs it
    on each caller's prompts before batching them, so a bad one fails only its own caller."""
    config = model_attr(model, "config")
    check_prompt_ids(
        prompt_token_ids,
        vocab_size=config.vocab_size,
        max_positions=getattr(config, "max_position_embeddings", None),
        max_new_tokens=max_new_tokens,
    )


def prompt_limits(model_dir: Path) -> dict[str, Any]:
    """`check_prompt_ids`' vocab_size and max_positions from a model directory's config.json (no
    limit where it is missing or unreadable: loading the model then says what is wrong)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    return {
        "vocab_size": int(config.get("vocab_size") or 2**62),
        "max_positions": config.get("max_position_embeddings"),
    }


def check_prompt_ids(
    prompt_token_ids: Sequence[Sequence[int]], *, vocab_size: int, max_positions: int | None, max_new_tokens: int
) -> None:
    """`check_prompts` against a vocabulary size and a position limit (None: no limit) given directly."""
    max_len = max(len(p) for p in _check_prompts(prompt_token_ids, vocab_size))
    limit = max_positions
    if limit is not None and max_len + max_new_tokens > limit:
        raise ValueError(
            f"longest prompt ({max_len}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_position_embeddings ({limit})"
        )


def _check_prompts(prompt_token_ids: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    prompts = [list(p) for p in prompt_token_ids]
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: sampling needs at least one token to condition on")
        if min(p) < 0 or max(p) >= vocab_size:  # the scan below only for a prompt that fails
            bad = [t for t in p if not 0 <= t < vocab_size]
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return prompts


def _prefill_mask(model: torch.nn.Module, mask_P_L: torch.Tensor) -> torch.Tensor:
    """Left-padded prompts: a 4D causal mask over real tokens (padding sees only itself)."""
    if not _dense_mask(model):
        return mask_P_L
    segment_ids = torch.where(mask_P_L > 0, 0, -1)
    return attention_mask_4d(segment_ids, dtype=_additive_dtype(model))


def _decode_mask(model: torch.nn.Module, mask_B_K: torch.Tensor) -> torch.Tensor:
    """One new query per row: a [B, 1, 1, K] mask of the keys it may see (its real tokens)."""
    if not _dense_mask(model):
        return mask_B_K
    allowed = (mask_B_K > 0)[:, None, None, :]
    dtype = _additive_dtype(model)
    if dtype is None:
        return allowed
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), torch.finfo(dtype).min)


def _dense_mask(model: torch.nn.Module) -> bool:
    # A ready 4D mask skips transformers' per-step mask construction; flash kernels take 2D ones.
    return getattr(model.config, "_attn_implementation", "sdpa") in (*SDPA_IMPLEMENTATIONS, "eager")


def _additive_dtype(model: torch.nn.Module) -> torch.dtype | None:
    if getattr(model.config, "_attn_implementation", "sdpa") in SDPA_IMPLEMENTATIONS:
        return None
    return next(model.parameters()).dtype


class _HFDecoder:
    """Decode steps through the model's own forward and DynamicCache: any architecture."""

    def __init__(self, model: torch.nn.Module, cache: object, mask_B_L: torch.Tensor, padded: bool) -> None:
        self._model, self._cache, self._mask_B_K, self._padded = model, cache, mask_B_L, padded

    def select_rows(self, rows: torch.Tensor) -> None:
        self._cache.batch_select_indices(rows)  # type: ignore[attr-defined]
        self._mask_B_K = self._mask_B_K[rows]

    def step(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
        self._mask_B_K = torch.cat([self._mask_B_K, self._mask_B_K.new_ones(self._mask_B_K.shape[0], 1)], dim=1)
        out = self._model(
            input_ids=tokens_B[:, None],
            attention_mask=_decode_mask(self._model, self._mask_B_K) if self._padded else None,
            position_ids=positions_B[:, None],
            past_key_values=self._cache,
            use_cache=True,
        )
        logits_B_V: torch.Tensor = out.logits[:, -1]
        return logits_B_V


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_token_ids: Sequence[Sequence[int]],
    params: SamplingParams = _DEFAULT_PARAMS,
    *,
    seeds: Sequence[int | None] | None = None,
    weight_version: int | None = None,
    fast_decode: bool = True,
    should_abort: Callable[[], bool] | None = None,
) -> list[Sample]:
    """Sample `params.n` responses per prompt (prompt-major order) with a KV cache; deterministic
    for a seed. Every Sample keeps its log-probs (`params.logprobs` is not read here).

    `params.seed` seeds the whole call; `seeds` (one per prompt, `params.seed` then ignored) gives
    each prompt's rows a generator of their own, so a prompt's responses are those it gets when
    sampled alone with its seed, whatever other prompts share the batch (up to float rounding of
    the batched forward pass); None draws that prompt's rows from fresh entropy.

    Each Sample has tokens = prompt + response, loss_mask 1.0 on the response, rollout_logprobs of
    the sampled tokens, and status COMPLETED (ended by a stop token, which is kept) or TRUNCATED.
    `fast_decode=False` runs every decode step through the model's HF forward (e.g. for a model
    whose modules were patched); otherwise Llama-family models use `FastDecoder`.
    `should_abort`: asked after each token step; once it returns True the rows still generating
    end there as partial Samples (status ABORTED, metadata["partial"] = True, the convention of
    rollouts.sync.partial) keeping their tokens and log-probs, to continue later from prompt +
    partial response with the remaining budget.
    """
    n, max_new_tokens, temperature = params.n, params.max_new_tokens, params.temperature
    check_prompts(model, prompt_token_ids, max_new_tokens)
    config = model_attr(model, "config")
    prompts = [list(p) for p in prompt_token_ids]
    max_len = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    per_prompt = seeds is not None
    if seeds is not None:
        if len(seeds) != len(prompts) or not all(s is None or isinstance(s, int) for s in seeds):
            raise ValueError(f"seeds must hold one int/None per prompt ({len(prompts)}), got {seeds!r:.120}")
        generators = [_generator(device, s) for s in seeds]
    else:
        generator = _generator(device, params.seed)
    stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=device)

    num_prompts = len(prompts)
    input_ids = torch.full((num_prompts, max_len), _PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((num_prompts, max_len), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, max_len - len(p) :] = torch.tensor(p)
        mask[i, max_len - len(p) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    position = (mask.cumsum(dim=-1) - 1).clamp(min=0)

    was_training = model.training
    model.eval()
    try:
        cache = DynamicCache(config=config)
        padded = bool((mask == 0).any())
        prefill_mask = _prefill_mask(model, mask) if padded else None
        out = model(
            input_ids=input_ids,
            attention_mask=prefill_mask,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        # Prefill once per prompt, then give each of the n rows its own copy of the cache.
        logits_B_V = out.logits[:, -1].repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        fast = fast_decoder(model, max_len + max_new_tokens) if fast_decode else None
        if fast is not None:
            fast.load_cache(cache, n, max_len + max_new_tokens, mask if padded else None)
            decoder: FastDecoder | _HFDecoder = fast
        else:
            cache.batch_repeat_interleave(n)
            decoder = _HFDecoder(model, cache, mask, padded)
        del cache
        next_position = position[:, -1].repeat_interleave(n, dim=0) + 1
        num_rows = num_prompts * n
        # Sampled tokens and log-probs stay on the device; rows that finish leave `active`.
        tokens_B_B = torch.zeros((num_rows, max_new_tokens), dtype=torch.long, device=device)
        logprobs_B_B = torch.zeros((num_rows, max_new_tokens), dtype=torch.float32, device=device)
        lengths_B = torch.full((num_rows,), max_new_tokens, dtype=torch.long, device=device)
        completed_B = torch.zeros(num_rows, dtype=torch.bool, device=device)
        aborted_B = torch.zeros(num_rows, dtype=torch.bool, device=device)
        active = torch.arange(num_rows, device=device)
        for step in range(max_new_tokens):
            draw = _runs(active, n, generators) if per_prompt else generator
            tokens, logprobs = sample_next_tokens(
                logits_B_V, temperature=temperature, top_p=params.top_p, top_k=params.top_k, generator=draw
            )
            tokens_B_B[active, step] = tokens
            logprobs_B_B[active, step] = logprobs.float()
            if step == max_new_tokens - 1:
                break
            if stop.numel():
                is_stop = torch.isin(tokens, stop)
                if bool(is_stop.any()):
                    finished = active[is_stop]
                    lengths_B[finished] = step + 1
                    completed_B[finished] = True
                    keep = ~is_stop
                    if not bool(keep.any()):
                        break
                    kept = keep.nonzero().squeeze(-1)
                    decoder.select_rows(kept)
                    active, tokens, next_position = active[kept], tokens[kept], next_position[kept]
            if should_abort is not None and should_abort():
                lengths_B[active] = step + 1
                aborted_B[active] = True
                break
            logits_B_V = decoder.step(tokens, next_position)
            next_position = next_position + 1
        if stop.numel():
            # The last step's stop tokens (the loop ended before checking them).
            last = torch.isin(tokens_B_B[:, max_new_tokens - 1], stop) & (lengths_B == max_new_tokens)
            completed_B |= last
    finally:
        model.train(was_training)

    # Which distribution rollout_logprobs describe (see rollouts.sync's make_sample): the one sampled
    # from, or at temperature 0 the model's full softmax.
    logprobs_of = {"logprobs_of": "sampling" if temperature > 0 else "model"}
    tokens_rows = tokens_B_B.cpu().tolist()
    logprob_rows = logprobs_B_B.cpu().tolist()
    lengths = lengths_B.cpu().tolist()
    completed = completed_B.cpu().tolist()
    aborted = aborted_B.cpu().tolist()
    samples = []
    for row in range(num_rows):
        prompt = prompts[row // n]
        response = tokens_rows[row][: lengths[row]]
        samples.append(
            Sample(
                tokens=TokenIds(prompt + response),
                num_prompt_tokens=len(prompt),
                loss_mask=LossMask((0.0,) * len(prompt) + (1.0,) * len(response)),
                rollout_logprobs=LogProbs(logprob_rows[row][: lengths[row]]),
                weight_version=weight_version,
                status=Status.ABORTED if aborted[row] else Status.COMPLETED if completed[row] else Status.TRUNCATED,
                index=row,
                group_index=row // n,
                metadata=logprobs_of | {"partial": True} if aborted[row] else logprobs_of,
            )
        )
    return samples


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def _runs(active: torch.Tensor, n: int, generators: Sequence[torch.Generator]) -> list[tuple[torch.Generator, int]]:
    """(prompt's generator, its active rows) in row order: active rows are ascending, prompt-major."""
    prompts, counts = torch.unique_consecutive(torch.div(active, n, rounding_mode="floor"), return_counts=True)
    return [(generators[p], k) for p, k in zip(prompts.tolist(), counts.tolist(), strict=True)]
