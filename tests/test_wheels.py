"""Every package builds a wheel alone, and rollouts-types installs and imports without torch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
UV = shutil.which("uv")
_BUILD_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(UV is None, reason="uv is not on PATH (the README's test command runs under uv)")


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_PROJECT_ENVIRONMENT", "VIRTUAL_ENV"))}
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    for package in PACKAGES:
        _run(UV, "build", "--package", package, "--no-sources", "--wheel", "--out-dir", str(out))
    return out


def test_every_package_builds_a_wheel(wheels):
    built = {w.name.split("-")[0].replace("_", "-") for w in wheels.glob("*.whl")}
    assert built == set(PACKAGES) and len(PACKAGES) == 6


def test_types_wheel_imports_in_a_bare_venv_without_torch(wheels, tmp_path):
    (wheel,) = wheels.glob("rollouts_types-*.whl")
    venv = tmp_path / "venv"
    _run(UV, "venv", "--python", sys.executable, str(venv))
    python = venv / "bin" / "python"
    _run(UV, "pip", "install", "--python", str(python), "--offline", "--no-deps", str(wheel))
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torch') is None, 'torch must not be installed here'\n"
        "import rollouts.types as t\n"
        "s = t.Sample(tokens=[1, 2], num_prompt_tokens=1, loss_mask=[0, 1])\n"
        "assert s.response_length == 1 and 'torch' not in sys.modules\n"
        "print(t.__version__)\n"
    )
    assert _run(str(python), "-c", code, cwd=tmp_path).stdout.strip() == "0.1.0"
