"""Preference pairs: records {"prompt", "chosen", "rejected"} loaded from JSONL / JSON, and each pair
tokenized with the model's chat template into two Samples whose loss masks cover the completions.

The prompt is a string (one user message) or a list of chat messages; each completion is a string,
an assistant message, or a list holding one assistant message. Both completions are rendered after
the same prompt, as the final assistant turn (`tokenize_conversation` with train_on="last_assistant"),
so the loss mask of each covers its completion and the end-of-turn token(s) the template emits.
Errors name the file, the line and the field, as every loader here does.

Needs the `chat` extra (transformers, jinja2) to tokenize: `pip install "rollouts-data[chat]"`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollouts.data.chat import tokenize_conversation
from rollouts.data.loading import load_records, validate_messages
from rollouts.types import Sample, Tokenizer

__all__ = ["PreferencePair", "load_preference_pairs", "tokenize_preference_pair"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PreferencePair:
    """One prompt with a preferred and a dispreferred completion."""

    prompt: tuple[dict[str, Any], ...]
    """The chat messages before the completion (a string prompt becomes one user message)."""
    chosen: str
    """The preferred assistant completion."""
    rejected: str
    """The dispreferred assistant completion."""


def _prompt(where: str, value: Any) -> tuple[dict[str, Any], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: field 'prompt' is empty or only whitespace ({value!r})")
        return ({"role": "user", "content": value},)
    messages = validate_messages(where, "prompt", value)
    if messages[-1]["role"] == "assistant":
        raise ValueError(
            f"{where}: field 'prompt' ends with an assistant message; the completions are the assistant's "
            "next turn, so the prompt ends with the user's (or a tool's) message"
        )
    return messages


def _completion(where: str, field: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        value = [value]
    messages = validate_messages(where, field, value)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = [m["role"] for m in messages]
        raise ValueError(
            f"{where}: field '{field}' must be a string or one assistant message, got messages with roles {roles}"
        )
    content: str = messages[0]["content"]
    return content


def load_preference_pairs(path: str | Path) -> list[PreferencePair]:
    """Every record of a .jsonl / .json file as a PreferencePair; a bad record is an error naming it."""
    out = []
    for where, record in load_records(path):
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: record must be an object, got {type(record).__name__}")
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing} (keys: {sorted(record)})")
        chosen = _completion(where, "chosen", record["chosen"])
        rejected = _completion(where, "rejected", record["rejected"])
        if chosen == rejected:
            raise ValueError(
                f"{where}: 'chosen' and 'rejected' are the same text ({chosen!r:.60}): the pair states no preference"
            )
        out.append(PreferencePair(prompt=_prompt(where, record["prompt"]), chosen=chosen, rejected=rejected))
    return out


def tokenize_preference_pair(
    pair: PreferencePair,
    tokenizer: Tokenizer,
    *,
    max_length: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[Sample, Sample]:
    """(chosen, rejected) Samples of the prompt followed by each completion, each cut at `max_length`
    tokens (status TRUNCATED); the loss mask covers the completion only."""
    if not isinstance(pair, PreferencePair):
        raise TypeError(f"pair must be a PreferencePair, got {type(pair).__name__}")
    samples = tuple(
        tokenize_conversation(
            [*pair.prompt, {"role": "assistant", "content": text}],
            tokenizer,
            max_length=max_length,
            train_on="last_assistant",
            template_kwargs=template_kwargs,
        )
        for text in (pair.chosen, pair.rejected)
    )
    return samples[0], samples[1]
