"""SFT samples from chat conversations, tokenized with the tokenizer's own chat template.

Legend: T tokens of the rendered conversation.

The loss mask is found by rendering prefixes of the conversation: the assistant turn i spans
from the end of `render(messages[:i], add_generation_prompt=True)` to the end of
`render(messages[:i+1])`. That is only right when every prefix rendering is, token for token, a
prefix of the full rendering (so the pieces concatenate to exactly what the model trains on).
Templates that render earlier turns differently from the last one (e.g. ones that strip
`<think>` blocks from earlier assistant turns) break that; we check it and raise instead of
producing a misaligned mask. For such templates train one turn per sample
(`tokenize_conversation_turns`, which renders each assistant turn as the last one, as the
model saw it when generating) or only the final turn (`train_on="last_assistant"`).

The mask covers the assistant content plus the end-of-turn token(s) the template emits after it;
whitespace-only tokens the template appends after the end-of-turn token (ChatML's newline after
`<|im_end|>`) are not trained, since the model never has to produce them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, get_args

from rollouts.types import Sample, Status, Tokenizer, thaw
from rollouts.types.configs import TrainOn

from rollouts.data.loading import validate_messages

__all__ = ["render_ids", "tokenize_conversation", "tokenize_conversation_turns"]

_TRAIN_ON = get_args(TrainOn)


def render_ids(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """[T] token ids of `messages` rendered by the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(
        [thaw(m) for m in messages],
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
        **dict(template_kwargs or {}),
    )
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(t) for t in out]


def _is_whitespace(tokenizer: Tokenizer, token_id: int) -> bool:
    return tokenizer.decode([token_id], skip_special_tokens=False).strip() == ""


def _check_prefix(full: list[int], prefix: list[int], what: str) -> None:
    if full[: len(prefix)] != prefix:
        at = next(
            (i for i, (a, b) in enumerate(zip(full, prefix, strict=False)) if a != b), min(len(full), len(prefix))
        )
        raise ValueError(
            f"chat template breaks the prefix property: the rendering of {what} differs from the "
            f"full conversation's rendering at token {at} (prefix has {len(prefix)} tokens, full has "
            f"{len(full)}); the template renders earlier turns differently from the last one, so a "
            "loss mask found from prefixes would be misaligned. Use tokenize_conversation_turns (one "
            "sample per assistant turn) or train_on='last_assistant'"
        )


def _assistant_spans(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    turns: Sequence[int],
    full: list[int],
    kw: Mapping[str, Any] | None,
) -> list[tuple[int, int]]:
    """[start, end) token spans of the assistant turns `turns` within `full`, prefix property checked.

    Every prefix rendering messages[:k] must be a prefix of `full`, so the per-turn pieces
    concatenate to exactly `full`.
    """
    for k in range(1, len(messages)):
        _check_prefix(full, render_ids(tokenizer, messages[:k], template_kwargs=kw), f"messages[:{k}]")
    spans = []
    for i in turns:
        start_ids = render_ids(tokenizer, messages[:i], add_generation_prompt=True, template_kwargs=kw)
        _check_prefix(full, start_ids, f"messages[:{i}] with the generation prompt")
        end = len(render_ids(tokenizer, messages[: i + 1], template_kwargs=kw)) if i + 1 < len(messages) else len(full)
        while end > len(start_ids) and _is_whitespace(tokenizer, full[end - 1]):
            end -= 1
        spans.append((len(start_ids), end))
    return spans


def tokenize_conversation(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    train_on: TrainOn = "assistant",
    template_kwargs: Mapping[str, Any] | None = None,
) -> Sample:
    """A Sample of the rendered conversation whose loss mask covers the `train_on` turns.

    train_on: "assistant" every assistant turn, "last_assistant" only the final one (messages after
    it are dropped), "all" every token but the first. Longer than `max_length` tokens: cut to
    `max_length` with status TRUNCATED and metadata["num_truncated_tokens"].
    """
    if train_on not in _TRAIN_ON:
        raise ValueError(f"train_on must be one of {list(_TRAIN_ON)}, got {train_on!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
    messages = validate_messages("conversation", "messages", [thaw(m) for m in messages])
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant and train_on != "all":
        raise ValueError(f"conversation has no assistant message, so train_on={train_on!r} trains on nothing")
    if train_on == "last_assistant":
        messages = messages[: assistant[-1] + 1]
        assistant = assistant[-1:]
    full = render_ids(tokenizer, messages, template_kwargs=template_kwargs)
    mask = [0.0] * len(full)
    if train_on == "all":
        mask = [0.0] + [1.0] * (len(full) - 1)
    elif train_on == "last_assistant":
        # Only the final turn is trained and it is rendered last, as at generation time: the one
        # property needed is that the prompt (with the generation prompt) is a prefix of `full`.
        start_ids = render_ids(
            tokenizer, messages[: assistant[0]], add_generation_prompt=True, template_kwargs=template_kwargs
        )
        _check_prefix(full, start_ids, f"messages[:{assistant[0]}] with the generation prompt")
        end = len(full)
        while end > len(start_ids) and _is_whitespace(tokenizer, full[end - 1]):
            end -= 1
        mask[len(start_ids) : end] = [1.0] * (end - len(start_ids))
    else:
        for start, end in _assistant_spans(tokenizer, messages, assistant, full, template_kwargs):
            mask[start:end] = [1.0] * (end - start)
    num_truncated = max(0, len(full) - max_length)
    tokens, mask = full[:max_length], mask[:max_length]
    first = next((t for t, m in enumerate(mask) if m > 0.0), len(tokens))
    return Sample(
        prompt=messages[: assistant[0]] if assistant and train_on != "all" else messages,
        response=messages[assistant[-1]]["content"] if assistant and train_on != "all" else "",
        tokens=tokens,
        num_prompt_tokens=first,
        loss_mask=mask,
        status=Status.TRUNCATED if num_truncated else Status.COMPLETED,
        metadata={
            "num_truncated_tokens": num_truncated,
            "num_trained_turns": 0 if train_on == "all" else len(assistant),
        },
    )


def tokenize_conversation_turns(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[Sample, ...]:
    """One Sample per assistant turn, each rendered with that turn last (safe for any template)."""
    messages = validate_messages("conversation", "messages", [thaw(m) for m in messages])
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("conversation has no assistant message, so there is no turn to train on")
    return tuple(
        tokenize_conversation(
            messages[: i + 1],
            tokenizer,
            max_length=max_length,
            train_on="last_assistant",
            template_kwargs=template_kwargs,
        )
        for i in turns
    )
