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

Speed: rendering and tokenizing every prefix is quadratic in the conversation. Two faster paths
give the same masks (tested against the prefix algorithm, kept as `_assistant_spans`):
- templates with `{% generation %}` blocks: one call with HF's `return_assistant_tokens_mask`;
  the template's own markup says what the assistant produced (no prefix check is needed);
- other templates: the prefixes are rendered as text only (two batched calls) and must be text
  prefixes of the full rendering; the full text is tokenized once, with character offsets, and
  every turn boundary must fall between two tokens (a token spanning it is the prefix-property
  error). A tokenizer without `__call__` falls back to the prefix algorithm.

Needs the `chat` extra (transformers, jinja2): `pip install "rollouts-data[chat]"`.
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args

from rollouts.data.loading import validate_messages
from rollouts.types import LossMask, Sample, Status, TokenIds, Tokenizer, thaw
from rollouts.types.configs import TrainOn

__all__ = ["render_ids", "tokenize_conversation", "tokenize_conversation_turns", "tokenize_conversations"]

_TRAIN_ON = get_args(TrainOn)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@functools.cache
def _require_chat_extra() -> None:
    missing = [name for name in ("transformers", "jinja2") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"rollouts.data chat tokenization needs {' and '.join(missing)}, which is not installed: "
            'pip install "rollouts-data[chat]"'
        )


def _render_texts(
    tokenizer: Tokenizer,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    *,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None,
) -> list[str]:
    """The template's text for each conversation (messages already thawed), in one batched call."""
    if not conversations:
        return []
    out = tokenizer.apply_chat_template(
        [list(c) for c in conversations],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **dict(template_kwargs or {}),
    )
    return [out] if isinstance(out, str) else list(out)


def _trimmed_end(tokenizer: Tokenizer, ids: Sequence[int], start: int, end: int) -> int:
    """`end` moved back over whitespace-only tokens, never before `start`."""
    while end > start and _is_whitespace(tokenizer, ids[end - 1]):
        end -= 1
    return end


def _trim_runs(tokenizer: Tokenizer, mask: Sequence[float], ids: Sequence[int]) -> list[float]:
    """The mask without the whitespace-only tokens that end each masked run."""
    out = list(mask)
    t = len(out)
    while t > 0:
        if out[t - 1] == 0.0:
            t -= 1
            continue
        end = t
        while t > 0 and out[t - 1] > 0.0:
            t -= 1
        kept_end = _trimmed_end(tokenizer, ids, t, end)
        out[kept_end:end] = [0.0] * (end - kept_end)
    return out


def _generation_mask(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], kw: Mapping[str, Any] | None
) -> tuple[list[int], list[float]]:
    """(ids, mask) from HF's assistant mask: the template's `{% generation %}` blocks."""
    out = tokenizer.apply_chat_template(
        [thaw(m) for m in messages],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **dict(kw or {}),
    )
    ids = [int(t) for t in out["input_ids"]]
    return ids, _trim_runs(tokenizer, [float(m) for m in out["assistant_masks"]], ids)


def _incremental_mask(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], turns: Sequence[int], kw: Mapping[str, Any] | None
) -> tuple[list[int], list[float]]:
    """(ids, mask) from prefix texts and one tokenization of each piece; see the module docstring."""
    full_text = _render_texts(tokenizer, [messages], add_generation_prompt=False, template_kwargs=kw)[0]
    starts = _render_texts(tokenizer, [messages[:i] for i in turns], add_generation_prompt=True, template_kwargs=kw)
    ends = _render_texts(
        tokenizer,
        [messages[: i + 1] for i in turns if i + 1 < len(messages)],
        add_generation_prompt=False,
        template_kwargs=kw,
    )
    if len(ends) < len(turns):
        ends.append(full_text)  # the last message is an assistant turn: it ends with the conversation
    cuts = [0]
    for i, start, end in zip(turns, starts, ends, strict=True):
        for text, what in ((start, f"messages[:{i}] with the generation prompt"), (end, f"messages[:{i + 1}]")):
            if not full_text.startswith(text):
                _prefix_error(what, "its text is not a prefix of the full conversation's text")
        cuts += [len(start), len(end)]
    cuts.append(len(full_text))
    if cuts != sorted(cuts):
        _prefix_error("the assistant turns", f"their text boundaries {cuts} are out of order")
    encoded = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    full, offsets = [int(t) for t in encoded["input_ids"]], encoded["offset_mapping"]
    token_starts = [int(o[0]) for o in offsets]
    token_cuts = []
    for cut in cuts:
        k = bisect.bisect_left(token_starts, cut)
        if k > 0 and offsets[k - 1][1] > cut:  # the prefix's text ends inside a token of the full text
            _prefix_error("a prefix ending at a turn boundary", f"a token spans character {cut}")
        token_cuts.append(k)
    mask = [0.0] * len(full)
    for k in range(len(turns)):
        a = token_cuts[1 + 2 * k]
        b = _trimmed_end(tokenizer, full, a, token_cuts[2 + 2 * k])
        mask[a:b] = [1.0] * (b - a)
    return full, mask


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


def _prefix_error(what: str, detail: str) -> None:
    raise ValueError(
        f"chat template breaks the prefix property: the rendering of {what} differs from the "
        f"full conversation's rendering ({detail}); the template renders earlier turns differently "
        "from the last one, so a loss mask found from prefixes would be misaligned. Use "
        "tokenize_conversation_turns (one sample per assistant turn) or train_on='last_assistant'"
    )


def _check_prefix(full: list[int], prefix: list[int], what: str) -> None:
    if full[: len(prefix)] != prefix:
        at = next(
            (i for i, (a, b) in enumerate(zip(full, prefix, strict=False)) if a != b), min(len(full), len(prefix))
        )
        _prefix_error(what, f"at token {at}; prefix has {len(prefix)} tokens, full has {len(full)}")


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
        spans.append((len(start_ids), _trimmed_end(tokenizer, full, len(start_ids), end)))
    return spans


def _assistant_mask(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], turns: Sequence[int], kw: Mapping[str, Any] | None
) -> tuple[list[int], list[float]]:
    """(ids, mask over every assistant turn): HF's generation mask, else incremental, else by prefixes."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and _GENERATION_TAG.search(template):
        return _generation_mask(tokenizer, messages, kw)
    if callable(tokenizer):
        return _incremental_mask(tokenizer, messages, turns, kw)
    full = render_ids(tokenizer, messages, template_kwargs=kw)
    mask = [0.0] * len(full)
    for start, end in _assistant_spans(tokenizer, messages, turns, full, kw):
        mask[start:end] = [1.0] * (end - start)
    return full, mask


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
    _require_chat_extra()
    if train_on == "assistant":
        full, mask = _assistant_mask(tokenizer, messages, assistant, template_kwargs)
    else:
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
    num_truncated = max(0, len(full) - max_length)
    tokens, mask = full[:max_length], mask[:max_length]
    first = next((t for t, m in enumerate(mask) if m > 0.0), len(tokens))
    return Sample(
        prompt=messages[: assistant[0]] if assistant and train_on != "all" else messages,
        response=messages[assistant[-1]]["content"] if assistant and train_on != "all" else "",
        tokens=TokenIds(tokens),
        num_prompt_tokens=first,
        loss_mask=LossMask(mask),
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
    _require_chat_extra()
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


def tokenize_conversations(
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    train_on: TrainOn = "assistant",
    template_kwargs: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """`tokenize_conversation` over a dataset; `progress(done, total)` after each conversation.

    For a bar: `progress=lambda done, total: bar.update(1)` with a tqdm bar of `total` items. An
    error names the conversation's index.
    """
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable (done, total) -> None, got {type(progress).__name__}")
    out = []
    total = len(conversations)
    for i, messages in enumerate(conversations):
        try:
            out.append(
                tokenize_conversation(
                    messages, tokenizer, max_length=max_length, train_on=train_on, template_kwargs=template_kwargs
                )
            )
        except ValueError as e:
            raise ValueError(f"conversations[{i}]: {e}") from e
        if progress is not None:
            progress(i + 1, total)
    return out
