import sys
from pathlib import Path

# Top-level tests import their helpers (layering.py, ...) from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
