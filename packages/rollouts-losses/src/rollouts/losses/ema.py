"""An exponential moving average of parameters that keeps its small updates in bf16 and fp16.

    average <- decay * average + (1 - decay) * value

With decay 0.99 each update moves a parameter by 1% of its gap to the value. In bf16 (8 significant
bits) half a unit in the last place is 2^-9 to 2^-8 of the parameter, so the step rounds away
whenever the gap is under 20-40% of the parameter: a bf16 average updated in place keeps only part
of the true average's movement, and the part shrinks as the policy's steps get smaller. Here the average
lives in float32 when the parameters are narrower (an accumulator per tensor, 4 bytes a parameter),
and the parameters get the accumulator rounded to their dtype after every update, so they are
within half a bf16 unit of the exact average. Float32 and float64 parameters are their own
accumulators: no copy.

Usage, with `reference` and `policy` two name -> tensor mappings of one model's parameters:

    accumulators = ema_accumulators(reference)        # once, when the average starts
    ema_update_(reference, accumulators, policy, decay=0.99)   # after every optimizer step

A resumed run continues exactly only if the accumulators are saved and loaded with the rest of its
state (rebuilding them from bf16 parameters starts them up to half a unit away).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["EMA_ACCUMULATOR_DTYPE", "ema_accumulators", "ema_update_"]

EMA_ACCUMULATOR_DTYPE = torch.float32
"""The least precision an average accumulates in: float32's 24 significant bits round a 1% step
away only for a gap under about 6e-6 of the parameter (bf16's: 0.2)."""


def _needs_accumulator(t: Tensor) -> bool:
    """Floating tensors narrower than float32 (bf16, fp16) round a small update away."""
    return t.is_floating_point() and torch.finfo(t.dtype).bits < torch.finfo(EMA_ACCUMULATOR_DTYPE).bits


def ema_accumulators(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """name -> the tensor an average of `params` accumulates in: a float32 copy of each bf16 / fp16
    tensor (detached), the tensor itself otherwise (then updated in place)."""
    return {
        name: t.detach().to(EMA_ACCUMULATOR_DTYPE, copy=True) if _needs_accumulator(t) else t
        for name, t in params.items()
    }


@torch.no_grad()
def ema_update_(
    params: Mapping[str, Tensor], accumulators: Mapping[str, Tensor], values: Mapping[str, Tensor], *, decay: float
) -> None:
    """One update, in place: each accumulator <- decay * accumulator + (1 - decay) * value, in the
    accumulator's precision; then each parameter <- its accumulator, rounded to the parameter's dtype."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"decay must be in (0, 1) (the weight kept by the average), got {decay!r}")
    if not (params.keys() == accumulators.keys() == values.keys()):
        differ = sorted((params.keys() | values.keys()) - (params.keys() & accumulators.keys() & values.keys()))
        raise ValueError(f"params, accumulators and values must name the same tensors; these differ: {differ[:5]}")
    for name, param in params.items():
        accumulator = accumulators[name]
        accumulator.lerp_(values[name].detach().to(accumulator.dtype), 1.0 - decay)
        if accumulator is not param:
            param.copy_(accumulator)
