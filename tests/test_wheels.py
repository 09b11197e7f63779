"""Every package builds a wheel alone, rollouts-types installs and imports without torch, the
README's install command for one package resolves its rollouts dependencies from the folder of
built wheels, and the release script's checks pass on them."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement

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
    """The six wheels and sdists in one folder, built by the release script as a release builds them."""
    out = tmp_path_factory.mktemp("wheels")
    _run(sys.executable, str(ROOT / "scripts" / "release.py"), "--out", str(out), "--no-twine")
    return out


def _installed_closure(name: str) -> list[importlib.metadata.Distribution]:
    """The installed distribution `name` and every distribution it needs (extras followed), from this environment."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [(name, frozenset())]
    while todo:
        dist_name, extras = todo.pop()
        dist = importlib.metadata.distribution(dist_name)
        key = dist.metadata["Name"].lower()
        if key in seen and not extras:
            continue
        seen[key] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((req.name, frozenset(req.extras)))
    return list(seen.values())


def _link_into(venv_python: Path, dists: list[importlib.metadata.Distribution]) -> None:
    """Make `dists` installed in the venv of `venv_python` by linking their files (nothing is downloaded)."""
    site = Path(
        subprocess.run(
            [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=_BUILD_TIMEOUT_S,
        ).stdout.strip()
    )
    here = Path(sysconfig.get_paths()["purelib"])
    for dist in dists:
        for top in sorted({Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}):
            if not (site / top).exists() and (here / top).exists():
                (site / top).symlink_to(here / top)


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


def _pip() -> list[str] | None:
    """A pip command line (this interpreter's, else the base interpreter's), or None without pip."""
    for python in (sys.executable, str(Path(sys.base_prefix) / "bin" / "python3")):
        probe = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, timeout=_BUILD_TIMEOUT_S)
        if probe.returncode == 0:
            return [python, "-m", "pip"]
    return None


def test_the_readme_install_command_resolves_rollouts_types_from_the_wheels_folder(wheels, tmp_path):
    """`pip install --find-links dist/ rollouts-losses`, the README's command, with --no-index so that
    nothing is downloaded: torch and what it needs are linked in from this environment first (uv's
    resolver never takes an installed torch as a candidate offline, pip's does), and
    rollouts-types must come from the folder of built wheels."""
    pip = _pip()
    if pip is None:
        pytest.skip("pip is not installed here (the README's install command is a pip command)")
    venv = tmp_path / "venv"
    _run(UV, "venv", "--python", sys.executable, str(venv))
    python = venv / "bin" / "python"
    _link_into(python, _installed_closure("torch"))
    _run(*pip, "--python", str(python), "install", "--no-index", "--find-links", str(wheels), "rollouts-losses")
    code = (
        "import importlib.metadata as md, torch\n"
        "from rollouts.losses import group_advantages\n"
        "advantages = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))\n"
        "print(md.version('rollouts-types'), [round(a, 3) for a in advantages.tolist()])\n"
    )
    assert _run(str(python), "-c", code, cwd=tmp_path).stdout.strip() == "0.1.0 [0.707, -0.707]"


def test_the_release_check_passes_on_the_built_files_and_fails_on_an_empty_folder(wheels, tmp_path):
    release = [sys.executable, str(ROOT / "scripts" / "release.py"), "--check-only", "--no-twine"]
    assert "metadata matches every pyproject.toml" in _run(*release, "--out", str(wheels)).stdout
    empty = subprocess.run([*release, "--out", str(tmp_path)], capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    assert empty.returncode == 1 and "expected one rollouts_types-*.whl, found []" in empty.stderr
