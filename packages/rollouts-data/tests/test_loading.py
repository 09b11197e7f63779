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
        load_conversations(p, require_assistant=False)
    p2 = _write(tmp_path / "c.json", json.dumps([{"messages": [{"role": "user", "content": 3}]}]))
    with pytest.raises(ValueError, match=r"c\.json record 0: field 'messages\[0\]\.content'"):
        load_conversations(p2, require_assistant=False)


def test_empty_and_wrong_shapes_raise(tmp_path):
    with pytest.raises(ValueError, match="no records"):
        load_records(_write(tmp_path / "e.jsonl", "\n\n"))
    with pytest.raises(ValueError, match="top-level list"):
        load_records(_write(tmp_path / "o.json", '{"a": 1}'))
    with pytest.raises(ValueError, match="extension"):
        load_records(_write(tmp_path / "x.txt", "hi"))
    with pytest.raises(ValueError, match=r"p\.jsonl:1: field 'prompt' is empty or only whitespace \(''\)"):
        load_prompts(_write(tmp_path / "p.jsonl", '{"prompt": ""}\n'))


@pytest.mark.parametrize("blank", [" ", "\\n", "\\t  \\n"])
def test_a_whitespace_only_prompt_is_refused_like_an_empty_one(tmp_path, blank):
    with pytest.raises(ValueError, match=r"p\.jsonl:2: field 'prompt' is empty or only whitespace"):
        load_prompts(_write(tmp_path / "p.jsonl", f'{{"prompt": "1+1="}}\n{{"prompt": "{blank}"}}\n'))


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


def test_a_non_utf8_byte_names_file_line_and_column(tmp_path):
    for name in ("p.jsonl", "p.json"):
        good = b'{"prompt": "a"}\n' if name == "p.jsonl" else b'[{"prompt": "a"},\n'
        path = tmp_path / name
        path.write_bytes(good + b'{"prompt": "caf\xe9"}\n' + (b"" if name == "p.jsonl" else b"]"))
        with pytest.raises(ValueError, match=rf"{name}:2: not valid UTF-8 \(byte 0xe9 at column 16"):
            load_prompts(path)


def test_a_conversation_without_an_assistant_turn_names_file_and_line(tmp_path):
    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = _write(tmp_path / "c.jsonl", json.dumps(ok) + "\n" + json.dumps(user_only) + "\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:2: field 'messages' has no assistant message"):
        load_conversations(path)
    assert len(load_conversations(path, require_assistant=False)) == 2


def test_required_fields_are_checked_for_every_record_at_load_time(tmp_path):
    path = _write(
        tmp_path / "rl.jsonl",
        '{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": "4"}\n{"prompt": "3+3"}\n'
        '{"prompt": "4+4", "answer": null}\n',
    )
    assert len(load_prompts(path)) == 4  # nothing required: as before
    with pytest.raises(ValueError, match=r"rl\.jsonl:3: required field 'answer' is missing \(keys: \['prompt'\]\)"):
        load_prompts(path, required_fields=("answer",))
    lines = path.read_text().splitlines()
    _write(path, "\n".join(lines[:2] + lines[3:]) + "\n")
    with pytest.raises(ValueError, match=r"rl\.jsonl:3: required field 'answer' is null"):
        load_prompts(path, required_fields=["answer"])
    with pytest.raises(TypeError, match="the string 'answer'"):
        load_prompts(path, required_fields="answer")


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"prompt": NaN}', "NaN is not a JSON number"),
        ('{"prompt": "a", "w": -Infinity}', "-Infinity is not a JSON number"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"prompt": "a", "n": ' + "9" * 5000 + "}", "invalid JSON"),
    ],
)
def test_json_python_would_accept_or_crash_on_is_an_error_with_its_line(tmp_path, line, reason):
    path = _write(tmp_path / "p.jsonl", '{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"p\.jsonl:2: .*{reason}"):
        load_prompts(path)


def test_a_leading_byte_order_mark_is_allowed(tmp_path):
    for name, body in (("p.jsonl", '{"prompt": "a"}\n'), ("p.json", '[{"prompt": "a"}]')):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert load_prompts(path) == [{"prompt": "a"}]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["prompt", "answer", "messages", "role", "content", "x"]), inner, max_size=4)
    ),
    max_leaves=8,
)
_HOSTILE_LINE = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.builds(
        lambda p, a: json.dumps({"prompt": p, "answer": a}, ensure_ascii=False).encode(),
        st.text(max_size=5)
        | st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "x"]), "content": st.text(max_size=3) | st.integers()}
            )
        ),
        st.none() | st.text(max_size=3),
    ),
)


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(_HOSTILE_LINE, min_size=1, max_size=6))
def test_property_hostile_jsonl_lines_give_records_or_an_error_naming_file_and_line(lines):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "hostile.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        for load in (
            lambda: load_prompts(path, required_fields=("answer",)),
            lambda: load_conversations(path, field="prompt"),
        ):
            try:
                records = load()
            except ValueError as e:
                message = str(e)
                if message != f"{path}: no records; an empty dataset yields no training steps":
                    line = int(message.removeprefix(f"{path}:").split(":", 1)[0])  # ValueError if no line
                    assert 1 <= line <= len(lines), message
            else:
                assert 1 <= len(records) <= len(lines)
