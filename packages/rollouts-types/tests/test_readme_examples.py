"""Every ```python block of this package's README runs as written, in a subprocess of this
interpreter (CI runs these tests in an environment holding only this package and what it
declares). A block right after `<!-- no-run: reason -->` is skipped with that reason; a block of
`>>>` lines runs as a doctest, its printed errors checked."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"(?:<!-- no-run: (?P<reason>[^>]*) -->\n)?```python\n(?P<code>.*?)```", re.S)
_RUN_TIMEOUT_S = 180
_TEXT = README.read_text(encoding="utf-8")
BLOCKS = {f"line {_TEXT.count(chr(10), 0, m.start('code'))}": m for m in _BLOCK.finditer(_TEXT)}


@pytest.mark.parametrize("where", list(BLOCKS))
def test_readme_example_runs(where, tmp_path):
    block = BLOCKS[where]
    if block["reason"]:
        pytest.skip(f"README {where}: {block['reason']}")
    doctest = block["code"].lstrip().startswith(">>>")
    example = tmp_path / ("example.txt" if doctest else "example.py")
    example.write_text(block["code"], encoding="utf-8")
    command = [sys.executable, "-m", "doctest", str(example)] if doctest else [sys.executable, str(example)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
    assert result.returncode == 0, f"README {where} failed:\n{result.stdout}\n{result.stderr}"
