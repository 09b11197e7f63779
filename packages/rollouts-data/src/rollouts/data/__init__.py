"""rollouts-data: prompt buffers, chat-template SFT samples, padding and packing, rollout generation.

No torch: arrays at the edges are numpy; micro-batches are `rollouts.types.MicroBatch[numpy.ndarray]`.
The names below are the public API; the building blocks stay importable from their modules
(`rollouts.data.filters` for group filters, `rollouts.data.rollout` for grouping/reward/filter
steps, `rollouts.data.batching` for padding and unpacking, `rollouts.data.buffer` for the
functional `BufferState`/`next_prompts`, `rollouts.data.loading` for raw records).
"""

from importlib.metadata import PackageNotFoundError, version

from rollouts.data.batching import (
    StepPlan,
    best_fit_decreasing,
    pack_samples,
    plan_micro_batches,
    segment_attention_mask,
    unpack_values,
)
from rollouts.data.buffer import DataBuffer
from rollouts.data.chat import tokenize_conversation, tokenize_conversation_turns, tokenize_conversations
from rollouts.data.loading import load_conversations, load_prompts
from rollouts.data.manager import AsyncRolloutManager
from rollouts.data.preferences import PreferencePair, load_preference_pairs, tokenize_preference_pair
from rollouts.data.prompts import MAX_CHARS_PER_TOKEN, encode_bounded, prompt_encoder


def _version() -> str:
    try:
        return version("rollouts-data")  # written once, in pyproject.toml
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "AsyncRolloutManager",
    "DataBuffer",
    "PreferencePair",
    "StepPlan",
    "best_fit_decreasing",
    "load_conversations",
    "load_preference_pairs",
    "load_prompts",
    "pack_samples",
    "plan_micro_batches",
    "MAX_CHARS_PER_TOKEN",
    "encode_bounded",
    "prompt_encoder",
    "segment_attention_mask",
    "tokenize_conversation",
    "tokenize_conversation_turns",
    "tokenize_conversations",
    "tokenize_preference_pair",
    "unpack_values",
]
