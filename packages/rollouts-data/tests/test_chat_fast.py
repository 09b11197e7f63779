"""The fast chat masks (HF generation mask, incremental rendering) equal the prefix algorithm's; the chat extra."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollouts.data import chat as chat_module
from rollouts.data import tokenize_conversation
from rollouts.data.chat import _assistant_spans, render_ids, tokenize_conversations

CHATML_GENERATION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with HF generation markup (the newline after <|im_end|> inside it: trimmed like the prefix masks)."""

PLAIN_TEMPLATE = (
    "{%- for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}Assistant:{% endif %}"
)
"""No special tokens at all: the turn boundaries fall inside plain text."""

HEADER_TEMPLATE = (
    "{{- '<|endoftext|>' }}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '<|im_end|>\\n\\n' + message['content'] | trim + '<|endoftext|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant<|im_end|>\\n\\n' }}{%- endif %}"
)
"""Llama-3-like: a BOS, header tokens, stripped content, an end-of-turn token with no newline after it."""

TEMPLATES = {
    "chatml": None,  # conftest's CHATML_TEMPLATE
    "chatml_generation": CHATML_GENERATION_TEMPLATE,
    "plain": PLAIN_TEMPLATE,
    "header": HEADER_TEMPLATE,
}


@pytest.fixture(scope="module")
def tokenizers(build_tokenizer, chatml_tokenizer):
    return {name: chatml_tokenizer if t is None else build_tokenizer(t) for name, t in TEMPLATES.items()}


def _prefix_algorithm(messages, tok):
    """The old way: render every prefix, tokenize each, check each against the full tokenization."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    full = render_ids(tok, messages)
    mask = [0.0] * len(full)
    for start, end in _assistant_spans(tok, messages, turns, full, None):
        mask[start:end] = [1.0] * (end - start)
    mask[0] = 0.0
    return full, mask


_WORDS = st.sampled_from(["hello", "world", " the", "answer", "42", "is", " ", "\n", "six times", "think", ""])
_CONTENT = st.lists(_WORDS, max_size=6).map(" ".join)
_CONVERSATION = st.tuples(
    st.booleans(),
    st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), _CONTENT), min_size=1, max_size=8),
    _CONTENT,
).map(
    lambda t: (
        ([{"role": "system", "content": t[2]}] if t[0] else [])
        + [{"role": "user", "content": t[2] + " q"}]  # a turn before the first assistant one: a prompt to render
        + [{"role": r, "content": c} for r, c in t[1]]
        + [{"role": "assistant", "content": t[2] + " ok"}]
    )
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(TEMPLATES)), messages=_CONVERSATION)
def test_property_fast_masks_equal_the_prefix_algorithm(tokenizers, name, messages):
    tok = tokenizers[name]
    try:
        tokens, mask = _prefix_algorithm(messages, tok)
    except ValueError:
        with pytest.raises(ValueError, match="prefix property"):
            tokenize_conversation(messages, tok, max_length=10_000)
        return
    sample = tokenize_conversation(messages, tok, max_length=10_000)
    assert list(sample.tokens) == tokens
    assert list(sample.loss_mask) == mask


def test_the_fast_paths_are_the_ones_taken(monkeypatch, tokenizers):
    """Each template takes its intended path (so the property above tests what it claims to)."""
    calls = []
    for fn in ("_generation_mask", "_incremental_mask"):
        original = getattr(chat_module, fn)
        monkeypatch.setattr(chat_module, fn, lambda *a, _f=original, _n=fn, **k: calls.append(_n) or _f(*a, **k))
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello world"}]
    for name in ("chatml_generation", "chatml", "plain"):
        tokenize_conversation(conv, tokenizers[name], max_length=512)
    assert calls == ["_generation_mask", "_incremental_mask", "_incremental_mask"]


def test_the_think_stripping_template_still_raises_the_prefix_error(think_tokenizer):
    conv = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>hmm</think>\n\nfirst"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "second"},
    ]
    with pytest.raises(ValueError, match=r"prefix property.*messages\[:2\]"):
        tokenize_conversation(conv, think_tokenizer, max_length=512)


def test_tokenize_conversations_reports_progress_and_names_the_bad_conversation(chatml_tokenizer):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    seen = []
    samples = tokenize_conversations(
        [conv] * 3, chatml_tokenizer, max_length=64, progress=lambda d, t: seen.append((d, t))
    )
    assert len(samples) == 3 and seen == [(1, 3), (2, 3), (3, 3)]
    with pytest.raises(ValueError, match=r"conversations\[1\]: conversation has no assistant message"):
        tokenize_conversations([conv, conv[:1]], chatml_tokenizer, max_length=64)
    with pytest.raises(TypeError, match="progress must be a callable"):
        tokenize_conversations([conv], chatml_tokenizer, max_length=64, progress=3)


def test_missing_chat_extra_is_an_import_error_naming_it(monkeypatch, chatml_tokenizer):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jinja2" else real(name, *a))
    chat_module._require_chat_extra.cache_clear()
    try:
        with pytest.raises(
            ImportError, match=r'needs jinja2, which is not installed: pip install "rollouts-data\[chat\]"'
        ):
            tokenize_conversation([{"role": "assistant", "content": "x"}], chatml_tokenizer, max_length=8)
    finally:
        chat_module._require_chat_extra.cache_clear()
