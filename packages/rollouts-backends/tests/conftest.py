import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch

torch.set_num_threads(1)
