"""Fingerprints of checkpoint-format weights: one checksum per tensor, bit-exact and position-sensitive.

A tensor's checksum: its raw little-endian bytes, zero-padded to a multiple of 4, read as unsigned
32-bit words w_0 .. w_{n-1}; S = sum_i (i + 1) * w_i mod 2^64; checksum = (S + nbytes * M) mod 2^64
with M an odd constant (the length folded in, so trailing zero bytes count). Integer arithmetic only,
so numpy (`checksum`, `fingerprint`) and torch on any device (`checksum_torch`, `fingerprint_torch`,
from rollouts.sync.fingerprint_torch, which vLLM's workers import too) give the same int: sums of
int64 wrap around mod 2^64 in both.

What it catches for sure, in a tensor under 16 GiB (fewer than 2^32 words): one flipped bit changes
S by +-2^k * (i + 1), nonzero and below 2^64 in magnitude, so never 0 mod 2^64; two unequal words
swapped (w_a at i, w_b at j) change it by (w_a - w_b) * (j - i), both factors nonzero and below 2^32,
so again never 0 mod 2^64. Other corruptions collide with a chance near 2^-64.

Attestation: in a sync the engine reports the checksums of what it received, computed where the
weights live (vLLM's worker, before it loads them; the engine process, of what its model holds);
`check_attestation` compares them with the sender's and raises AttestationError naming every tensor
that differs or was not reported.

Fault injection for tests: ROLLOUTS_SYNC_FAULT="corrupt:<tensor name>" in an engine's environment
makes it flip one bit of that tensor after receiving it (`sync_fault_target`); "file:<path>" reads
that spec from the file at each sync instead (missing or empty: no fault), so a test can turn the
fault on and off in a server that keeps running.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollouts.sync.fingerprint_torch import (
    FAULT_ENV,
    checksum_bytes,
    checksum_torch,
    fingerprint_torch,
    flip_bit_torch,
    sync_fault_target,
)
from rollouts.sync.raw import as_raw, read_safetensors_dir

__all__ = [
    "FAULT_ENV",
    "AttestationError",
    "check_attestation",
    "checksum",
    "checksum_torch",
    "fingerprint",
    "fingerprint_dir",
    "fingerprint_torch",
    "flip_bit_torch",
    "sync_fault_target",
]

_NAMES_SHOWN = 20  # an error lists this many tensor names, then a count


def checksum(value: Any) -> int:
    """The checksum of a numpy array, a RawTensor or a torch tensor (read as bytes here, with numpy)."""
    return checksum_bytes(as_raw(value).data)


def fingerprint(tensors: Mapping[str, Any]) -> dict[str, int]:
    """{name: checksum} of numpy arrays, RawTensors or torch tensors (numpy does the arithmetic)."""
    return {name: checksum(value) for name, value in tensors.items()}


def fingerprint_dir(path: str | Path) -> dict[str, int]:
    """{name: checksum} of every tensor of the *.safetensors files in directory `path`, in their own dtype."""
    return fingerprint(read_safetensors_dir(path))


class AttestationError(RuntimeError):
    """An engine's checksums of the weights it received differ from the sender's: `mismatched` and
    `missing` name the tensors."""

    def __init__(
        self, *, engine: str, weight_version: int, mismatched: tuple[str, ...], missing: tuple[str, ...]
    ) -> None:
        self.engine = engine
        self.weight_version = weight_version
        self.mismatched = mismatched
        """Tensors whose checksum the engine reported differently."""
        self.missing = missing
        """Tensors the engine reported no checksum for."""
        found = (
            [f"{len(mismatched)} tensor(s) differ from what was sent ({_names(mismatched, 3)})"] if mismatched else []
        )
        found += [f"{len(missing)} not reported as loaded ({_names(missing, 3)})"] if missing else []
        more = [f"differ: {_names(mismatched)}"] if len(mismatched) > 3 else []
        more += [f"not reported: {_names(missing)}"] if len(missing) > 3 else []
        # what happened and what to do first, long lists of names last: a screen cuts a long message
        super().__init__(
            f"weight sync attestation failed: engine {engine}, weight version {weight_version}: "
            + " and ".join(found)
            + ". It would generate from weights other than those trained (corrupted in transit or in its memory, or "
            "cast on the way): the version is not claimed and the run stops (engine.attest = false skips this check)."
            + "".join(f" {part}." for part in more)
        )


def _names(names: tuple[str, ...], shown: int = _NAMES_SHOWN) -> str:
    listed = ", ".join(names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def check_attestation(
    expected: Mapping[str, int], reported: Mapping[str, int], *, engine: str, weight_version: int
) -> None:
    """Raise AttestationError unless `reported` has every tensor of `expected` with an equal checksum
    (tensors reported beyond `expected`, e.g. ones a partial update left alone, are not compared)."""
    mismatched = tuple(name for name, value in expected.items() if name in reported and int(reported[name]) != value)
    missing = tuple(name for name in expected if name not in reported)
    if mismatched or missing:
        raise AttestationError(engine=engine, weight_version=weight_version, mismatched=mismatched, missing=missing)
