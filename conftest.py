"""Session-wide test setup, loaded before any test module is collected.

Triton kernels run in triton's CPU interpreter where the machine has no NVIDIA GPU: TRITON_INTERPRET
is read when triton is first imported, and collecting a module that uses torch.compile or
FlexAttention may import it long before rollouts-losses' Triton tests run.
"""

import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
