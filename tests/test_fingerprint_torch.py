"""One checksum definition, two implementations: rollouts.sync.fingerprint's numpy `checksum` and
torch `checksum_torch` agree bit for bit on every dtype, shape and memory layout; numpy's bfloat16
rounding is torch's."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.sync.fingerprint import checksum, checksum_torch, fingerprint, fingerprint_torch, flip_bit_torch
from rollouts.sync.raw import as_raw, bfloat16

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.float64]


@settings(deadline=None, max_examples=150)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 9), min_size=0, max_size=3),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_numpy_and_torch_give_the_same_checksum(dtype, shape, seed, strided):
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        tensor = (torch.randn([*shape, 3], generator=generator) * 1e3).to(dtype)
    else:
        tensor = torch.randint(-100 if dtype.is_signed else 0, 100, [*shape, 3], generator=generator, dtype=dtype)
    if strided:  # a non-contiguous view at an odd element offset: both read its row-major bytes
        tensor = tensor[..., 1:]
    assert checksum_torch(tensor) == checksum(tensor) == checksum(as_raw(tensor))


def test_large_tensors_agree_across_chunks():
    """Past the chunk sizes (2^16 words on CPU, 2^22 for torch on a GPU), with wrap-around."""
    tensor = torch.randint(-(2**31), 2**31 - 1, (2**22 + 2**16 + 3,), dtype=torch.int32)
    assert checksum_torch(tensor) == checksum(tensor)
    assert fingerprint_torch({"t": tensor}) == fingerprint({"t": tensor})


def test_a_flipped_bit_changes_the_checksum_in_place():
    weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    before = checksum_torch(weight)
    flip_bit_torch(weight)
    assert checksum_torch(weight) != before


@settings(deadline=None, max_examples=100)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_numpy_bfloat16_rounds_as_torch_does(values):
    array = np.array(values, dtype=np.float32)
    ours = bfloat16(array)
    theirs = torch.from_numpy(array).to(torch.bfloat16)
    assert checksum(ours) == checksum_torch(theirs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_tensor_gives_the_cpu_checksum():
    tensor = torch.randn(1000, 77, dtype=torch.bfloat16)
    assert checksum_torch(tensor.cuda()) == checksum_torch(tensor) == checksum(tensor)


@settings(deadline=None, max_examples=60)
@given(
    st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 40), st.booleans()), min_size=0, max_size=6),
    st.integers(0, 2**31 - 1),
)
def test_the_device_path_gives_numpys_checksums_for_many_tensors_at_once(specs, seed):
    """The GPU's arithmetic (int64 sums per chunk, every tensor's queued before one read back), run on
    CPU tensors with chunks of 8 words so that tensors span several; `cast` applied first."""
    import rollouts.sync.fingerprint_torch as impl

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (dtype, n, strided) in enumerate(specs):
        raw = torch.randint(0, 256, (n + 1,), generator=generator, dtype=torch.uint8)
        tensor = raw.view(torch.int8).to(dtype) if dtype.itemsize > 1 else raw.view(dtype)
        tensors[f"t{i}"] = tensor[1:] if strided else tensor[:n]
    expected = {name: checksum(t) for name, t in tensors.items()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(impl, "_on_host", lambda device: False)
        patch.setattr(impl, "_GPU_CHUNK_WORDS", 8)
        assert fingerprint_torch(tensors) == expected
        halves = fingerprint_torch(tensors, cast=lambda t: t.to(torch.bfloat16))
    assert list(halves) == list(tensors)
    assert halves == {name: checksum(t.to(torch.bfloat16)) for name, t in tensors.items()}
