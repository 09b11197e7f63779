"""rollouts-data: prompt buffers, chat-template SFT samples, padding and packing, rollout generation.

No torch: arrays at the edges are numpy, micro-batches are `dict[str, numpy.ndarray]`.
"""

from rollouts.data.batching import (
    MicroBatch,
    StepPlan,
    best_fit_decreasing,
    pack_samples,
    pad_batch,
    plan_micro_batches,
    sample_arrays,
    unpack,
    unpack_values,
)
from rollouts.data.buffer import BufferState, DataBuffer, epoch_order, next_prompts
from rollouts.data.chat import render_ids, tokenize_conversation, tokenize_conversation_turns
from rollouts.data.filters import (
    check_min_reward,
    check_reasonable_length,
    check_response_diversity,
    check_reward_nonzero_std,
    combine_filters,
)
from rollouts.data.loading import load_conversations, load_prompts, load_records, validate_messages
from rollouts.data.manager import AsyncRolloutManager
from rollouts.data.rollout import (
    Transformed,
    apply_sample_transforms,
    assign_groups,
    batch_metadata,
    convert_to_batch,
    generate_rollout_batches,
    group_samples,
    validate_group,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncRolloutManager",
    "BufferState",
    "DataBuffer",
    "MicroBatch",
    "StepPlan",
    "Transformed",
    "apply_sample_transforms",
    "assign_groups",
    "batch_metadata",
    "best_fit_decreasing",
    "check_min_reward",
    "check_reasonable_length",
    "check_response_diversity",
    "check_reward_nonzero_std",
    "combine_filters",
    "convert_to_batch",
    "epoch_order",
    "generate_rollout_batches",
    "group_samples",
    "load_conversations",
    "load_prompts",
    "load_records",
    "next_prompts",
    "pack_samples",
    "pad_batch",
    "plan_micro_batches",
    "render_ids",
    "sample_arrays",
    "tokenize_conversation",
    "tokenize_conversation_turns",
    "unpack",
    "unpack_values",
    "validate_group",
    "validate_messages",
]
