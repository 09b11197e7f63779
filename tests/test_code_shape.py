"""The source keeps its shape (tests/code_shape.py measures it): modules a reader can hold, imports
at the top, signatures that say what a function uses, and a rollouts-loops top level that maps the
package. And the measure itself counts what it says it counts."""

from pathlib import Path

from code_shape import (
    MAX_FUNCTION_PARAMETERS,
    MAX_LOCAL_IMPORTS,
    MAX_LOOPS_TOP_MODULES,
    MAX_MODULE_LINES,
    measure,
)

ROOT = Path(__file__).resolve().parents[1]


def test_no_module_is_longer_than_the_limit():
    assert measure(ROOT).long_modules == (), f"split by concern: modules over {MAX_MODULE_LINES} lines"


def test_imports_stay_at_module_tops():
    local = measure(ROOT).local_imports
    assert len(local) <= MAX_LOCAL_IMPORTS, "\n".join(f"{p}:{line}: {m}" for p, line, m in local)


def test_no_function_takes_more_parameters_than_the_limit():
    assert measure(ROOT).wide_functions == (), f"group what travels together: over {MAX_FUNCTION_PARAMETERS}"


def test_rollouts_loops_top_level_stays_small():
    assert len(measure(ROOT).loops_top_modules) <= MAX_LOOPS_TOP_MODULES


def _package(tmp_path: Path, name: str, module: str, code: str) -> Path:
    path = tmp_path / "packages" / f"rollouts-{name}" / "src" / "rollouts" / name / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(code)
    return path


def test_the_measure_counts_what_it_names(tmp_path):
    _package(tmp_path, "loops", "long.py", "x = 1\n" * (MAX_MODULE_LINES + 1))
    params = ", ".join(f"a{i}" for i in range(MAX_FUNCTION_PARAMETERS + 1))
    _package(tmp_path, "loops", "wide.py", f"def wide(self, {params}):\n    pass\n\ndef narrow(self, a):\n    pass\n")
    _package(
        tmp_path,
        "data",
        "local.py",
        "def f():\n    import json\n    import transformers\n    from peft import LoraConfig\n",
    )
    _package(tmp_path, "backends", "local.py", "def f():\n    import transformers\n")
    shape = measure(tmp_path)
    assert [p.rsplit("/", 1)[-1] for p, _ in shape.long_modules] == ["long.py"]
    assert [(name, count) for _, _, name, count in shape.wide_functions] == [("wide", MAX_FUNCTION_PARAMETERS + 1)]
    # json counts; transformers is optional only in rollouts-data ([chat] extra); peft is an extra everywhere
    assert sorted((p.split("/")[1], m) for p, _, m in shape.local_imports) == [
        ("rollouts-backends", "transformers"),
        ("rollouts-data", "json"),
    ]
    assert shape.loops_top_modules == ("long.py", "wide.py")
