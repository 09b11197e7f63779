"""Prompt records -> prompt token ids, the way an RL loop encodes every prompt of every step.

`prompt_encoder(tokenizer)` is the encoder the loops' CLI uses: a text prompt (`record["prompt"]`,
or the record itself) is encoded as it is when the tokenizer has no chat template (or with
chat=False), and as one user turn with the generation prompt when it has one; a list of messages
goes through the chat template.

Speed: a transformers fast tokenizer's `encode` spends most of its time in Python around the Rust
tokenizer, which a step of a thousand prompts pays in the rollout manager's process. Text prompts are encoded with the Rust tokenizer
(`backend_tokenizer`) directly. The ids must be what `tokenizer.encode(text,
add_special_tokens=False)` gives: the first text prompt is encoded both ways, and a tokenizer
whose two paths disagree (a wrapper that normalizes, splits special tokens, ...) is used through
`encode` from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["MAX_CHARS_PER_TOKEN", "TokenizerEncoder", "encode_bounded", "prompt_encoder"]

MAX_CHARS_PER_TOKEN = 64
"""A prefix of a text this many characters per allowed token is encoded first: a text whose prefix
already has too many tokens is refused without tokenizing the rest (a 100 MB prompt line or
observation would take gigabytes to tokenize whole)."""


def encode_bounded(encode: Callable[[str], Sequence[int]], text: str, max_tokens: int) -> list[int] | None:
    """`encode(text)`, or None when it has more than `max_tokens` tokens, found by encoding growing
    prefixes (MAX_CHARS_PER_TOKEN characters per allowed token, then 4x longer each time) rather
    than the whole text: what a text too long costs stays proportional to `max_tokens` for any
    tokenizer whose tokens average fewer characters than that."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    head = max(max_tokens, 1) * MAX_CHARS_PER_TOKEN
    while head < len(text):
        if len(encode(text[:head])) > max_tokens:  # a prefix's tokens are (about) a prefix of the text's
            return None
        head *= 4
    ids = list(encode(text))
    return ids if len(ids) <= max_tokens else None


def prompt_encoder(tokenizer: Any, *, field: str = "prompt", chat: bool | None = None) -> TokenizerEncoder:
    """An encoder of prompt records: `record[field]` for a mapping, else the record itself. A str is
    encoded as text, or with `chat` (default: where the tokenizer has a chat template) as one user
    turn through the chat template; a sequence of {"role", "content"} messages always goes through
    the chat template, with the generation prompt.

    TypeError at the first record that is neither."""
    return TokenizerEncoder(tokenizer, field=field, chat=chat)


class TokenizerEncoder:
    """What `prompt_encoder` returns: a callable record -> ids, which says how it encodes (`field`,
    `chat`), so another process can build the same encoder over its copy of the tokenizer."""

    def __init__(self, tokenizer: Any, *, field: str = "prompt", chat: bool | None = None) -> None:
        if not callable(getattr(tokenizer, "encode", None)):
            raise TypeError(f"prompt_encoder needs a tokenizer with encode(), got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.field = field
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        self._text = _TextEncoder(tokenizer)

    def __call__(self, record: Any) -> list[int]:
        prompt = record[self.field] if isinstance(record, Mapping) else record
        if isinstance(prompt, str) and not self.chat:
            return self._text(prompt)
        if isinstance(prompt, str):
            messages: list[Any] = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
            messages = [dict(m) for m in prompt]
        else:
            raise TypeError(
                f"a prompt must be a str or a sequence of message mappings, got {type(prompt).__name__}: {prompt!r:.80}"
            )
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]


class _TextEncoder:
    """`tokenizer.encode(text, add_special_tokens=False)`, through the Rust tokenizer once the first
    text shows that both give the same ids."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if callable(getattr(backend, "encode", None)) else None
        self._checked = self._backend is None

    def __call__(self, text: str) -> list[int]:
        backend = self._backend  # read once: another thread's first call may drop it
        if self._checked:
            if backend is None:
                return list(self._tokenizer.encode(text, add_special_tokens=False))
            return backend.encode(text, add_special_tokens=False).ids  # type: ignore[no-any-return]
        reference = list(self._tokenizer.encode(text, add_special_tokens=False))
        try:
            fast = None if backend is None else backend.encode(text, add_special_tokens=False).ids
        except Exception:  # noqa: BLE001 (a backend that cannot encode alone: the wrapper's path it is)
            fast = None
        if fast != reference:
            self._backend = None
        self._checked = True
        return reference
