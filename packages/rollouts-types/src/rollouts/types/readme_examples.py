"""Checking that a package README's examples run as written: every ```python block, in a
subprocess of the running interpreter (so, in a package's own environment, with only what it
declares). A block right after `<!-- no-run: reason -->` is reported with that reason instead; a
block of `>>>` lines runs as a doctest, its printed results and errors checked.

Each package's tests call this on its README; the standard library only, like the package.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ReadmeBlock", "readme_blocks", "run_readme_block"]

_BLOCK = re.compile(r"(?:<!-- no-run: (?P<reason>[^>]*) -->\n)?```python\n(?P<code>.*?)```", re.S)
_RUN_TIMEOUT_S = 180  # one example: an import of torch and a tiny computation, on a loaded machine


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadmeBlock:
    """One ```python block of a README."""

    where: str
    """"line N" of the README, where the code starts."""
    code: str
    no_run: str | None
    """Why the block cannot run here (a server, a GPU, a download), or None."""


def readme_blocks(readme: Path) -> list[ReadmeBlock]:
    """The ```python blocks of `readme`, in order."""
    text = readme.read_text(encoding="utf-8")
    return [
        ReadmeBlock(where=f"line {text.count(chr(10), 0, m.start('code'))}", code=m["code"], no_run=m["reason"])
        for m in _BLOCK.finditer(text)
    ]


def run_readme_block(block: ReadmeBlock, workdir: Path) -> None:
    """Run `block` in `workdir`; AssertionError with its output when it fails."""
    doctest = block.code.lstrip().startswith(">>>")
    example = workdir / ("example.txt" if doctest else "example.py")
    example.write_text(block.code, encoding="utf-8")
    command = [sys.executable, "-m", "doctest", str(example)] if doctest else [sys.executable, str(example)]
    result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
    assert result.returncode == 0, f"README {block.where} failed:\n{result.stdout}\n{result.stderr}"
