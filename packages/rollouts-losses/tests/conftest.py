"""Make the shared test helper (losses_layouts) importable under pytest's importlib mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
