"""A RolloutBatch as bytes and back, for sending a step's batch to other processes (the loops
broadcast it to every rank; an engine process answers with it) without a per-token step: the
per-token arrays and the response texts travel as their raw bytes, everything else as one small
JSON header. Never pickle.

Layout: MAGIC (4 bytes), header length (8 bytes, little-endian), the JSON header, then three
columns: every sample's token ids (int32), then the rollout log-probs (float32) of the samples that
have them, then the responses (UTF-8), each back to back. The header holds the batch's fields and
the samples' fields column by column (one list per field, not one object per sample): their
scalars, loss-mask runs, token counts and response lengths (in characters), and for prompts and
metadata an index into a table of distinct JSON texts (a group's samples share one prompt; an
engine's samples often share one metadata). Decoding checks each column once, whole (the
whole-buffer checks of rollouts.types.arrays; one pass over each scalar column; each distinct
prompt and metadata once) and then builds the Samples without checking them again, so a sample's
arrays are views into the received bytes and decoding costs a few microseconds per sample.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from rollouts.types.arrays import LogProbs, LossMask, TokenIds
from rollouts.types.frozen import freeze, thaw
from rollouts.types.samples import _FIELDS, RolloutBatch, Status, _build_checked

__all__ = ["batch_from_bytes", "batch_to_bytes", "batch_to_parts"]

MAGIC = b"RB03"  # RB02: one header object per sample and a loss-weights column; RB01: float64 log-probs
_COUNTS = ("num_prompt_tokens", "num_tokens", "response_chars")
_FLOATS = ("reward", "advantage")
_INDICES = ("group_index", "index", "weight_version")
_STATUS = {s.value: s for s in Status}
_BUILD_ORDER = (
    "prompt", "response", "tokens", "num_prompt_tokens", "loss_mask", "reward", "advantage", "group_index", "index",
    "rollout_logprobs", "weight_version", "metadata", "status",
)  # fmt: skip
if _FIELDS != _BUILD_ORDER:  # batch_from_bytes passes the fields by position
    raise ImportError(f"rollouts.types.wire builds Samples with fields {_BUILD_ORDER}, Sample has {_FIELDS}")


def batch_to_bytes(batch: RolloutBatch) -> bytes:
    """The batch as bytes; `batch_from_bytes` gives back an equal batch."""
    return b"".join(batch_to_parts(batch))


def batch_to_parts(batch: RolloutBatch) -> list[bytes | memoryview]:
    """The pieces whose concatenation is `batch_to_bytes(batch)`, without the concatenation: the
    samples' arrays as views of their own bytes, so a sender copies each byte once, straight into
    whatever buffer it sends (rollouts.loops writes them into the tensor it broadcasts)."""
    samples = batch.samples
    table: list[str] = []
    by_text: dict[str, int] = {}
    by_id: dict[int, int] = {}  # the samples hold every value, so no id is reused during the call

    def ref(value: Any) -> int:
        i = by_id.get(id(value))
        if i is None:
            text = json.dumps(thaw(value), separators=(",", ":"))
            i = by_text.setdefault(text, len(table))
            if i == len(table):
                table.append(text)
            by_id[id(value)] = i
        return i

    columns = {
        "prompt": [ref(s.prompt) for s in samples],
        "metadata": [ref(s.metadata) for s in samples],
        **{name: [getattr(s, name) for s in samples] for name in ("num_prompt_tokens", *_FLOATS, *_INDICES)},
        "status": [s.status.value for s in samples],
        "num_tokens": [len(s.tokens) for s in samples],
        "has_logprobs": [s.rollout_logprobs is not None for s in samples],
        "response_chars": [len(s.response) for s in samples],
        "mask_runs": [s.loss_mask.runs for s in samples],
    }
    header = {
        "epoch": batch.epoch,
        "step": batch.step,
        "num_filtered": batch.num_filtered,
        "num_failed": batch.num_failed,
        "num_carried_over": batch.num_carried_over,
        "filter_reasons": thaw(batch.filter_reasons),
        "metadata": thaw(batch.metadata),
        "num_samples": len(samples),
        "values": table,
        "columns": columns,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return [
        MAGIC,
        len(head).to_bytes(8, "little"),
        head,
        *(s.tokens.buffer for s in samples),
        *(s.rollout_logprobs.buffer for s in samples if s.rollout_logprobs is not None),
        "".join(s.response for s in samples).encode("utf-8"),
    ]


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
    try:
        header = json.loads(bytes(view[12 : 12 + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"rollouts batch header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"rollouts batch header must be a JSON object, got {type(header).__name__}")
    n = header.pop("num_samples", None)
    if type(n) is not int or n < 0:
        raise ValueError(f"rollouts batch header: num_samples must be a non-negative int, got {n!r}")
    columns = _columns(header.pop("columns", None), n)
    prompts, metadatas = _table(header.pop("values", None), columns)
    num_tokens, num_prompt = columns["num_tokens"], columns["num_prompt_tokens"]
    response_tokens = [t - p for t, p in zip(num_tokens, num_prompt, strict=True)]
    i = next((i for i, r in enumerate(response_tokens) if r < 0), None)
    if i is not None:
        raise ValueError(f"rollouts batch sample {i}: num_prompt_tokens {num_prompt[i]} > its {num_tokens[i]} tokens")

    offset, parts = 12 + size, []
    token_bytes = 4 * sum(num_tokens)
    logprob_bytes = 4 * sum(r for r, has in zip(response_tokens, columns["has_logprobs"], strict=True) if has)
    for kind, nbytes in (("tokens", token_bytes), ("log-probs", logprob_bytes)):
        if offset + nbytes > len(view):
            raise ValueError(
                f"rollouts batch cut short in its {kind}: {offset + nbytes} bytes needed, {len(view)} given"
            )
        parts.append(view[offset : offset + nbytes])
        offset += nbytes
    try:
        text = bytes(view[offset:]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"rollouts batch cut short or damaged in its responses (not UTF-8): {e}") from e
    chars_counted = sum(columns["response_chars"])
    if len(text) != chars_counted:
        verdict = "cut short in its responses" if len(text) < chars_counted else "has bytes after its last sample"
        raise ValueError(
            f"rollouts batch {verdict}: {len(text)} characters of responses, the header counts {chars_counted}"
        )
    # Each array column is checked once, whole; a sample's arrays are views of it (same package:
    # the columns' checks cover every slice, so the slices are made without checking again).
    TokenIds.from_bytes(parts[0], what="batch tokens", share=True)
    LogProbs.from_bytes(parts[1], what="batch log-probs", share=True)
    tokens_column, logprobs_column = parts
    masks: dict[tuple[Any, ...], LossMask] = {}  # most samples share one of a few masks
    samples = []
    t = lp = c = 0
    token_ids, logprobs = TokenIds._trusted, LogProbs._trusted
    for i in range(n):
        length, response_length, chars = num_tokens[i], response_tokens[i], columns["response_chars"][i]
        runs = columns["mask_runs"][i]
        key = (length, *map(tuple, runs))
        mask = masks.get(key)
        if mask is None:
            mask = masks[key] = LossMask.from_runs(length, runs, what=f"rollouts batch sample {i}: loss-mask runs")
        if columns["has_logprobs"][i]:
            sample_logprobs: LogProbs | None = logprobs(logprobs_column[lp : lp + 4 * response_length])
            lp += 4 * response_length
        else:
            sample_logprobs = None
        samples.append(
            _build_checked(
                prompts[i],
                text[c : c + chars],
                token_ids(tokens_column[t : t + 4 * length]),
                num_prompt[i],
                mask,
                columns["reward"][i],
                columns["advantage"][i],
                columns["group_index"][i],
                columns["index"][i],
                sample_logprobs,
                columns["weight_version"][i],
                metadatas[i],
                columns["status"][i],
            )
        )
        t += 4 * length
        c += chars
    return RolloutBatch(samples=tuple(samples), **header)


def _columns(columns: Any, n: int) -> dict[str, list[Any]]:
    """The header's sample columns, each checked whole as Sample's checks would check its values
    (floats as floats, statuses as Status); ValueError naming the column and the first bad value."""
    if not isinstance(columns, dict) or set(columns) != set(_RULES):
        got = sorted(columns) if isinstance(columns, dict) else type(columns).__name__
        raise ValueError(f"rollouts batch header: columns must be an object with {sorted(_RULES)}, got {got}")
    for name in _RULES:
        column = columns[name]
        if not isinstance(column, list) or len(column) != n:
            raise ValueError(f"rollouts batch header: column {name} must be a list of {n} values")

    for name, rule in _RULES.items():
        check = _CHECKS[rule]
        if not all(map(check, columns[name])):
            bad = next(v for v in columns[name] if not check(v))
            raise ValueError(f"rollouts batch column {name}: {bad!r} is not {rule}")
    for name in _FLOATS:
        columns[name] = [None if v is None else float(v) for v in columns[name]]
    columns["status"] = [_STATUS[v] for v in columns["status"]]
    return columns


_CHECKS: dict[str, Callable[[Any], bool]] = {
    "a non-negative int": lambda v: type(v) is int and v >= 0,
    "a non-negative int or null": lambda v: v is None or type(v) is int and v >= 0,
    "a finite number or null": lambda v: v is None or type(v) in (int, float) and math.isfinite(v),
    "a bool": lambda v: type(v) is bool,
    "a status": lambda v: isinstance(v, str) and v in _STATUS,
    "a list of [start, stop, weight] runs": lambda v: isinstance(v, list) and all(map(_is_run, v)),
}


def _is_run(run: Any) -> bool:
    """[int, int, number]: what LossMask.from_runs takes (it checks order, bounds and the weight)."""
    return (
        type(run) is list
        and len(run) == 3
        and type(run[0]) is int
        and type(run[1]) is int
        and type(run[2]) in (int, float)
    )


_RULES = {
    **dict.fromkeys(("prompt", "metadata", *_COUNTS), "a non-negative int"),
    **dict.fromkeys(_INDICES, "a non-negative int or null"),
    **dict.fromkeys(_FLOATS, "a finite number or null"),
    "has_logprobs": "a bool",
    "status": "a status",
    "mask_runs": "a list of [start, stop, weight] runs",
}
"""Each sample column's rule (a key of _CHECKS)."""


def _table(values: Any, columns: dict[str, list[Any]]) -> tuple[list[Any], list[Any]]:
    """Each sample's frozen prompt and metadata, from the header's table of distinct JSON texts;
    each distinct entry parsed, checked (a prompt is text or a list of message objects; metadata
    is an object) and frozen once."""
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError("rollouts batch header: values must be a list of JSON texts")
    parsed: dict[int, Any] = {}

    def entry(i: int, what: str) -> Any:
        if i >= len(values):
            raise ValueError(f"rollouts batch column {what}: index {i} past the {len(values)} values")
        if i not in parsed:
            try:
                parsed[i] = json.loads(values[i])
            except json.JSONDecodeError as e:
                raise ValueError(f"rollouts batch value {i} is not JSON: {e}") from e
        return parsed[i]

    frozen_prompts: dict[int, Any] = {}
    for i in dict.fromkeys(columns["prompt"]):
        prompt = entry(i, "prompt")
        if not (isinstance(prompt, str) or isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            raise ValueError(f"rollouts batch: a prompt must be text or a list of message objects, got {prompt!r:.80}")
        frozen_prompts[i] = freeze(prompt)
    frozen_metadata: dict[int, Mapping[str, Any]] = {}
    for i in dict.fromkeys(columns["metadata"]):
        metadata = entry(i, "metadata")
        if not isinstance(metadata, dict):
            raise ValueError(f"rollouts batch: a sample's metadata must be an object, got {metadata!r:.80}")
        frozen_metadata[i] = freeze(metadata)
    return [frozen_prompts[i] for i in columns["prompt"]], [frozen_metadata[i] for i in columns["metadata"]]
