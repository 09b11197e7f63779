"""Tensors as raw bytes in their own dtype, and the safetensors container written and read without torch.

numpy has no bfloat16, so a numpy array cannot carry a bf16 weight; a `RawTensor` can: its safetensors
dtype name ("BF16", "F16", "F32", ...), its shape and its little-endian bytes. `as_raw` takes a numpy
array, a torch tensor of any dtype (found by duck typing: this module never imports torch; a torch
tensor means torch is loaded already) or a RawTensor. `encode_safetensors` writes the safetensors
format (an 8-byte little-endian header length, the JSON header with each tensor's dtype, shape and
byte offsets, then the bytes), so what any safetensors reader loads is bit-identical to what was given.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DTYPE_BYTES",
    "TORCH_NAMES",
    "RawTensor",
    "as_raw",
    "bfloat16",
    "decode_safetensors",
    "encode_safetensors",
    "read_safetensors_dir",
    "safetensors_header",
]

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
"""Bytes per element of each safetensors dtype name."""
_NUMPY_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
}
TORCH_NAMES = {  # the safetensors name of each torch dtype
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.int16": "I16",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int32": "I32",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.float64": "F64",
}
# The numpy dtype each safetensors dtype is viewed as (its bit pattern where numpy has no such type).
_VIEW_DTYPES = {
    "BOOL": np.dtype(bool),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F64": np.dtype("<f8"),
}
_ALIGN = 8  # the header is padded with spaces so the tensor bytes start 8-byte aligned
_MAX_HEADER_BYTES = 100 * 1024**2  # safetensors' own bound: a larger header means a corrupt file


@dataclass(frozen=True, slots=True, kw_only=True)
class RawTensor:
    """One tensor as its safetensors dtype name, its shape and its raw bytes."""

    dtype: str
    """Safetensors dtype name: "BF16", "F16", "F32", "I64", ... (a key of DTYPE_BYTES)."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    data: np.ndarray
    """[nbytes] uint8, C-contiguous: the elements' little-endian bytes in row-major order."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"RawTensor.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"RawTensor.shape must be ints >= 0, got {self.shape!r}")
        if not (isinstance(self.data, np.ndarray) and self.data.dtype == np.uint8 and self.data.ndim == 1):
            raise TypeError("RawTensor.data must be a 1-D uint8 numpy array")
        expected = math.prod(self.shape) * DTYPE_BYTES[self.dtype]
        if self.data.nbytes != expected:
            raise ValueError(
                f"RawTensor of dtype {self.dtype} and shape {self.shape} takes {expected} bytes, data has {self.data.nbytes}"
            )

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def view(self) -> np.ndarray:
        """The elements as a numpy array of `shape` (16-bit floats numpy lacks, e.g. BF16, as their
        uint16 bit patterns; a view, no copy)."""
        return self.data.view(_VIEW_DTYPES[self.dtype]).reshape(self.shape)


def bfloat16(values: np.ndarray) -> RawTensor:
    """float32 `values` rounded to bfloat16 (to nearest, ties to even: torch's `.to(torch.bfloat16)`)."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")  # uint64: no overflow on the add
    return RawTensor(
        dtype="BF16", shape=tuple(int(d) for d in np.shape(values)), data=rounded.reshape(-1).view(np.uint8)
    )


def as_raw(value: Any, *, name: str = "tensor") -> RawTensor:
    """`value` (a numpy array, a torch tensor of any dtype or device, or a RawTensor) as a RawTensor;
    a copy only where the value is not contiguous little-endian host memory already."""
    if isinstance(value, RawTensor):
        return value
    if isinstance(value, np.ndarray):
        kind = _NUMPY_NAMES.get(value.dtype.name)
        if kind is None:
            raise TypeError(f"{name}: numpy dtype {value.dtype} has no safetensors name; takes {sorted(_NUMPY_NAMES)}")
        array = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        return RawTensor(dtype=kind, shape=tuple(int(d) for d in value.shape), data=array.reshape(-1).view(np.uint8))
    if type(value).__module__.startswith("torch") and "torch" in sys.modules:
        return _torch_raw(value, name=name)
    raise TypeError(f"{name} must be a numpy array, a torch tensor or a RawTensor, got {type(value).__name__}")


def _torch_raw(tensor: Any, *, name: str) -> RawTensor:
    torch = sys.modules["torch"]  # loaded already: `tensor` is one of its tensors
    kind = TORCH_NAMES.get(str(tensor.dtype))
    if kind is None:
        raise TypeError(f"{name}: torch dtype {tensor.dtype} has no safetensors name; takes {sorted(TORCH_NAMES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return RawTensor(dtype=kind, shape=tuple(int(d) for d in tensor.shape), data=flat.view(torch.uint8).numpy())


def safetensors_header(tensors: Mapping[str, RawTensor], *, metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes a safetensors container of `tensors` (in their order) starts with: the header's length
    and the header; each tensor's `data` follows, back to back, in the same order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        header[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % _ALIGN)
    return len(head).to_bytes(8, "little") + head


def encode_safetensors(tensors: Mapping[str, RawTensor], *, metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes of `tensors` (in their order), with `metadata` in the header."""
    return b"".join([safetensors_header(tensors, metadata=metadata), *(t.data.data for t in tensors.values())])


def decode_safetensors(data: bytes | bytearray | memoryview | np.ndarray) -> dict[str, RawTensor]:
    """The tensors of safetensors bytes `data`, as views of it (no copy); ValueError naming what is
    wrong for bytes that are not a well-formed safetensors container."""
    buffer = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    if buffer.nbytes < 8:
        raise ValueError(f"safetensors data of {buffer.nbytes} bytes: shorter than its 8-byte header length")
    head_bytes = int.from_bytes(buffer[:8].tobytes(), "little")
    if head_bytes > min(_MAX_HEADER_BYTES, buffer.nbytes - 8):
        raise ValueError(f"safetensors header length {head_bytes} exceeds the {buffer.nbytes}-byte data")
    header = json.loads(buffer[8 : 8 + head_bytes].tobytes())
    body = buffer[8 + head_bytes :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = (int(x) for x in entry["data_offsets"])
        if not 0 <= start <= end <= body.nbytes:
            raise ValueError(f"safetensors tensor {name!r} spans bytes {start}..{end} of a {body.nbytes}-byte body")
        out[name] = RawTensor(dtype=entry["dtype"], shape=tuple(entry["shape"]), data=body[start:end])
    return out


def read_safetensors_dir(path: str | Path) -> dict[str, RawTensor]:
    """Every tensor of the *.safetensors files in directory `path`, in their own dtype, memory-mapped
    (read as they are used)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors file")
    out: dict[str, RawTensor] = {}
    for file in files:
        out.update(decode_safetensors(np.memmap(file, dtype=np.uint8, mode="r")))
    return out
