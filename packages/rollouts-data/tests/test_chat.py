"""SFT tokenization with a real chat template: masks cover assistant content + end-of-turn only."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollouts.data import tokenize_conversation, tokenize_conversation_turns
from rollouts.types import Status

END = "<|im_end|>"


def _spans(mask):
    """[start, end) runs of mask > 0."""
    out, start = [], None
    for t, m in enumerate([*mask, 0.0]):
        if m > 0 and start is None:
            start = t
        elif m == 0 and start is not None:
            out.append((start, t))
            start = None
    return out


def _masked_texts(tok, sample):
    return [tok.decode(sample.tokens[a:b], skip_special_tokens=False) for a, b in _spans(sample.loss_mask)]


CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is six times seven"},
    {"role": "assistant", "content": "the answer is 42"},
    {"role": "user", "content": "explain"},
    {"role": "tool", "content": "calculator says 42"},
    {"role": "assistant", "content": "six times seven is 42"},
]


def test_mask_covers_each_assistant_turn_plus_end_token(chatml_tokenizer):
    tok = chatml_tokenizer
    s = tokenize_conversation(CONV, tok, max_length=512)
    assert s.status == Status.COMPLETED
    assert list(s.tokens) == tok.apply_chat_template(CONV, tokenize=True, return_dict=False)
    assert _masked_texts(tok, s) == ["the answer is 42" + END, "six times seven is 42" + END]
    assert s.loss_mask[0] == 0.0 and len(s.loss_mask) == len(s.tokens)
    assert s.num_prompt_tokens == _spans(s.loss_mask)[0][0]


def test_last_assistant_and_all_modes(chatml_tokenizer):
    tok = chatml_tokenizer
    last = tokenize_conversation(CONV, tok, max_length=512, train_on="last_assistant")
    assert _masked_texts(tok, last) == ["six times seven is 42" + END]
    full = tokenize_conversation(CONV, tok, max_length=512, train_on="all")
    assert full.loss_mask[0] == 0.0 and all(m == 1.0 for m in full.loss_mask[1:])
    # last_assistant drops messages after the final assistant turn
    extra = tokenize_conversation(
        [*CONV, {"role": "user", "content": "thanks"}], tok, max_length=512, train_on="last_assistant"
    )
    assert extra.tokens == last.tokens


_WORDS = st.sampled_from(["hello", "world", "the answer", "is", "42", "think", "add", "numbers", "why?", "ok"])
_TEXT = st.lists(_WORDS, min_size=1, max_size=6).map(" ".join)


@st.composite
def conversations(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(_TEXT)})
        if draw(st.booleans()):
            msgs.append({"role": "tool", "content": draw(_TEXT)})
        msgs.append({"role": "assistant", "content": draw(_TEXT)})
    return msgs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations())
def test_property_mask_is_assistant_tokens_only(chatml_tokenizer, conv):
    tok = chatml_tokenizer
    s = tokenize_conversation(conv, tok, max_length=4096)
    assistant = [m["content"] for m in conv if m["role"] == "assistant"]
    assert _masked_texts(tok, s) == [c + END for c in assistant]
    assert len(s.tokens) == len(s.loss_mask)
    # the unmasked tokens are exactly the template's text minus the trained pieces
    text = tok.apply_chat_template(conv, tokenize=False)
    unmasked = tok.decode(
        [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m == 0.0], skip_special_tokens=False
    )
    rest = text
    for c in assistant:
        rest = rest.replace(f"<|im_start|>assistant\n{c}{END}", "<|im_start|>assistant\n", 1)
    assert unmasked == rest


def test_truncation_is_reported_and_mask_stays_aligned(chatml_tokenizer):
    tok = chatml_tokenizer
    full = tokenize_conversation(CONV, tok, max_length=512)
    cut = tokenize_conversation(CONV, tok, max_length=30)
    assert cut.status == Status.TRUNCATED
    assert len(cut.tokens) == len(cut.loss_mask) == 30
    assert cut.metadata["num_truncated_tokens"] == len(full.tokens) - 30
    assert cut.tokens == full.tokens[:30] and cut.loss_mask == full.loss_mask[:30]


def test_think_template_breaks_prefix_property_and_raises(think_tokenizer):
    conv = [
        {"role": "user", "content": "add the numbers"},
        {"role": "assistant", "content": "<think>six times seven</think>\nthe answer is 42"},
        {"role": "user", "content": "why?"},
        {"role": "assistant", "content": "<think>reasoning</think>\nbecause"},
    ]
    with pytest.raises(ValueError, match="prefix property"):
        tokenize_conversation(conv, think_tokenizer, max_length=512)
    last = tokenize_conversation(conv, think_tokenizer, max_length=512, train_on="last_assistant")
    assert _masked_texts(think_tokenizer, last) == ["<think>reasoning</think>\nbecause" + END]
    # the earlier turn appears as the template renders it in context: think block stripped
    assert "six times seven" not in think_tokenizer.decode(last.tokens)
    turns = tokenize_conversation_turns(conv, think_tokenizer, max_length=512)
    assert [_masked_texts(think_tokenizer, s) for s in turns] == [
        ["<think>six times seven</think>\nthe answer is 42" + END],
        ["<think>reasoning</think>\nbecause" + END],
    ]


def test_single_turn_with_think_template_is_fine(think_tokenizer):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>x</think>\nok"}]
    s = tokenize_conversation(conv, think_tokenizer, max_length=512)
    assert _masked_texts(think_tokenizer, s) == ["<think>x</think>\nok" + END]


def test_bad_inputs_raise(chatml_tokenizer):
    with pytest.raises(ValueError, match="no assistant"):
        tokenize_conversation([{"role": "user", "content": "hi"}], chatml_tokenizer, max_length=64)
    with pytest.raises(ValueError, match="train_on"):
        tokenize_conversation(CONV, chatml_tokenizer, max_length=64, train_on="users")
    with pytest.raises(ValueError, match="role"):
        tokenize_conversation([{"role": "bot", "content": "x"}], chatml_tokenizer, max_length=64)
