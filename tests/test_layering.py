"""The layering rule holds for the project, and the checker catches planted violations."""

import shutil
from pathlib import Path

import pytest
from layering import check

ROOT = Path(__file__).resolve().parents[1]


def test_project_follows_the_layering_rule():
    assert check(ROOT) == []


@pytest.fixture
def tree(tmp_path):
    """A copy of the packages' sources and pyprojects to plant violations in."""
    for package in (ROOT / "packages").iterdir():
        shutil.copytree(package / "src", tmp_path / "packages" / package.name / "src")
        shutil.copy(package / "pyproject.toml", tmp_path / "packages" / package.name / "pyproject.toml")
    assert check(tmp_path) == []
    return tmp_path


def _plant(tree: Path, package: str, code: str) -> None:
    (tree / "packages" / f"rollouts-{package}" / "src" / "rollouts" / package / "_planted.py").write_text(code)


@pytest.mark.parametrize(
    ("package", "code", "message"),
    [
        ("losses", "from rollouts.backends import x\n", "imports go only downward"),
        ("data", "import rollouts.sync\n", "imports go only downward"),  # same floor
        ("backends", "def f():\n    from rollouts.loops.app.cli import main\n", "imports go only downward"),
        ("data", "import torch.nn\n", "rollouts-data must not need torch"),
        ("sync", "from torch import nn\n", "rollouts-sync must not need torch"),
        ("types", "import numpy as np\n", "rollouts-types uses the standard library only"),
        ("losses", "from rollouts.wat import x\n", "unknown package rollouts.wat"),
    ],
)
def test_checker_catches_planted_violation(tree, package, code, message):
    _plant(tree, package, code)
    problems = check(tree)
    assert len(problems) == 1 and message in problems[0] and "_planted.py" in problems[0]


def test_checker_catches_undeclared_dependency(tree):
    _plant(tree, "backends", "from rollouts.losses import aggregate\n")
    assert check(tree) == []
    pyproject = tree / "packages" / "rollouts-backends" / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"rollouts-losses>=0.1,<0.2", ', ""))
    problems = check(tree)
    assert problems and all("does not declare rollouts-losses" in p for p in problems)


def test_checker_catches_namespace_init(tree):
    (tree / "packages" / "rollouts-types" / "src" / "rollouts" / "__init__.py").write_text("")
    assert any("namespace package" in p for p in check(tree))
