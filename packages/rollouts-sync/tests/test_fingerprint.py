"""Fingerprints (rollouts.sync.fingerprint) and raw tensors (rollouts.sync.raw), with numpy only: a
flipped bit or two swapped words always change a checksum; the safetensors container written here
is what safetensors itself reads; bf16 stays bf16."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import save as safetensors_save

from rollouts.sync import AttestationError, RawTensor, check_attestation, fingerprint, fingerprint_dir
from rollouts.sync.fingerprint import checksum, sync_fault_target
from rollouts.sync.raw import as_raw, decode_safetensors, encode_safetensors
from rollouts.sync.raw import bfloat16 as bf16

BYTES = st.binary(min_size=1, max_size=4096)


def raw_bytes(data: bytes) -> RawTensor:
    return RawTensor(dtype="U8", shape=(len(data),), data=np.frombuffer(data, dtype=np.uint8).copy())


@settings(deadline=None, max_examples=200)
@given(BYTES, st.data())
def test_one_flipped_bit_always_changes_the_checksum(data, draw):
    position = draw.draw(st.integers(0, len(data) * 8 - 1))
    flipped = bytearray(data)
    flipped[position // 8] ^= 1 << (position % 8)
    assert checksum(raw_bytes(bytes(flipped))) != checksum(raw_bytes(data))


@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=512), st.data())
def test_two_swapped_unequal_words_always_change_the_checksum(words, draw):
    i = draw.draw(st.integers(0, len(words) - 1))
    j = draw.draw(st.integers(0, len(words) - 1))
    assume(words[i] != words[j])
    swapped = list(words)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert checksum(np.array(swapped, dtype=np.uint32)) != checksum(np.array(words, dtype=np.uint32))


@settings(deadline=None, max_examples=100)
@given(BYTES)
def test_a_trailing_zero_byte_changes_the_checksum(data):
    assert checksum(raw_bytes(data + b"\0")) != checksum(raw_bytes(data))


def test_the_checksum_reads_bytes_not_values():
    """Equal bytes, equal checksum, whatever the dtype they are viewed as; a cast changes it."""
    values = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    assert checksum(values) == checksum(values.view(np.uint32)) == checksum(as_raw(values))
    assert checksum(values) != checksum(values.astype(np.float64))
    assert checksum(np.asfortranarray(values)) == checksum(values)  # row-major bytes whatever the layout


@settings(deadline=None, max_examples=50)
@given(st.sampled_from(["float32", "float16", "int64", "int8", "uint8", "float64", "bool"]), st.data())
def test_safetensors_written_here_are_what_safetensors_reads(dtype, draw):
    shape = tuple(draw.draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    array = np.random.default_rng(draw.draw(st.integers(0, 2**32 - 1))).standard_normal(shape).astype(dtype)
    other = np.arange(7, dtype=np.int32)
    data = encode_safetensors({"a": as_raw(array), "b": as_raw(other)}, metadata={"format": "pt"})
    loaded = safetensors_load(data)
    np.testing.assert_array_equal(loaded["a"], array)
    np.testing.assert_array_equal(loaded["b"], other)
    back = decode_safetensors(safetensors_save({"a": array}))["a"]
    assert back.shape == array.shape and np.array_equal(back.view(), array)


def test_bf16_keeps_two_bytes_per_element_through_the_container():
    values = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    tensor = bf16(values)
    assert tensor.nbytes == values.size * 2
    back = decode_safetensors(encode_safetensors({"w": tensor}))["w"]
    assert back.dtype == "BF16" and back.shape == (4, 6)
    np.testing.assert_array_equal(back.view(), tensor.view())
    assert checksum(back) == checksum(tensor)


def test_raw_tensors_refuse_what_does_not_add_up():
    with pytest.raises(ValueError, match="takes 8 bytes"):
        RawTensor(dtype="BF16", shape=(4,), data=np.zeros(6, np.uint8))
    with pytest.raises(ValueError, match="dtype must be one of"):
        RawTensor(dtype="bf16", shape=(1,), data=np.zeros(2, np.uint8))
    with pytest.raises(TypeError, match="numpy array, a torch tensor or a RawTensor"):
        as_raw([1.0, 2.0])


def test_fingerprint_dir_reads_every_file_in_its_own_dtype(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(encode_safetensors({"x": bf16(np.ones((2, 2), np.float32))}))
    (tmp_path / "b.safetensors").write_bytes(safetensors_save({"y": np.arange(3, dtype=np.float32)}))
    assert fingerprint_dir(tmp_path) == fingerprint(
        {"x": bf16(np.ones((2, 2), np.float32)), "y": np.arange(3, dtype=np.float32)}
    )


def test_check_attestation_names_what_differs_and_what_is_missing():
    expected = {"a": 1, "b": 2, "c": 3}
    check_attestation(expected, {"a": 1, "b": 2, "c": 3, "extra": 9}, engine="e", weight_version=4)
    with pytest.raises(AttestationError) as info:
        check_attestation(expected, {"a": 1, "b": 5}, engine="http://e", weight_version=4)
    assert info.value.mismatched == ("b",) and info.value.missing == ("c",)
    assert "http://e" in str(info.value) and "engine.attest = false" in str(info.value)


def test_the_fault_spec_comes_from_the_environment_or_a_file(tmp_path):
    assert sync_fault_target({}) is None
    assert sync_fault_target({"ROLLOUTS_SYNC_FAULT": "corrupt:lm_head.weight"}) == "lm_head.weight"
    spec = tmp_path / "fault"
    assert sync_fault_target({"ROLLOUTS_SYNC_FAULT": f"file:{spec}"}) is None  # no file: no fault
    spec.write_text("corrupt:w1\n")
    assert sync_fault_target({"ROLLOUTS_SYNC_FAULT": f"file:{spec}"}) == "w1"
    with pytest.raises(ValueError, match="corrupt:<tensor name>"):
        sync_fault_target({"ROLLOUTS_SYNC_FAULT": "flip:w1"})


@settings(max_examples=50, deadline=None)
@given(
    mismatched=st.lists(st.from_regex(r"model\.layers\.[0-9]{1,2}\.[a-z_.]{1,30}", fullmatch=True), max_size=40),
    missing=st.lists(st.from_regex(r"[a-z_.]{1,40}", fullmatch=True), max_size=5),
)
def test_an_attestation_failures_first_500_characters_say_what_failed_and_what_to_do(mismatched, missing):
    """The command line shows a failure's first 500 characters: the engine, the counts, the first names,
    that the run stops and how to turn the check off come before the long lists of names."""
    assume(mismatched or missing)
    text = str(AttestationError(engine="http://10.0.0.12:8000", weight_version=7, mismatched=tuple(mismatched),
                                missing=tuple(missing)))[:500]  # fmt: skip
    assert "http://10.0.0.12:8000" in text and "weight version 7" in text
    assert (f"{len(mismatched)} tensor(s) differ" in text) == bool(mismatched)
    assert all(name in text for name in mismatched[:1])
    assert "engine.attest = false" in text or len(", ".join(mismatched[:3] + missing[:3])) > 150
