"""Shared test helpers: a tiny random Qwen2 and contract micro-batches built from token lists."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollouts.types import MicroBatch

VOCAB = 128


def tiny_config(**overrides: object) -> Qwen2Config:
    """A 2-layer Qwen2 with head_dim 32 (fast on CPU, real attention/rotary code paths)."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def tiny_model(
    seed: int = 0, attn: str = "sdpa", *, dtype: torch.dtype = torch.float32, **overrides: object
) -> Qwen2ForCausalLM:
    """Random-init tiny Qwen2 on CPU (float32 unless `dtype` says otherwise; same init values either way)."""
    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    config._attn_implementation = attn
    return Qwen2ForCausalLM(config).float().to(dtype)


def random_sequences(rng: np.random.Generator, lengths: Sequence[int]) -> list[list[int]]:
    """Token lists of the given lengths (ids 2..VOCAB-1: no pad/eos)."""
    return [rng.integers(2, VOCAB, size=n).tolist() for n in lengths]


def _loss_mask(seq: Sequence[int], num_prompt: int) -> np.ndarray:
    mask = np.zeros(len(seq), dtype=np.float32)
    mask[max(num_prompt, 1) :] = 1.0
    return mask


def packed_batch(
    seqs: Sequence[Sequence[int]], *, num_prompt: int = 2, extra: dict | None = None
) -> MicroBatch[np.ndarray]:
    """One packed row [1, sum(len)] holding all sequences; `extra` name -> one value per sequence."""
    ids, pos, seg, mask, loss = [], [], [], [], []
    for i, s in enumerate(seqs):
        ids += list(s)
        pos += list(range(len(s)))
        seg += [i] * len(s)
        mask += [1] * len(s)
        loss += _loss_mask(s, num_prompt).tolist()
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    out = {
        "input_ids": np.array([ids], dtype=np.int64),
        "position_ids": np.array([pos], dtype=np.int64),
        "segment_ids": np.array([seg], dtype=np.int64),
        "attention_mask": np.array([mask], dtype=np.int64),
        "loss_mask": np.array([loss], dtype=np.float32),
        "cu_seqlens": cu,
        "sample_indices": np.arange(len(seqs), dtype=np.int64),
    }
    for key, per_seq in (extra or {}).items():
        out[key] = np.concatenate([np.full(len(s), v, dtype=np.float32) for s, v in zip(seqs, per_seq, strict=True)])[
            None
        ]
    return _as_micro_batch(out)


def padded_batch(
    seqs: Sequence[Sequence[int]], *, num_prompt: int = 2, extra: dict | None = None
) -> MicroBatch[np.ndarray]:
    """Right-padded rows [len(seqs), max len]; `extra` name -> one value per sequence."""
    T = max(len(s) for s in seqs)
    B = len(seqs)
    out = {
        "input_ids": np.zeros((B, T), dtype=np.int64),
        "position_ids": np.zeros((B, T), dtype=np.int64),
        "segment_ids": np.full((B, T), -1, dtype=np.int64),
        "attention_mask": np.zeros((B, T), dtype=np.int64),
        "loss_mask": np.zeros((B, T), dtype=np.float32),
        "sample_indices": np.arange(B, dtype=np.int64),
    }
    for i, s in enumerate(seqs):
        n = len(s)
        out["input_ids"][i, :n] = s
        out["position_ids"][i, :n] = np.arange(n)
        out["segment_ids"][i, :n] = i
        out["attention_mask"][i, :n] = 1
        out["loss_mask"][i, :n] = _loss_mask(s, num_prompt)
    for key, per_seq in (extra or {}).items():
        arr = np.zeros((B, T), dtype=np.float32)
        for i, (s, v) in enumerate(zip(seqs, per_seq, strict=True)):
            arr[i, : len(s)] = v
        out[key] = arr
    return _as_micro_batch(out)


def _as_micro_batch(arrays: dict[str, np.ndarray]) -> MicroBatch[np.ndarray]:
    """Arrays by name -> MicroBatch (names that are not its fields go to extras)."""
    names = {f.name for f in dataclasses.fields(MicroBatch)}
    return MicroBatch(
        **{k: v for k, v in arrays.items() if k in names}, extras={k: v for k, v in arrays.items() if k not in names}
    )


def unpack_rows(values_1_T: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """Split a packed [1, T] array back into per-sequence arrays."""
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [values_1_T[0, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


TRAIN_CONFIG_KW = dict(lr=1e-2, warmup_steps=1, schedule="cosine", weight_decay=0.01)


def step_batch() -> dict[str, np.ndarray]:
    """A micro-batch drawn from torch's global RNG (so exact resume needs the RNG restored)."""
    lengths = torch.randint(3, 12, (3,)).tolist()
    seqs = [torch.randint(2, VOCAB, (n,)).tolist() for n in lengths]
    return packed_batch(seqs)


def fresh_components(seed: int = 0, num_training_steps: int = 8):
    """Tiny model + AdamW + schedule."""
    from rollouts.backends import build_components
    from rollouts.types import OptimizerConfig

    return build_components(tiny_model(seed), OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=num_training_steps)


def train_steps(components, state, num_steps: int, *, on_step=None):
    """Run `num_steps` SFT steps; `on_step(components, state)` after each (e.g. to checkpoint)."""
    from rollouts.backends import forward_backward, optim_step
    from rollouts.losses import sft_loss_fn
    from rollouts.types import OptimizerConfig

    config = OptimizerConfig(**TRAIN_CONFIG_KW)
    for _ in range(num_steps):
        mb = step_batch()
        n = int((mb.loss_mask > 0).sum())
        metrics = forward_backward(components, [mb], sft_loss_fn(), num_tokens=n, num_sequences=3)
        state, _ = optim_step(components, state, config, num_tokens=n, num_samples=3, loss=metrics["loss"])
        if on_step is not None:
            on_step(components, state)
    return state
