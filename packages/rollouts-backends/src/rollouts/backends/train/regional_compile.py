"""Regional compilation: each decoder layer compiled on its own with `torch.compile`.

A layer's RMSNorms, rotary embedding, SiLU gate and residual adds are many small kernels in eager
mode; compiled, they fuse into a few, and a GPU step that is bound by the host's launches gets
shorter. Compiling the repeated layer instead of the whole model keeps the compile time to about
one layer's (every layer runs the same code on its own weights) and leaves the embedding, the
output layer and the log-probs, which run once per forward, as they are.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rollouts.backends.train.distributed import transformer_blocks

__all__ = ["CompileMode", "compile_layers"]

CompileMode = Literal["none", "layers"]
"""`none`: eager. `layers`: each decoder layer compiled (`compile_layers`)."""


def compile_layers(model: torch.nn.Module, mode: CompileMode = "layers") -> torch.nn.Module:
    """Compile each of the model's decoder layers in place (`Module.compile`); returns the model.

    The layers compile on their first forward (the first step pays for it); a new input shape or
    mask kind compiles once more. Apply it before FSDP2's `shard_model`, so each sharded unit wraps
    a compiled layer.
    """
    if mode not in get_args(CompileMode):
        raise ValueError(f"compile mode must be one of {get_args(CompileMode)}, got {mode!r}")
    if mode == "none":
        return model
    for block in transformer_blocks(model):
        block.compile()
    return model
