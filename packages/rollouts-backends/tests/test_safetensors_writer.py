"""The streaming safetensors writer of checkpoints and exports (rollouts.backends.checkpoint.durable.write_tensors)
writes files safetensors' own reader loads bit for bit."""

from __future__ import annotations

import json
import zlib

import pytest
import safetensors
import safetensors.torch
import torch

from rollouts.backends.checkpoint import durable

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.int8, torch.bool, torch.float64]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (5, 3), (2, 3, 4)]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    return torch.randint(-(2**7), 2**7 - 1, shape, generator=gen).to(dtype)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor (bitwise comparison, NaN-safe)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _header(raw: bytes) -> tuple[dict, list[str]]:
    """A safetensors file's JSON header and its tensor names in data order."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    return header, names


def _check_roundtrip(tmp_path, tensors, metadata, *, chunk_bytes=durable.WRITE_CHUNK_BYTES):
    path = tmp_path / "streamed.safetensors"
    record = durable.write_tensors(path, tensors, metadata, chunk_bytes=chunk_bytes)
    raw = path.read_bytes()
    assert record == {"bytes": len(raw), "crc32": zlib.crc32(raw)}
    header_len = int.from_bytes(raw[:8], "little")
    assert header_len % 8 == 0
    _, order = _header(raw)  # streamed, not safetensors' own writer: widest dtype first, then by name
    assert order == sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    loaded = safetensors.torch.load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(_raw(got), _raw(tensor))
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert (f.metadata() or {}) == dict(metadata)
    # Same tensors as safetensors' own writer produces.
    reference = tmp_path / "reference.safetensors"
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(reference), metadata=dict(metadata) or None
    )
    expected = safetensors.torch.load_file(str(reference))
    for name in tensors:
        assert expected[name].dtype == loaded[name].dtype and expected[name].shape == loaded[name].shape
        if loaded[name].numel():
            assert torch.equal(_raw(expected[name]), _raw(loaded[name]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stream_matches_safetensors_per_dtype(tmp_path, dtype):
    tensors = {f"t{i}": _tensor(dtype, shape, i) for i, shape in enumerate(SHAPES)}
    _check_roundtrip(tmp_path, tensors, {"format": "pt"})


def test_stream_mixed_dtypes_noncontiguous_and_chunks(tmp_path):
    tensors = {
        "a.weight": _tensor(torch.float32, (13, 17), 0),
        "b.bias": _tensor(torch.bfloat16, (31,), 1),
        "c.steps": _tensor(torch.int64, (), 2),
        "d.empty": _tensor(torch.float32, (0, 4), 3),
        "e.transposed": _tensor(torch.float32, (6, 5), 4).t(),
        "f.flags": _tensor(torch.bool, (9,), 5),
    }
    _check_roundtrip(tmp_path, tensors, {"format": "pt", "note": "ünïcode"}, chunk_bytes=40)  # chunks mid-tensor
    _check_roundtrip(tmp_path, tensors, {}, chunk_bytes=40)


def test_stream_empty_dict(tmp_path):
    _check_roundtrip(tmp_path, {}, {})


def test_header_is_valid_json_with_contiguous_offsets(tmp_path):
    tensors = {
        "x": torch.zeros(3, dtype=torch.bfloat16),
        "y": torch.zeros(2, dtype=torch.float64),
        "z": torch.zeros(()),
    }
    durable.write_tensors(tmp_path / "h.safetensors", tensors, {"format": "pt"})
    parsed, order = _header((tmp_path / "h.safetensors").read_bytes())
    assert parsed["__metadata__"] == {"format": "pt"}
    offsets = [parsed[name]["data_offsets"] for name in order]
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:], strict=False))
    assert order == ["y", "z", "x"]  # wider dtypes first keeps every tensor aligned to its element size


def test_write_tensors_falls_back_for_shared_storage(tmp_path):
    base = torch.arange(8, dtype=torch.float32)
    with pytest.raises(RuntimeError):
        durable.write_tensors(tmp_path / "s.safetensors", {"a": base, "b": base[:4]}, {})


def test_sync_file_range_missing_is_harmless(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "_sync_file_range", None)  # as on a file system or OS without it
    _check_roundtrip(tmp_path, {"w": _tensor(torch.float32, (4, 4), 0)}, {"format": "pt"})


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    st = None

if st is not None:

    @settings(max_examples=40, deadline=None)
    @given(
        st.dictionaries(
            st.text(alphabet="abcxyz._0123456789", min_size=1, max_size=8),
            st.tuples(
                st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]),
                st.lists(st.integers(0, 4), max_size=3),
                st.integers(0, 2**16),
            ),
            max_size=6,
        ),
        st.integers(1, 64),
    )
    def test_stream_roundtrip_property(tmp_path_factory, spec, chunk):
        tmp_path = tmp_path_factory.mktemp("prop")
        tensors = {name: _tensor(dtype, tuple(shape), seed) for name, (dtype, shape, seed) in spec.items()}
        _check_roundtrip(tmp_path, tensors, {"format": "pt"}, chunk_bytes=chunk)
