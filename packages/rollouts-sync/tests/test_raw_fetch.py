"""The fetch wire without an engine: the trainer's one-off endpoint serves the raw safetensors bytes
to whoever holds its URL, once per fetcher and bounded; the worker extension's fetch reads them into
one buffer and loads the tensors bit for bit in their own dtype."""

from __future__ import annotations

import socket
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.sync.raw import as_raw, safetensors_header
from rollouts.sync.raw_server import ServedBytes

torch = pytest.importorskip("torch")  # the worker extension's side runs where torch is
from safetensors.torch import save_file  # noqa: E402

from rollouts.sync.fingerprint_torch import checksum_torch, fingerprint_torch  # noqa: E402
from rollouts.sync.worker_extension import (  # noqa: E402
    ChecksumsOnArrival,
    ReceiveBuffer,
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
    finally:
        served.close()
    assert 18 < served.sent_bytes < 18 + _HEAD_MAX_BYTES  # counted once the sends ended (close waits for them)


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


def test_a_stalled_fetcher_delays_no_other():
    """A tensor-parallel server's workers fetch side by side: one that stops reading holds only its own send."""
    served = ServedBytes([bytes(64 << 20)], host="127.0.0.1", timeout_s=60.0, max_fetches=4)
    host, port = served.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10.0) as stalled:
            stalled.sendall(f"GET /{served.url.rsplit('/', 1)[1]} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert stalled.recv(16)  # its answer began, and it reads no further: the server's send blocks
            start = time.monotonic()
            assert fetch_bytes(served.url, 64 << 20, 30.0).numel() == 64 << 20  # served beside it
            assert time.monotonic() - start < 30.0 and served.num_fetches == 2
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


def test_the_copy_into_the_cache_runs_after_the_answer_and_a_failed_one_asks_for_a_full_update(tmp_path, monkeypatch):
    """A fetch answers before its tensors are copied into the worker's cache; the next call waits for
    that copy. Should a copy fail, a partial update is refused naming why (the cache no longer holds
    the weights served) while a full one loads, and partial updates work again after it."""
    import rollouts.sync.worker_extension as extension

    save_file({"a": torch.zeros(64, 16), "b": torch.zeros(256)}, str(tmp_path / "model.safetensors"))
    worker = StandInWorker(tmp_path)
    release, original = threading.Event(), extension.keep_in_cache

    def held_copy(*args, **kwargs):
        assert release.wait(10.0)
        original(*args, **kwargs)

    monkeypatch.setattr(extension, "keep_in_cache", held_copy)
    first = {"a": torch.randn(64, 16), "b": torch.randn(256)}
    _fetch(worker, first)  # answered while its copy is held
    assert not worker._rollouts_cache_copy.done()
    release.set()
    second = {"a": torch.randn(64, 16)}
    _fetch(worker, second)  # waits for the first's copy before its bytes overwrite the buffer
    assert torch.equal(worker.loaded["b"], first["b"]) and torch.equal(worker.loaded["a"], second["a"])

    def failed_copy(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(extension, "keep_in_cache", failed_copy)
    _fetch(worker, {"a": torch.randn(64, 16)})  # served; its copy into the cache fails
    monkeypatch.setattr(extension, "keep_in_cache", original)
    with pytest.raises(RuntimeError, match=r"cache failed: MemoryError\('no room'\).*only a full update"):
        _fetch(worker, {"b": torch.randn(256)})
    full = {"a": torch.randn(64, 16), "b": torch.randn(256)}
    _fetch(worker, full)
    _fetch(worker, {"b": first["b"]})
    assert torch.equal(worker.loaded["a"], full["a"]) and torch.equal(worker.loaded["b"], first["b"])


@settings(max_examples=30, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 9), min_size=0, max_size=3)),
        min_size=1,
        max_size=6,
    ),
    cuts=st.lists(st.floats(0.0, 1.0), max_size=8),
)
def test_checksums_on_arrival_are_each_tensors_however_the_bytes_arrive(specs, cuts):
    """Fed the payload in arbitrary reads (the header split too), each tensor is summed once its last
    byte is in, and the sums are the tensors' own; a payload cut short is refused."""
    g = torch.Generator().manual_seed(1)
    tensors = {
        f"t{i}": torch.randint(-100, 100, tuple(shape), generator=g).to(dtype) for i, (dtype, shape) in enumerate(specs)
    }
    raw = {name: as_raw(t) for name, t in tensors.items()}
    payload = safetensors_header(raw) + b"".join(r.data.tobytes() for r in raw.values())
    buffer = torch.zeros(len(payload), dtype=torch.uint8)
    marks = sorted({int(c * len(payload)) for c in cuts} | {len(payload)})
    with ThreadPoolExecutor(1) as pool:
        arriving = ChecksumsOnArrival(buffer, pool)
        for mark in marks:
            buffer[:mark] = torch.tensor(list(payload[:mark]), dtype=torch.uint8)
            arriving(mark)
        assert arriving.result() == {name: checksum_torch(t) for name, t in tensors.items()}
        short = ChecksumsOnArrival(buffer, pool)
        short(len(payload) - 1)  # the payload ends with a tensor's last byte, unless every tensor is empty
        if sum(r.data.nbytes for r in raw.values()):
            with pytest.raises(RuntimeError, match="never arrived"):
                short.result()


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


def _fetch(worker, tensors):
    served = _served(tensors)
    try:
        return worker.rollouts_fetch_weights(served.url, str(served.num_bytes), "10")
    finally:
        served.close()


def _serve_half_then_close(tensors) -> tuple[str, int, threading.Thread]:
    """A URL that answers `tensors`' payload's full Content-Length, sends half of it, then closes."""
    raw = {name: as_raw(t) for name, t in tensors.items()}
    payload = safetensors_header(raw) + b"".join(r.data.tobytes() for r in raw.values())
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            conn.recv(4096)
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            conn.sendall(head.encode() + payload[: len(payload) // 2])

    thread = threading.Thread(target=serve)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/t", len(payload), thread


def test_fetches_reuse_one_receive_buffer_and_the_cache_never_holds_a_view_of_it(tmp_path):
    """Each fetch lands in the same host memory; what the worker keeps of a sync outlives the next
    fetch overwriting it, and a fetch cut off half-way (its bytes already over the buffer) changes
    nothing the worker keeps."""
    save_file({"a": torch.zeros(64, 16), "b": torch.zeros(256)}, str(tmp_path / "model.safetensors"))
    worker = StandInWorker(tmp_path)
    first, second = {"a": torch.randn(64, 16), "b": torch.randn(256)}, {"a": torch.randn(64, 16)}
    _fetch(worker, first)
    memory = worker._rollouts_receive_buffer._buffer.data_ptr()
    _fetch(worker, second)  # "a" lands where the first sync's "a" was
    url, num_bytes, server = _serve_half_then_close({"b": torch.randn(256), "a": torch.randn(64, 16)})
    with pytest.raises(RuntimeError, match="closed after"):
        worker.rollouts_fetch_weights(url, str(num_bytes), "10")
    server.join(timeout=10)
    _fetch(worker, {"b": first["b"].clone()})
    assert torch.equal(worker.loaded["a"], second["a"]) and torch.equal(worker.loaded["b"], first["b"])
    assert worker._rollouts_receive_buffer._buffer.data_ptr() == memory


def test_a_fetched_tensor_corrupted_after_receipt_reports_the_corrupted_checksum(tmp_path, monkeypatch):
    """The fault hook on the fetch path: the tensor is flipped before its sum, as a fault in the
    engine's memory would be, so attestation sees it; the others' sums are as sent."""
    monkeypatch.setenv("ROLLOUTS_SYNC_FAULT", "corrupt:b")
    save_file({"a": torch.zeros(64, 16), "b": torch.zeros(256)}, str(tmp_path / "model.safetensors"))
    worker = StandInWorker(tmp_path)
    sent = {"a": torch.ones(64, 16), "b": torch.ones(256)}
    answer = _fetch(worker, sent)
    assert answer["checksums"]["a"] == checksum_torch(sent["a"])
    assert answer["checksums"]["b"] != checksum_torch(sent["b"])
    assert answer["checksums"]["b"] == checksum_torch(worker.loaded["b"])  # what the model got, summed
    assert not torch.equal(worker.loaded["b"], sent["b"])


def test_an_unattested_fetch_loads_the_tensors_and_sums_nothing(tmp_path):
    """VLLMEngine(attest=False) names checksums="0" in its call (and only then: a worker extension
    from before the option takes the attested call as it was); the worker loads and answers no sums."""
    from rollouts.sync.tensor_rpc import fetch_rpc_body

    assert "checksums" not in fetch_rpc_body("http://h/t", 8, timeout_s=1.0)["kwargs"]
    assert fetch_rpc_body("http://h/t", 8, timeout_s=1.0, checksums=False)["kwargs"]["checksums"] == "0"
    save_file({"a": torch.zeros(64, 16)}, str(tmp_path / "model.safetensors"))
    worker = StandInWorker(tmp_path)
    sent = {"a": torch.randn(64, 16).bfloat16()}
    served = _served(sent)
    try:
        answer = worker.rollouts_fetch_weights(served.url, str(served.num_bytes), "10", checksums="0")
    finally:
        served.close()
    assert answer["checksums"] == {} and "checksum" not in answer["seconds"]
    assert torch.equal(worker.loaded["a"], sent["a"])


@settings(deadline=None, max_examples=50)
@given(takes=st.lists(st.lists(st.integers(0, 300), max_size=5), min_size=1, max_size=4))
def test_a_receive_buffer_gives_disjoint_aligned_views_and_grows_only_when_needed(takes):
    buffer = ReceiveBuffer()
    largest = 0
    for sizes in takes:
        before = None if buffer._buffer is None else buffer._buffer.data_ptr()
        views = buffer.take(sizes)
        total = sum(-(-n // ReceiveBuffer.ALIGN) * ReceiveBuffer.ALIGN for n in sizes)
        assert [v.numel() for v in views] == sizes and all(v.dtype == torch.uint8 for v in views)
        assert all(v.data_ptr() % ReceiveBuffer.ALIGN == 0 for v in views if v.numel())
        spans = sorted((v.data_ptr(), v.data_ptr() + v.numel()) for v in views if v.numel())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        if before is not None and total <= largest:
            assert buffer._buffer.data_ptr() == before  # reused: nothing mapped afresh
        largest = max(largest, total)
    with pytest.raises(ValueError, match="size must be >= 0"):
        buffer.take([-1])


def test_a_fetch_from_an_endpoint_that_never_answers_ends_within_its_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections (backlog), never answers
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            fetch_bytes(f"http://127.0.0.1:{port}/token", 10, 1.0)
        assert time.monotonic() - start < 1.0 + 4.0  # the timeout, with room for a loaded machine


def test_a_fetch_that_trickles_ends_at_its_deadline_not_when_the_bytes_end():
    """A server sending a byte now and then keeps each read alive; the deadline bounds the whole fetch."""
    stop = threading.Event()

    def trickle(server):
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n")
            for _ in range(100):  # all of it would take 20 s
                if stop.wait(0.2):
                    return
                conn.sendall(b"x")

    with socket.create_server(("127.0.0.1", 0)) as server:
        thread = threading.Thread(target=trickle, args=(server,), daemon=True)
        thread.start()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"fetching weights from 127\.0\.0\.1:\d+: \d+ of 100 bytes in 1\.0 s"):
            fetch_bytes(f"http://127.0.0.1:{server.getsockname()[1]}/token", 100, 1.0)
        assert time.monotonic() - start < 1.0 + 4.0  # the timeout, with room for a loaded machine
        stop.set()
        thread.join(timeout=30)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-4, 4]}}, r"'w': needs data_offsets \[start, end\]"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, r"'w': needs .*a shape of integers >= 0"),
        ({"w": {"dtype": "Q8", "shape": [2], "data_offsets": [0, 2]}}, r"'w': needs .*a dtype of"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, r"'w': 8 bytes for shape \[3\] of F32"),
        (
            {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            r"'w': bytes \[0, 16\) .* past the payload's 8",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
            },
            r"'b': bytes \[4, 8\) overlap the tensor before it \(which ends at 8\)",
        ),
    ],
)
def test_a_malformed_safetensors_payload_is_refused_naming_the_tensor(header, message):
    import json

    head = json.dumps(header).encode()
    payload = len(head).to_bytes(8, "little") + head + bytes(8)
    with pytest.raises(ValueError, match=message):
        tensors_of_safetensors(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def test_a_fetch_of_the_wrong_size_is_refused_without_naming_the_token():
    served = ServedBytes([b"abcd"], host="127.0.0.1", timeout_s=5.0, max_fetches=4)
    try:
        with pytest.raises(RuntimeError, match="expected 200 with 5") as info:
            fetch_bytes(served.url, 5, 5.0)
        assert served.url.rsplit("/", 1)[1] not in str(info.value)
    finally:
        served.close()


def test_a_held_fetch_is_loaded_by_the_commit_and_dropped_by_the_next_fetch(tmp_path):
    """Held (an attested sync), the fetched tensors are views of the receive buffer, unloaded until the
    commit; the next fetch, which overwrites that buffer, drops one still held."""
    save_file({"a": torch.zeros(64, 16), "b": torch.zeros(256)}, str(tmp_path / "model.safetensors"))
    worker = StandInWorker(tmp_path)
    first = {"a": torch.randn(64, 16), "b": torch.randn(256)}
    served = _served(first)
    try:
        answer = worker.rollouts_fetch_weights(served.url, str(served.num_bytes), "10", hold="t1")
    finally:
        served.close()
    assert answer["held"] is True and answer["checksums"] == fingerprint_torch(first) and worker.loaded is None
    worker.rollouts_commit("t1")
    assert torch.equal(worker.loaded["a"], first["a"])
    served = _served({"a": torch.ones(64, 16)})
    try:
        worker.rollouts_fetch_weights(served.url, str(served.num_bytes), "10", hold="t2")
    finally:
        served.close()
    _fetch(worker, {"b": torch.ones(256)})
    with pytest.raises(RuntimeError, match="none is held"):
        worker.rollouts_commit("t2")
    assert torch.equal(worker.loaded["a"], first["a"]) and torch.equal(worker.loaded["b"], torch.ones(256))
