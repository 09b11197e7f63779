"""The shape of the source, measured over packages/*/src (tests excluded): module length, imports
inside functions, parameters per function, and the modules at rollouts-loops' top level.

Run as a script to print the figures and every place over a limit; tests/test_layering.py holds
the limits.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_PARAMETERS = 10
MAX_LOCAL_IMPORTS = 25
MAX_LOOPS_TOP_MODULES = 12

# Imports a module may defer to the function that needs them: extras a user may not have installed
# (each package's [project.optional-dependencies]) and the GPU/engine stacks found only on some hosts.
OPTIONAL_MODULES = frozenset(
    {
        "peft",
        "matplotlib",
        "wandb",
        "tensorboard",
        "math_verify",
        "liger_kernel",
        "triton",
        "vllm",
        "sglang",
        "openai",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    long_modules: tuple[tuple[str, int], ...]
    """(path, lines) of each module over MAX_MODULE_LINES."""
    local_imports: tuple[tuple[str, int, str], ...]
    """(path, line, module) of each import inside a function, optional dependencies left out."""
    wide_functions: tuple[tuple[str, int, str, int], ...]
    """(path, line, name, parameters) of each function over MAX_FUNCTION_PARAMETERS (self/cls not counted)."""
    loops_top_modules: tuple[str, ...]
    """The modules directly in rollouts/loops/ (the package's __init__ not counted)."""


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("packages/*/src/rollouts/**/*.py"))


# rollouts-data's [chat] extra: the package itself needs neither.
OPTIONAL_IN_DATA = frozenset({"transformers", "jinja2"})


def _is_optional(module: str, package: str) -> bool:
    top = module.split(".")[0]
    if package == "rollouts-data" and top in OPTIONAL_IN_DATA:
        return True
    return top in OPTIONAL_MODULES or module.startswith("torch.utils.tensorboard")


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return len([n for n in names if n not in ("self", "cls")])


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A @triton.jit kernel: its parameters are the launch's pointers, sizes and compile-time constants."""
    return any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)


def _local_imports(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                out += [(node.lineno, a.name) for a in node.names if not _is_optional(a.name, package)]
            elif isinstance(node, ast.ImportFrom) and node.module and not _is_optional(node.module, package):
                out.append((node.lineno, node.module))
    return sorted(set(out))  # nested functions are walked twice


def measure(root: Path) -> Shape:
    long_modules, local_imports, wide = [], [], []
    for path in _sources(root):
        text = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(root))
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            long_modules.append((rel, lines))
        tree = ast.parse(text, filename=rel)
        local_imports += [(rel, line, module) for line, module in _local_imports(tree, path.relative_to(root).parts[1])]
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                count = _parameters(node)
                if count > MAX_FUNCTION_PARAMETERS and not _is_kernel(node):
                    wide.append((rel, node.lineno, node.name, count))
    loops = root / "packages/rollouts-loops/src/rollouts/loops"
    top = tuple(sorted(p.name for p in loops.glob("*.py") if p.name != "__init__.py"))
    return Shape(
        long_modules=tuple(long_modules),
        local_imports=tuple(local_imports),
        wide_functions=tuple(wide),
        loops_top_modules=top,
    )


def main(root: Path) -> int:
    shape = measure(root)
    print(f"modules over {MAX_MODULE_LINES} lines: {len(shape.long_modules)}")
    for path, lines in shape.long_modules:
        print(f"  {path}: {lines}")
    print(
        f"function-local imports (optional dependencies aside): {len(shape.local_imports)} (at most {MAX_LOCAL_IMPORTS})"
    )
    for path, line, module in shape.local_imports:
        print(f"  {path}:{line}: {module}")
    print(f"functions over {MAX_FUNCTION_PARAMETERS} parameters: {len(shape.wide_functions)}")
    for path, line, name, count in shape.wide_functions:
        print(f"  {path}:{line}: {name} ({count})")
    print(f"rollouts-loops top-level modules: {len(shape.loops_top_modules)} (at most {MAX_LOOPS_TOP_MODULES})")
    print("  " + " ".join(shape.loops_top_modules))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
