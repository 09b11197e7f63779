"""The tiny tokenizer, saved beside its Qwen2 model, gives the same ids through transformers'
AutoTokenizer as through rollouts.backends.load_tokenizer, spaces included."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rollouts.backends import load_tokenizer
from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer, save_model

CORPUS = ["12 + 34 = 46", "what is 7 + 5? 12\n", "self._cmd = cmd", "café au lait"] * 20


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(as built, through AutoTokenizer, through load_tokenizer) after a save beside a Qwen2 model."""
    built = build_tokenizer(CORPUS, vocab_size=64)
    model = build_tiny_model(len(built), hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    model_dir = save_model(model, built, tmp_path_factory.mktemp("tiny"))
    return built, AutoTokenizer.from_pretrained(str(model_dir)), load_tokenizer(model_dir)


def _round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids, tokenizer.decode(ids)


def test_autotokenizer_keeps_the_spaces(tokenizers):
    _, auto, loaded = tokenizers
    text = "12 + 34 = 46"
    ids, decoded = _round_trip(auto, text)
    assert (ids, decoded) == _round_trip(loaded, text)
    assert decoded == text


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=" =._+?\nacdefilmstuwé0123456789", min_size=1, max_size=40))
def test_autotokenizer_and_load_tokenizer_agree(tokenizers, text):
    built, auto, loaded = tokenizers
    expected = _round_trip(built, text)
    assert _round_trip(auto, text) == expected and _round_trip(loaded, text) == expected
