"""The package layering rule, checked from source: imports go only downward.

floor 4 loops; floor 3 backends; floor 2 losses, data, sync; floor 1 types. A module may import
only packages on lower floors, must declare each rollouts-* package it imports in its
pyproject.toml, rollouts-types imports only the standard library, and rollouts-data and
rollouts-sync never import torch (but for the modules of rollouts-sync's [broadcast] and [ipc] extras
and the engine-side worker extension, TORCH_EXTRA_MODULES). Run as a script to print the problems of a tree.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

FLOORS = {"types": 1, "losses": 2, "data": 2, "sync": 2, "backends": 3, "loops": 4}
TORCH_FREE = frozenset({"types", "data", "sync"})
# torch where a package's optional extra needs it: rollouts-sync's [broadcast] extra (the trainer's side of
# the broadcast transport) and the worker extension, which runs inside the engine's own environment.
TORCH_EXTRA_MODULES = frozenset(
    {
        "rollouts-sync/src/rollouts/sync/broadcast.py",
        "rollouts-sync/src/rollouts/sync/broadcast_group.py",
        "rollouts-sync/src/rollouts/sync/broadcast_pieces.py",
        "rollouts-sync/src/rollouts/sync/ipc.py",
        "rollouts-sync/src/rollouts/sync/ipc_handles.py",
        "rollouts-sync/src/rollouts/sync/worker_extension.py",
        "rollouts-sync/src/rollouts/sync/worker_ipc.py",
        "rollouts-sync/src/rollouts/sync/worker_receive.py",
    }
)
STDLIB_ONLY = frozenset({"types"})


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in a file, wherever it stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _declared(pyproject: Path) -> set[str]:
    """The rollouts-* distributions a pyproject declares as runtime dependencies."""
    deps = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("dependencies", [])
    names = {re.split(r"[\s<>=!~;\[]", d.strip(), maxsplit=1)[0] for d in deps}
    return {n.removeprefix("rollouts-") for n in names if n.startswith("rollouts-")}


def check(root: Path) -> list[str]:
    """Every layering problem under `root/packages`, as 'file:line message' strings."""
    problems: list[str] = []
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name, floor in FLOORS.items():
        package = root / "packages" / f"rollouts-{name}"
        source = package / "src" / "rollouts" / name
        if not source.is_dir():
            problems.append(f"{source.relative_to(root)}: missing package source folder")
            continue
        if (package / "src" / "rollouts" / "__init__.py").exists():
            problems.append(f"rollouts-{name}: src/rollouts/__init__.py breaks the rollouts namespace package")
        declared = _declared(package / "pyproject.toml")
        for path in sorted(source.rglob("*.py")):
            where = path.relative_to(root)
            for line, module in _imports(path):
                top, *rest = module.split(".")
                if top == "rollouts" and rest and rest[0] != name:
                    other = rest[0]
                    if other not in FLOORS:
                        problems.append(f"{where}:{line} imports unknown package rollouts.{other}")
                    elif FLOORS[other] >= floor:
                        problems.append(
                            f"{where}:{line} imports rollouts.{other} (floor {FLOORS[other]}) from floor {floor}: "
                            "imports go only downward"
                        )
                    elif other not in declared:
                        problems.append(
                            f"{where}:{line} imports rollouts.{other} but rollouts-{name} does not declare rollouts-{other}"
                        )
                elif name in STDLIB_ONLY and top != "rollouts" and top not in stdlib:
                    problems.append(f"{where}:{line} imports {top}: rollouts-types uses the standard library only")
                elif (
                    name in TORCH_FREE
                    and top == "torch"
                    and str(path.relative_to(root / "packages")) not in TORCH_EXTRA_MODULES
                ):
                    problems.append(f"{where}:{line} imports torch: rollouts-{name} must not need torch")
    return problems


if __name__ == "__main__":
    found = check(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())
    print("\n".join(found + [f"layers: {len(found)} problem(s)"]))
    sys.exit(1 if found else 0)
