"""Functions named by import path in a config: "package.module:name" or "path/to/file.py:name".

Resolved before any work starts, with errors that name the config key, the path and what is wrong
(does not import, no such name, not callable, wrong number of positional parameters).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PLUGIN_MODULE_PREFIX = "_rollouts_plugin_"
"""The start of the module name a "path/to/file.py:name" plugin file is loaded under."""


class PluginError(ValueError):
    """A function named in a config cannot be used; the message names the key and the reason."""


def load_object(spec: str, *, key: str) -> Any:
    """The object `spec` names: "package.module:name" or "path/to/file.py:name" (relative to the cwd)."""
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name.isidentifier():
        raise PluginError(f"{key} {spec!r} must look like 'package.module:name' or 'path/to/file.py:name'")
    if module_part.endswith(".py"):
        module = _load_file(Path(module_part), key=key, spec=spec)
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as e:
            raise PluginError(f"{key} {spec!r}: module {module_part!r} does not import: {type(e).__name__}: {e}") from e
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:20]
        raise PluginError(f"{key} {spec!r}: {module_part!r} has no {name!r} (it has {public})") from None


def _load_file(path: Path, *, key: str, spec: str) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"{key} {spec!r}: no such file {str(path)!r}")
    # A unique module name per file: two plugin files both called reward.py must not collide.
    name = f"{PLUGIN_MODULE_PREFIX}{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise PluginError(f"{key} {spec!r}: {str(path)!r} does not import: {type(e).__name__}: {e}") from e
    return module


def check_function(
    fn: Any, *, key: str, num_positional: int, what: str, keywords: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """`fn` if it is callable with `num_positional` positional arguments and the keyword arguments
    `keywords` (the ones its caller always passes), else a PluginError."""
    if not callable(fn):
        raise PluginError(f"{key}: {fn!r} is a {type(fn).__name__}, not a function; it must be {what}")
    function: Callable[..., Any] = fn
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return function  # a builtin without a signature: trust it
    try:
        signature.bind(*range(num_positional), **dict.fromkeys(keywords, 0))
    except TypeError as e:
        named = f" and keyword argument(s) {', '.join(keywords)}" if keywords else ""
        raise PluginError(
            f"{key}: {getattr(fn, '__name__', fn)!r}{signature} cannot be called with "
            f"{num_positional} positional argument(s){named} ({e}); it must be {what}"
        ) from None
    return function


def resolve_function(
    spec: str | Callable[..., Any], *, key: str, num_positional: int, what: str, keywords: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """A function given directly or by import path, checked for its arity (and the keywords its caller passes)."""
    fn = load_object(spec, key=key) if isinstance(spec, str) else spec
    return check_function(fn, key=key, num_positional=num_positional, what=what, keywords=keywords)
