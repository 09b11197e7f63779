"""Preference pairs: loading in every accepted shape, errors that name the record, and tokenization
whose masks cover exactly each completion after one shared prompt."""

import json

import pytest

from rollouts.data import PreferencePair, load_preference_pairs, tokenize_preference_pair

END = "<|im_end|>"


def _write(tmp_path, records):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_every_accepted_shape_loads(tmp_path):
    path = _write(
        tmp_path,
        [
            {"prompt": "hello", "chosen": "world", "rejected": "you"},
            {
                "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                "chosen": [{"role": "assistant", "content": "world"}],
                "rejected": {"role": "assistant", "content": "today"},
            },
        ],
    )
    first, second = load_preference_pairs(path)
    assert first == PreferencePair(prompt=({"role": "user", "content": "hello"},), chosen="world", rejected="you")
    assert [m["role"] for m in second.prompt] == ["system", "user"]
    assert (second.chosen, second.rejected) == ("world", "today")


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"prompt": "hi", "chosen": "a"}, r"pairs.jsonl:1: missing field\(s\) \['rejected'\]"),
        ({"prompt": " ", "chosen": "a", "rejected": "b"}, "'prompt' is empty"),
        ({"prompt": "hi", "chosen": "same", "rejected": "same"}, "states no preference"),
        ({"prompt": "hi", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "one assistant message"),
        ({"prompt": [{"role": "assistant", "content": "a"}], "chosen": "a", "rejected": "b"}, "ends with an assistant"),
        ({"prompt": "hi", "chosen": 3, "rejected": "b"}, "'chosen' must be a non-empty list"),
        (["not", "an", "object"], "record must be an object"),
    ],
)
def test_bad_records_are_refused_naming_where(tmp_path, record, match):
    with pytest.raises(ValueError, match=match):
        load_preference_pairs(_write(tmp_path, [record]))


def test_masks_cover_each_completion_after_the_same_prompt(chatml_tokenizer):
    tok = chatml_tokenizer
    pair = PreferencePair(prompt=({"role": "user", "content": "hello world"},), chosen="the answer", rejected="42")
    chosen, rejected = tokenize_preference_pair(pair, tok, max_length=128)
    assert chosen.num_prompt_tokens == rejected.num_prompt_tokens
    n = chosen.num_prompt_tokens
    assert list(chosen.tokens[:n]) == list(rejected.tokens[:n])  # one prompt, rendered once
    for sample, text in ((chosen, "the answer"), (rejected, "42")):
        trained = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m > 0]
        assert tok.decode(trained, skip_special_tokens=False) == text + END
        assert all(m == 0 for m in list(sample.loss_mask)[:n])


def test_long_pairs_are_cut_and_marked(chatml_tokenizer):
    pair = PreferencePair(prompt=({"role": "user", "content": "hello"},), chosen="world " * 40, rejected="you")
    _, whole = tokenize_preference_pair(pair, chatml_tokenizer, max_length=512)
    limit = len(whole.tokens)  # the short completion just fits
    chosen, rejected = tokenize_preference_pair(pair, chatml_tokenizer, max_length=limit)
    assert len(chosen.tokens) == limit and chosen.status == "truncated"
    assert rejected.status == "completed"
    with pytest.raises(TypeError, match="PreferencePair"):
        tokenize_preference_pair({"prompt": "x"}, chatml_tokenizer, max_length=limit)
