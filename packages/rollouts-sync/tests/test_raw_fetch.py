"""The fetch wire without an engine: the trainer's one-off endpoint serves the raw safetensors bytes
to whoever holds its URL, once per fetcher and bounded; the worker extension's fetch reads them into
one buffer and loads the tensors bit for bit in their own dtype."""

from __future__ import annotations

import socket
import time
import types

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.sync.raw import as_raw, safetensors_header
from rollouts.sync.raw_server import ServedBytes

torch = pytest.importorskip("torch")  # the worker extension's side runs where torch is
from safetensors.torch import save_file  # noqa: E402

from rollouts.sync.fingerprint_torch import checksum_torch  # noqa: E402
from rollouts.sync.worker_extension import (  # noqa: E402
    SafetensorsWeightLoader,
    fetch_bytes,
    tensors_of_safetensors,
)

_HEAD_MAX_BYTES = 200  # the 200 response's status line and three headers


def _served(tensors, **kwargs) -> ServedBytes:
    raw = {name: as_raw(t) for name, t in tensors.items()}
    parts = [safetensors_header(raw), *(r.data for r in raw.values())]
    return ServedBytes(parts, host="127.0.0.1", timeout_s=kwargs.pop("timeout_s", 10.0), **kwargs)


def test_only_a_get_of_the_token_url_is_served_and_every_byte_sent_is_counted():
    payload = [b"head", np.arange(10, dtype=np.uint8), b"tail"]
    served = ServedBytes(payload, host="127.0.0.1", timeout_s=5.0, max_fetches=2)
    try:
        base = served.url.rsplit("/", 1)[0]
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            assert client.get(base + "/not-the-token").status_code == 404
            assert client.post(served.url, content=b"x").status_code == 404
            got = client.get(served.url)
        assert got.status_code == 200 and got.content == b"head" + bytes(range(10)) + b"tail"
        assert served.num_bytes == 18 and served.num_fetches == 1
        assert 18 < served.sent_bytes < 18 + _HEAD_MAX_BYTES
    finally:
        served.close()


def test_fetches_past_the_bound_get_no_answer():
    served = ServedBytes([b"abc"], host="127.0.0.1", timeout_s=5.0, max_fetches=1)
    try:
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            assert client.get(served.url).content == b"abc"
            with pytest.raises(httpx.TransportError):  # refused, or unanswered until the client's timeout
                client.get(served.url)
        assert served.num_fetches == 1
    finally:
        served.close()


_DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.float16]


@settings(max_examples=20, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3)),
        min_size=1,
        max_size=6,
    )
)
def test_fetched_tensors_are_bit_identical_in_their_own_dtype(specs):
    """Any mix of dtypes and sizes, so some tensors start at offsets their dtype cannot view at."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randint(-100, 100, tuple(shape), generator=g).to(dtype) for i, (dtype, shape) in enumerate(specs)
    }
    served = _served(tensors)
    try:
        got = tensors_of_safetensors(fetch_bytes(served.url, served.num_bytes, 10.0))
    finally:
        served.close()
    assert list(got) == list(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


class StandInWorker(SafetensorsWeightLoader):
    """What the extension needs from vLLM's Worker: the model directory and reload_weights."""

    def __init__(self, model_dir):
        self.rank = 0
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(model=str(model_dir)))
        self.loaded = None

    def reload_weights(self, weights_iterator):
        self.loaded = {k: v.clone() for k, v in weights_iterator}


def test_the_worker_extension_loads_fetched_weights_and_answers_their_checksums(tmp_path):
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7)}, str(tmp_path / "model.safetensors"))
    worker = StandInWorker(tmp_path)
    sent = {"a": torch.randn(3, 5).bfloat16()}  # a partial update, in bf16
    served = _served(sent)
    try:
        answer = worker.rollouts_fetch_weights(served.url, str(served.num_bytes), "10")
    finally:
        served.close()
    assert answer["checksums"] == {"a": checksum_torch(sent["a"])}
    assert set(answer["seconds"]) == {"receive", "checksum", "load"}
    assert torch.equal(worker.loaded["a"], sent["a"]) and worker.loaded["a"].dtype == torch.bfloat16
    assert torch.equal(worker.loaded["b"], torch.zeros(7))  # the rest of the checkpoint, as it was

    served = _served({"typo": torch.zeros(2)})
    try:
        with pytest.raises(ValueError, match="typo"):
            StandInWorker(tmp_path).rollouts_fetch_weights(served.url, str(served.num_bytes), "10")
    finally:
        served.close()


def test_a_fetch_from_an_endpoint_that_never_answers_ends_within_its_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections (backlog), never answers
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            fetch_bytes(f"http://127.0.0.1:{port}/token", 10, 1.0)
        assert time.monotonic() - start < 1.0 + 4.0  # the timeout, with room for a loaded machine


def test_a_fetch_of_the_wrong_size_is_refused_without_naming_the_token():
    served = ServedBytes([b"abcd"], host="127.0.0.1", timeout_s=5.0, max_fetches=4)
    try:
        with pytest.raises(RuntimeError, match="expected 200 with 5") as info:
            fetch_bytes(served.url, 5, 5.0)
        assert served.url.rsplit("/", 1)[1] not in str(info.value)
    finally:
        served.close()
