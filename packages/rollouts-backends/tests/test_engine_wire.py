"""The engine process's frames: a round trip in memory and through a pipe, and what a bad frame is."""

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends.engine_process.wire import ChildGone, decode_frame, encode_frame, read_frame, write_frame

_PIPE_TIMEOUT_S = 30.0  # the pipe's other end is this test: data is there at once; this only bounds a bug

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_headers = st.dictionaries(st.text(max_size=8), _json, max_size=6)


@settings(max_examples=100, deadline=None)
@given(header=_headers, body=st.binary(max_size=2000))
def test_a_frame_round_trips(header, body):
    assert decode_frame(encode_frame(header, body)) == (header, body)


@settings(max_examples=30, deadline=None)
@given(frames=st.lists(st.tuples(_headers, st.binary(max_size=200_000)), min_size=1, max_size=3))
def test_frames_round_trip_through_a_pipe_in_order(frames):
    """Bodies larger than a pipe's buffer go through while the reader drains it."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    pid = os.fork()
    if pid == 0:  # the writer: one process per end, as with the engine process
        try:
            for header, body in frames:
                write_frame(write_fd, encode_frame(header, body), deadline=time.monotonic() + _PIPE_TIMEOUT_S)
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        got = [read_frame(read_fd, deadline=time.monotonic() + _PIPE_TIMEOUT_S) for _ in frames]
        with pytest.raises(ChildGone, match="closed its answer pipe"):
            read_frame(read_fd, deadline=time.monotonic() + _PIPE_TIMEOUT_S)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    assert got == frames


@settings(max_examples=50, deadline=None)
@given(header=_headers, body=st.binary(max_size=100), data=st.data())
def test_a_cut_or_padded_frame_is_a_value_error(header, body, data):
    frame = encode_frame(header, body)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(ValueError, match="cut short|prefix says"):
        decode_frame(frame[:cut])
    with pytest.raises(ValueError, match="prefix says"):
        decode_frame(frame + b"\0")


def test_a_foreign_stream_is_refused_by_its_magic():
    with pytest.raises(ValueError, match="not an engine frame"):
        decode_frame(b"HTTP/1.1 200 OK\r\n\r\n")


def test_a_silent_pipe_is_a_timeout():
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    try:
        with pytest.raises(TimeoutError, match="did not answer in time"):
            read_frame(read_fd, deadline=time.monotonic())  # nothing was written: the deadline passes
    finally:
        os.close(read_fd)
        os.close(write_fd)
