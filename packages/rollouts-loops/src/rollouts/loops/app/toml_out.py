"""Run configs written out as TOML: the resolved config a run directory keeps (`to_toml`, which
reads back into an equal config) and the documented defaults `rollouts config show` prints.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import typing
from collections.abc import Mapping
from typing import Any, Literal

NONE = "none"
"""TOML has no null: an optional setting (max_grad_norm, is_cap, ...) is switched off with "none"."""


def to_toml(config: Any) -> str:
    """Render a (nested) config as TOML, for the resolved config written into a run directory."""
    return _toml_tables(dataclasses.asdict(config), prefix="")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):  # an inline table (a list of tables, e.g. reward.models)
        return "{" + ", ".join(f"{k} = {_toml_value(NONE if v is None else v)}" for k, v in value.items()) + "}"
    return repr(value)


def _toml_tables(data: Mapping[str, Any], *, prefix: str) -> str:
    scalars = [f"{k} = {_toml_value(NONE if v is None else v)}" for k, v in data.items() if not isinstance(v, Mapping)]
    lines = ([f"[{prefix}]"] if prefix and scalars else []) + scalars
    out = "\n".join(lines) + ("\n\n" if lines else "")
    for key, value in data.items():
        if isinstance(value, Mapping):
            out += _toml_tables(value, prefix=f"{prefix}.{key}" if prefix else key)
    return out


def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it in the class body (one line), where the source is available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_note(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + " | ".join(repr(a) for a in typing.get_args(tp))
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp):
        return f'{" | ".join(getattr(a, "__name__", str(a)) for a in args)}, or "none"'
    return getattr(tp, "__name__", str(tp))


def documented_toml(cls: type) -> str:
    """The default config of `cls` (SFTRun / RLRun) as TOML, each key under a comment saying what it is."""
    return _documented(cls, cls(), prefix="")


def _documented(cls: type, value: Any, *, prefix: str) -> str:
    hints, docs = typing.get_type_hints(cls), _field_docs(cls)
    lines, tables = [], []
    for f in dataclasses.fields(cls):
        current = getattr(value, f.name)
        if dataclasses.is_dataclass(current):
            tables.append((f.name, current))
            continue
        note = _type_note(hints[f.name])
        lines.append(f"# {docs[f.name]} ({note})" if f.name in docs else f"# {note}")
        lines.append(f"{f.name} = {_toml_value(NONE if current is None else current)}")
    out = "\n".join(([f"[{prefix}]"] if prefix and lines else []) + lines) + ("\n\n" if lines else "")
    for name, child in tables:
        out += _documented(type(child), child, prefix=f"{prefix}.{name}" if prefix else name)
    return out
