"""Verified weight delivery: after a sync, a probe asks the engine for a few greedy tokens of a
fixed prompt and compares the log-probs it reports with the trainer's on the new weights. A sync
that silently did not apply (the engine still serving old weights) shows as a difference and fails
the step, naming the engine, instead of going unnoticed while training drifts off-policy.

The probe runs on every rank (under torchrun the trainer's log-probs are a collective): rank 0
generates and broadcasts the probe sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import trio

from rollouts.backends import TrainingComponents, compute_logprobs
from rollouts.data import pack_samples
from rollouts.loops.run.distributed import broadcast_json, rank_world
from rollouts.types import InferenceEngine, Sample, SamplingParams

__all__ = ["SyncProbeError", "probe_sync"]


class SyncProbeError(RuntimeError):
    """The engine's log-probs after a sync differ from the trainer's on the synced weights."""


async def probe_sync(
    components: TrainingComponents,
    engine: InferenceEngine | None,
    prompt: Sequence[int],
    *,
    num_tokens: int,
    tolerance: float,
    weight_version: int,
) -> dict[str, float]:
    """Greedy `num_tokens` from the engine for `prompt`; raise SyncProbeError when the mean |engine -
    trainer| log-prob over them exceeds `tolerance`. Returns {"sync_probe_logprob_diff": ...}."""
    if num_tokens < 1 or not tolerance > 0:
        raise ValueError(f"num_tokens must be >= 1 and tolerance > 0, got {num_tokens}, {tolerance}")
    rank, _ = rank_world()
    payload = None
    if rank == 0:
        assert engine is not None
        params = SamplingParams(max_new_tokens=num_tokens, temperature=0.0, logprobs=True)
        (sample,) = await engine.generate([list(prompt)], params)
        if sample.rollout_logprobs is None:
            raise SyncProbeError(f"engine {engine.name} returned no log-probs for the sync probe")
        payload = {"sample": sample.to_dict(), "engine": engine.name}
    payload = await trio.to_thread.run_sync(broadcast_json, payload)
    sample = Sample.from_dict(payload["sample"])
    if sample.response_length == 0:
        return {"sync_probe_logprob_diff": 0.0}
    budget = len(sample.tokens) + 1
    (trainer_B_T,) = await trio.to_thread.run_sync(
        lambda: compute_logprobs(components, pack_samples([sample], max_tokens=budget))
    )
    trainer = trainer_B_T[0, sample.num_prompt_tokens : len(sample.tokens)]
    engine_lp = np.asarray(sample.rollout_logprobs, dtype=np.float64)
    diff = float(np.mean(np.abs(trainer.astype(np.float64) - engine_lp)))
    if diff > tolerance:
        raise SyncProbeError(
            f"after syncing weight version {weight_version}, engine {payload['engine']} reports log-probs "
            f"{diff:.3g} away from the trainer's on those weights (mean over {sample.response_length} greedy "
            f"tokens; rl.sync_probe_tolerance = {tolerance}): the sync did not apply, or the engine serves "
            "another model or precision"
        )
    return {"sync_probe_logprob_diff": diff}
