"""Make the shared test helper (losses_layouts) importable under pytest's importlib mode; without an
NVIDIA GPU, run Triton kernels in triton's CPU interpreter (set before triton's first import)."""

import os
import sys
from pathlib import Path

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
