"""A RolloutBatch as bytes and back, for sending a step's batch to other processes (the loops
broadcast it to every rank) without a per-token step: the per-token arrays and the response texts
travel as their raw bytes, everything else as one small JSON header. Never pickle.

Layout: MAGIC (4 bytes), header length (8 bytes, little-endian), the JSON header, then four
columns: every sample's token ids (int32), then an empty column (the loss weights travel as their
runs in the header), rollout log-probs (float32, of the samples that have them) and UTF-8
responses, each back to back. The header holds the batch's fields and, per sample, its scalar
fields, its loss-mask runs and the sizes of its parts; decoding checks that the
parts add up to the body and validates each column once (the whole-buffer checks of
rollouts.types.arrays), so a sample's arrays are views into the received bytes.
"""

from __future__ import annotations

import json
from typing import Any

from rollouts.types.arrays import LogProbs, LossMask, TokenIds
from rollouts.types.frozen import thaw
from rollouts.types.samples import RolloutBatch, Sample

__all__ = ["batch_from_bytes", "batch_to_bytes", "batch_to_parts"]

MAGIC = b"RB02"  # RB01 carried float32 loss weights and float64 log-probs as columns
_SCALARS = ("num_prompt_tokens", "reward", "advantage", "group_index", "index", "weight_version")


def batch_to_bytes(batch: RolloutBatch) -> bytes:
    """The batch as bytes; `batch_from_bytes` gives back an equal batch."""
    return b"".join(batch_to_parts(batch))


def batch_to_parts(batch: RolloutBatch) -> list[bytes | memoryview]:
    """The pieces whose concatenation is `batch_to_bytes(batch)`, without the concatenation: the
    samples' arrays as views of their own bytes, so a sender copies each byte once, straight into
    whatever buffer it sends (rollouts.loops writes them into the tensor it broadcasts)."""
    samples: list[dict[str, Any]] = []
    columns: tuple[list[Any], ...] = ([], [], [], [])  # tokens, (loss weights: in the header), log-probs, texts
    for s in batch.samples:
        response = s.response.encode("utf-8")
        samples.append(
            {
                **{k: getattr(s, k) for k in _SCALARS},
                "prompt": thaw(s.prompt),
                "metadata": thaw(s.metadata),
                "status": s.status.value,
                "sizes": [len(s.tokens), s.rollout_logprobs is not None, len(response)],
                "mask_runs": [list(run) for run in s.loss_mask.runs],
            }
        )
        columns[0].append(s.tokens.buffer)
        if s.rollout_logprobs is not None:
            columns[2].append(s.rollout_logprobs.buffer)
        columns[3].append(response)
    header = {
        "epoch": batch.epoch,
        "step": batch.step,
        "num_filtered": batch.num_filtered,
        "num_failed": batch.num_failed,
        "num_carried_over": batch.num_carried_over,
        "filter_reasons": thaw(batch.filter_reasons),
        "metadata": thaw(batch.metadata),
        "samples": samples,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return [MAGIC, len(head).to_bytes(8, "little"), head, *columns[0], *columns[1], *columns[2], *columns[3]]


def batch_from_bytes(data: bytes | bytearray | memoryview) -> RolloutBatch:
    """The RolloutBatch `batch_to_bytes` wrote; ValueError naming what is wrong for anything else.

    From `bytes` (or a read-only view of bytes) the samples' arrays are views into `data`, not
    copies: the batch keeps `data` alive."""
    view = memoryview(data).cast("B")
    if not (view.readonly and isinstance(view.obj, bytes)):
        view = memoryview(view.tobytes())  # views must not see later changes to a mutable buffer
    if bytes(view[:4]) != MAGIC:
        raise ValueError(f"not a rollouts batch: starts with {bytes(view[:4])!r}, expected {MAGIC!r}")
    size = int.from_bytes(view[4:12], "little")
    if 12 + size > len(view):
        raise ValueError(f"rollouts batch cut short: a {size}-byte header in {len(view)} bytes")
    header = json.loads(bytes(view[12 : 12 + size]))
    records = header.pop("samples")
    sizes = [r.pop("sizes") for r in records]
    widths = [
        [4 * n for n, _, _ in sizes],
        [0 for _ in sizes],  # loss weights travel as runs in the header
        [4 * (n - r["num_prompt_tokens"]) for (n, has, _), r in zip(sizes, records, strict=True) if has],
        [nbytes for _, _, nbytes in sizes],
    ]
    offset, columns = 12 + size, []
    for kind, column in zip(("tokens", "loss weights", "log-probs", "responses"), widths, strict=True):
        end = offset + sum(column)
        if end > len(view):
            raise ValueError(f"rollouts batch cut short in its {kind}: {end} bytes needed, {len(view)} given")
        columns.append(view[offset:end])
        offset = end
    if offset != len(view):
        raise ValueError(f"rollouts batch has {len(view) - offset} bytes after its last sample")
    # Each array column is checked once, whole; a sample's arrays are views of it (same package:
    # the columns' checks cover every slice, so the slices are made without checking again).
    TokenIds.from_bytes(columns[0], what="batch tokens", share=True)
    LogProbs.from_bytes(columns[2], what="batch log-probs", share=True)
    starts = [0, 0, 0, 0]
    samples = []
    for (num_tokens, has_logprobs, response_bytes), record in zip(sizes, records, strict=True):
        ends = [
            starts[0] + 4 * num_tokens,
            starts[1],
            starts[2] + (4 * (num_tokens - record["num_prompt_tokens"]) if has_logprobs else 0),
            starts[3] + response_bytes,
        ]
        part = [columns[c][starts[c] : ends[c]] for c in range(4)]
        mask = LossMask.from_runs(num_tokens, record.pop("mask_runs"), what="batch loss weights")
        samples.append(
            Sample(
                **record,
                tokens=TokenIds._trusted(part[0]),
                loss_mask=mask,
                rollout_logprobs=LogProbs._trusted(part[2]) if has_logprobs else None,
                response=bytes(part[3]).decode("utf-8"),
            )
        )
        starts = ends
    fields: dict[str, Any] = header
    return RolloutBatch(samples=tuple(samples), **fields)
