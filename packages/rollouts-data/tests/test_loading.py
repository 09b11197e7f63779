"""JSONL / JSON loading: every error names file, line (or record) and field."""

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollouts.data import load_conversations, load_prompts
from rollouts.data.loading import load_records


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_prompts_and_blank_lines(tmp_path):
    p = _write(
        tmp_path / "p.jsonl", '{"prompt": "2+2?", "answer": "4"}\n\n{"prompt": [{"role": "user", "content": "hi"}]}\n'
    )
    records = load_prompts(p)
    assert [r["prompt"] for r in records][0] == "2+2?" and len(records) == 2


def test_json_conversations(tmp_path):
    data = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    p = _write(tmp_path / "c.json", json.dumps(data))
    convs = load_conversations(p)
    assert convs == [tuple(data[0]["messages"])]


def test_invalid_json_names_file_and_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        load_prompts(p)


def test_missing_field_names_line_and_field(tmp_path):
    p = _write(tmp_path / "p.jsonl", '{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: missing field 'prompt'"):
        load_prompts(p)


def test_bad_message_names_nested_field(tmp_path):
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}
    p = _write(
        tmp_path / "c.jsonl",
        json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n" + json.dumps(rec) + "\n",
    )
    with pytest.raises(ValueError, match=r"c\.jsonl:2: field 'messages\[1\]\.role'"):
        load_conversations(p)
    p2 = _write(tmp_path / "c.json", json.dumps([{"messages": [{"role": "user", "content": 3}]}]))
    with pytest.raises(ValueError, match=r"c\.json record 0: field 'messages\[0\]\.content'"):
        load_conversations(p2)


def test_empty_and_wrong_shapes_raise(tmp_path):
    with pytest.raises(ValueError, match="no records"):
        load_records(_write(tmp_path / "e.jsonl", "\n\n"))
    with pytest.raises(ValueError, match="top-level list"):
        load_records(_write(tmp_path / "o.json", '{"a": 1}'))
    with pytest.raises(ValueError, match="extension"):
        load_records(_write(tmp_path / "x.txt", "hi"))
    with pytest.raises(ValueError, match=r"p\.jsonl:1: field 'prompt' is an empty string"):
        load_prompts(_write(tmp_path / "p.jsonl", '{"prompt": ""}\n'))


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.text(min_size=1).filter(str.strip), min_size=1, max_size=5), crlf=st.booleans())
def test_any_text_written_raw_loads_back_with_its_line_numbers(prompts, crlf):
    """U+2028, U+0085, \x0c... are raw inside JSON strings (ensure_ascii=False); only newlines end records."""
    newline = "\r\n" if crlf else "\n"
    text = newline.join(json.dumps({"prompt": p, "i": i}, ensure_ascii=False) for i, p in enumerate(prompts)) + newline
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.jsonl"
        path.write_bytes(text.encode("utf-8"))
        assert [(r["prompt"], r["i"]) for r in load_prompts(path)] == [(p, i) for i, p in enumerate(prompts)]
        locations = [where for where, _ in load_records(path)]
        assert locations == [f"{path}:{i + 1}" for i in range(len(prompts))]
