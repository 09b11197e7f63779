"""Every ```python block of this package's README runs as written (rollouts.types.readme_examples);
CI runs these tests in an environment holding only this package and what it declares."""

from pathlib import Path

import pytest

from rollouts.types.readme_examples import readme_blocks, run_readme_block

BLOCKS = {b.where: b for b in readme_blocks(Path(__file__).resolve().parents[1] / "README.md")}


@pytest.mark.parametrize("where", list(BLOCKS))
def test_readme_example_runs(where, tmp_path):
    if BLOCKS[where].no_run:
        pytest.skip(f"README {where}: {BLOCKS[where].no_run}")
    run_readme_block(BLOCKS[where], tmp_path)
