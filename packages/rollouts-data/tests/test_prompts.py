"""prompt_encoder: the same ids as the tokenizer's own encode / chat template, through the fast path or not."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollouts.data import prompt_encoder

_PIECES = ["hello", " world", "42", "<|im_end|>", "<|im_start|>", "\n", " ", "é", "🙂", "the answer", "\t"]
texts = st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), max_size=12).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=texts, text=texts)
def test_text_prompts_encode_as_the_tokenizer_does(chatml_tokenizer, first, text):
    encode = prompt_encoder(chatml_tokenizer, chat=False)
    for t in (first, text):  # the first call checks the fast path, the second uses it
        assert encode({"prompt": t}) == chatml_tokenizer.encode(t, add_special_tokens=False)
        assert encode(t) == chatml_tokenizer.encode(t, add_special_tokens=False)


class _Disagreeing:
    """A tokenizer wrapper whose encode maps ids (as a normalizing wrapper would): its Rust backend
    alone gives other ids, so the encoder must keep to encode."""

    chat_template = None

    def __init__(self, inner):
        self._inner = inner
        self.backend_tokenizer = inner.backend_tokenizer
        self.calls = 0

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return [i + 1 for i in self._inner.encode(text, add_special_tokens=add_special_tokens)]


def test_a_tokenizer_whose_backend_disagrees_is_used_through_encode(chatml_tokenizer):
    tok = _Disagreeing(chatml_tokenizer)
    encode = prompt_encoder(tok)
    for text in ("hello world", "the answer is 42", "hello world"):
        assert encode(text) == [i + 1 for i in chatml_tokenizer.encode(text, add_special_tokens=False)]
    assert tok.calls == 3


def test_the_fast_path_is_taken_once_checked(chatml_tokenizer):
    class Counting(_Disagreeing):
        def encode(self, text, add_special_tokens=False):
            self.calls += 1
            return self._inner.encode(text, add_special_tokens=add_special_tokens)

    tok = Counting(chatml_tokenizer)
    encode = prompt_encoder(tok)
    for text in ("hello world", "the answer is 42", "hello"):
        assert encode(text) == chatml_tokenizer.encode(text, add_special_tokens=False)
    assert tok.calls == 1  # the first text only, to check the backend against it


def test_chat_prompts_go_through_the_template_with_the_generation_prompt(chatml_tokenizer):
    encode = prompt_encoder(chatml_tokenizer)  # the tokenizer has a template: chat by default
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]

    def rendered(msgs):
        ids = chatml_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    assert encode({"prompt": messages}) == rendered(messages)
    assert encode({"prompt": "hello"}) == rendered([{"role": "user", "content": "hello"}])
    assert encode({"question": "hello"} | {"prompt": "x"}) == rendered([{"role": "user", "content": "x"}])
    assert prompt_encoder(chatml_tokenizer, field="question")({"question": "hello"}) == rendered(
        [{"role": "user", "content": "hello"}]
    )


def test_bad_input_is_refused_naming_it(chatml_tokenizer):
    with pytest.raises(TypeError, match="tokenizer with encode"):
        prompt_encoder(object())
    with pytest.raises(TypeError, match="str or a sequence of message mappings, got int"):
        prompt_encoder(chatml_tokenizer)({"prompt": 3})
    with pytest.raises(KeyError):
        prompt_encoder(chatml_tokenizer)({"question": "no prompt field"})


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet="ab ", max_size=3000), max_tokens=st.integers(min_value=0, max_value=60))
def test_encode_bounded_is_encode_under_the_bound_and_none_over_it(text, max_tokens):
    from rollouts.data import encode_bounded

    def words(t):  # a token per word: tokens of any length, so prefixes do the measuring
        return t.split()

    ids = encode_bounded(words, text, max_tokens)
    assert ids == (words(text) if len(words(text)) <= max_tokens else None)


def test_encode_bounded_reads_a_prefix_of_a_huge_text():
    from rollouts.data import MAX_CHARS_PER_TOKEN, encode_bounded

    seen = []

    def chars(t):
        seen.append(len(t))
        return list(t)

    assert encode_bounded(chars, "z" * 10_000_000, 100) is None
    assert seen == [100 * MAX_CHARS_PER_TOKEN]
    with pytest.raises(ValueError, match="max_tokens must be >= 0, got -1"):
        encode_bounded(chars, "z", -1)
