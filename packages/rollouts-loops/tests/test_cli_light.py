"""`rollouts --help`, `--version`, `config show` and a config error answer without importing the
training stack: the command's module loads only when a run starts."""

import subprocess
import sys

import pytest

_PROBE = """
import contextlib, io, sys
from rollouts.loops.app.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        status = main(sys.argv[1:])
    except SystemExit as e:  # --help and --version exit through argparse
        status = e.code
heavy = sorted(m for m in ("torch", "transformers", "httpx", "rollouts.backends") if m in sys.modules)
print(status, heavy)
"""


@pytest.mark.parametrize(
    "argv, status",
    [
        (["--help"], 0),
        (["--version"], 0),
        (["rl", "--help"], 0),
        (["engine", "--help"], 0),
        (["config", "show", "rl"], 0),
        (["rl", "--config", "BAD"], 2),
        (["sft", "--config", "MISSING.toml"], 2),
    ],
)
def test_the_command_line_answers_without_the_training_stack(tmp_path, argv, status):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rl]\nnum_steps = -1\n")
    argv = [str(bad) if a == "BAD" else str(tmp_path / a) if a.endswith(".toml") else a for a in argv]
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{status} []"
