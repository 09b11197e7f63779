"""Loading prompts and conversations from JSONL / JSON files, with errors that say where.

Every error names the file, the line (JSONL) or record index (JSON), and the field, and a load
either returns every record or raises: a malformed record never yields a shorter list that looks
complete. Each input is checked where it enters, for every record: the encoding (UTF-8; a leading
byte-order mark is allowed), the JSON (no NaN or Infinity, no nesting deep enough to blow the
stack, no integer too long to parse), required fields (`required_fields`: an RL answer key found
missing at load time, not mid-run by the reward function) and, for conversations, an assistant
turn to train on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ROLES", "load_conversations", "load_prompts", "load_records", "validate_messages"]

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a conversation may hold."""


_BOM = "\ufeff"


def _where(path: Path, line: int | None, index: int) -> str:
    return f"{path}:{line}" if line is not None else f"{path} record {index}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (a NaN or infinite value would train silently as NaN)")


def _parse(text: str, where: str) -> Any:
    """One JSON value; any failure is a ValueError that starts with `where`."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
    except RecursionError as e:  # "[[[[..." nested past the interpreter's stack
        raise ValueError(f"{where}: invalid JSON (nested too deeply to parse)") from e
    except ValueError as e:  # NaN/Infinity, or an integer longer than int()'s digit limit
        raise ValueError(f"{where}: invalid JSON ({e})") from e


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}: {e.reason}); "
            "re-encode the file as UTF-8"
        ) from e


def load_records(path: str | Path) -> list[tuple[str, Any]]:
    """Parse a .jsonl (one JSON value per non-blank line) or .json (a top-level list) file.

    Returns (location, record) pairs, where location reads `file:line` or `file record i`.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unknown extension {path.suffix!r}; expected .jsonl or .json")
    # Decoded line by line (a 0x0A byte is never inside a UTF-8 sequence), so a bad byte is
    # reported with its line. Only "\n" ends a record: str.splitlines() also splits at U+2028,
    # U+0085 and others, which JSON strings may hold raw (json.dumps(..., ensure_ascii=False)).
    lines = [_decode(raw_line, f"{path}:{i}") for i, raw_line in enumerate(path.read_bytes().split(b"\n"), start=1)]
    lines[0] = lines[0].removeprefix(_BOM)
    if suffix == ".jsonl":
        out: list[tuple[str, Any]] = []
        for lineno, line in enumerate(lines, start=1):
            if line.strip():
                out.append((_where(path, lineno, len(out)), _parse(line, f"{path}:{lineno}")))
    else:
        text = "\n".join(lines)
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        except RecursionError as e:
            raise ValueError(f"{path}: invalid JSON (nested too deeply to parse)") from e
        except ValueError as e:  # NaN/Infinity, or an integer too long; json does not say where
            raise ValueError(f"{path}: invalid JSON ({e})") from e
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json file must hold a top-level list of records, got {type(data).__name__}")
        out = [(_where(path, None, i), record) for i, record in enumerate(data)]
    if not out:
        raise ValueError(f"{path}: no records; an empty dataset yields no training steps")
    return out


def validate_messages(where: str, field: str, messages: Any) -> tuple[dict[str, Any], ...]:
    """Check a list of chat messages (role in ROLES, content a str); errors name `where` and the field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field '{field}' must be a non-empty list of messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}: field '{field}[{i}]' must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: field '{field}[{i}].role' must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(
                f"{where}: field '{field}[{i}].content' must be a string, got {type(m.get('content')).__name__}"
            )
    return tuple(dict(m) for m in messages)


def _check_required(where: str, record: Mapping[str, Any], required_fields: Sequence[str]) -> None:
    for name in required_fields:
        if record.get(name) is None:
            what = "is null" if name in record else f"is missing (keys: {sorted(record)})"
            raise ValueError(
                f"{where}: required field '{name}' {what}; every record needs it (e.g. the answer a reward "
                "function reads), so it is checked at load time rather than when the record is drawn"
            )


def load_prompts(
    path: str | Path, *, field: str = "prompt", required_fields: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Prompt records: objects whose `field` is a non-empty string or a list of chat messages.

    required_fields: other fields every record must carry, not null (an RL answer key such as
    "answer"); a record without one is an error naming its file, line and the field.
    """
    if isinstance(required_fields, str):
        raise TypeError(f"required_fields must be a sequence of field names, got the string {required_fields!r}")
    out = []
    for where, record in load_records(path):
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: record must be an object, got {type(record).__name__}")
        if field not in record:
            raise ValueError(f"{where}: missing field '{field}' (keys: {sorted(record)})")
        value = record[field]
        if isinstance(value, str):
            if not value.strip():  # nothing to condition on: every response would answer the same void
                raise ValueError(f"{where}: field '{field}' is empty or only whitespace ({value!r})")
        else:
            validate_messages(where, field, value)
        _check_required(where, record, required_fields)
        out.append(dict(record))
    return out


def load_conversations(
    path: str | Path, *, field: str = "messages", require_assistant: bool = True
) -> list[tuple[dict[str, Any], ...]]:
    """Conversations: objects whose `field` is a list of {"role", "content"} messages.

    require_assistant: every conversation must hold an assistant message (what SFT trains on);
    False for data trained with train_on="all".
    """
    out = []
    for where, record in load_records(path):
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: record must be an object, got {type(record).__name__}")
        if field not in record:
            raise ValueError(f"{where}: missing field '{field}' (keys: {sorted(record)})")
        messages = validate_messages(where, field, record[field])
        if require_assistant and not any(m["role"] == "assistant" for m in messages):
            raise ValueError(
                f"{where}: field '{field}' has no assistant message, so an SFT sample would train on nothing "
                "(pass require_assistant=False for train_on='all')"
            )
        out.append(messages)
    return out
