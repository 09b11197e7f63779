"""`--set key.path=value` edits of a run file's data: values read as TOML, a bare word as a string."""

from __future__ import annotations

import datetime
import json
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from rollouts.loops.errors import ConfigError


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A deep copy of `data` with each 'a.b.c=value' override set (tables created as needed)."""
    out: dict[str, Any] = json.loads(json.dumps(data))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        *parents, leaf = key.strip().split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is a value, not a table")
            node = child
        value = _parse_value(text.strip())
        if isinstance(value, datetime.date | datetime.time):  # datetime is a date too
            raise ConfigError(
                f"--set {item!r}: {text.strip()} reads as a TOML date or time; quote it for a string: "
                f"{key.strip()}='{text.strip()}'"
            )
        node[leaf] = value
    return out
