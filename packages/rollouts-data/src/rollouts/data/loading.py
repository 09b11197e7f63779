"""Loading prompts and conversations from JSONL / JSON files, with errors that say where.

Every error names the file, the line (JSONL) or record index (JSON), and the field, and a load
either returns every record or raises: a malformed record never yields a shorter list that looks
complete.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ROLES", "load_conversations", "load_prompts", "load_records", "validate_messages"]

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a conversation may hold."""


def _where(path: Path, line: int | None, index: int) -> str:
    return f"{path}:{line}" if line is not None else f"{path} record {index}"


def load_records(path: str | Path) -> list[tuple[str, Any]]:
    """Parse a .jsonl (one JSON value per non-blank line) or .json (a top-level list) file.

    Returns (location, record) pairs, where location reads `file:line` or `file record i`.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        out = []
        # Only "\n" ends a record: str.splitlines() also splits at U+2028, U+0085 and others,
        # which JSON strings may hold raw (json.dumps(..., ensure_ascii=False) writes them so).
        for lineno, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                out.append((_where(path, lineno, len(out)), json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json file must hold a top-level list of records, got {type(data).__name__}")
        out = [(_where(path, None, i), record) for i, record in enumerate(data)]
    else:
        raise ValueError(f"{path}: unknown extension {path.suffix!r}; expected .jsonl or .json")
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


def load_prompts(path: str | Path, *, field: str = "prompt") -> list[dict[str, Any]]:
    """Prompt records: objects whose `field` is a non-empty string or a list of chat messages."""
    out = []
    for where, record in load_records(path):
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: record must be an object, got {type(record).__name__}")
        if field not in record:
            raise ValueError(f"{where}: missing field '{field}' (keys: {sorted(record)})")
        value = record[field]
        if isinstance(value, str):
            if not value:
                raise ValueError(f"{where}: field '{field}' is an empty string")
        else:
            validate_messages(where, field, value)
        out.append(dict(record))
    return out


def load_conversations(path: str | Path, *, field: str = "messages") -> list[tuple[dict[str, Any], ...]]:
    """Conversations: objects whose `field` is a list of {"role", "content"} messages."""
    out = []
    for where, record in load_records(path):
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: record must be an object, got {type(record).__name__}")
        if field not in record:
            raise ValueError(f"{where}: missing field '{field}' (keys: {sorted(record)})")
        out.append(validate_messages(where, field, record[field]))
    return out
