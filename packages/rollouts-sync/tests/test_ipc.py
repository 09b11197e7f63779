"""The IPC wire without vLLM: handles travel as JSON and malformed ones are refused by field; a sync's
buckets, staged one at a time in the trainer's memory, reach the worker extension (in this process,
and in a worker process of its own: through /dev/shm on the CPU, by CUDA IPC on a GPU) bit for bit
in their own dtype, loaded all or nothing, with nothing left in /dev/shm."""

from __future__ import annotations

import errno
import functools
import json
import os
import secrets
import subprocess
import sys
import threading
import types
from urllib.parse import urlsplit

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")  # the IPC wire shares torch tensors
from safetensors.torch import save_file  # noqa: E402

from rollouts.sync import EngineError, HTTPOptions, RetryPolicy, VLLMEngine, is_this_machine  # noqa: E402
from rollouts.sync.broadcast_group import read_plan  # noqa: E402
from rollouts.sync.broadcast_wire import plan_buckets  # noqa: E402
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine  # noqa: E402
from rollouts.sync.fingerprint_torch import fingerprint_torch  # noqa: E402
from rollouts.sync.ipc import IpcUpdate, ShmBuckets  # noqa: E402
from rollouts.sync.ipc_handles import (  # noqa: E402
    IpcStorage,
    ShmFile,
    mapped,
    remove_orphans,
    share,
    shm_dir,
    visible_cuda_index,
)
from rollouts.sync.worker_extension import SafetensorsWeightLoader  # noqa: E402
from rollouts.sync.worker_process import StandInWorker  # noqa: E402

SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 2, 4)}


def _shm_buckets() -> set[str]:
    """This process's buckets in /dev/shm (other test runs may be making their own meanwhile)."""
    return {name for name in os.listdir(shm_dir()) if name.startswith(f"rollouts-ipc-{os.getpid()}-")}


# ---------------------------------------------------------------- handles as JSON

counts = st.integers(min_value=0, max_value=2**62)
storages = st.builds(
    IpcStorage,
    device=st.integers(min_value=0, max_value=15),
    device_uuid=st.uuids().map(str),
    handle=st.binary(max_size=80),
    size_bytes=counts,
    offset_bytes=counts,
    ref_counter_handle=st.binary(max_size=40),
    ref_counter_offset=counts,
    event_handle=st.binary(max_size=80),
    event_sync_required=st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(storage=storages)
def test_a_storages_handles_travel_as_json_exactly(storage):
    assert IpcStorage.from_json(json.loads(json.dumps(storage.to_json()))) == storage


def _storage_json(**changes):
    good = IpcStorage(
        device=0,
        device_uuid="b1e7a9f2-5c3d-4e8f-9a0b-1c2d3e4f5a6b",
        handle=b"\x01" * 64,
        size_bytes=4096,
        offset_bytes=512,
        ref_counter_handle=b"/torch_1_2",
        ref_counter_offset=3,
        event_handle=b"\x02" * 64,
        event_sync_required=True,
    ).to_json()
    return {k: v for k, v in {**good, **changes}.items() if v is not ...}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"handle": "not base64!"}, r"storage\.handle is not base64"),
        ({"handle": 7}, r"storage\.handle must be a base64 string"),
        ({"device": -1}, r"storage\.device must be an integer >= 0, got -1"),
        ({"device_uuid": "../x"}, r"storage\.device_uuid must be a GPU's UUID .*got '\.\./x'"),
        ({"device_uuid": 3}, r"storage\.device_uuid must be a GPU's UUID"),
        ({"size_bytes": True}, r"storage\.size_bytes must be an integer >= 0, got True"),
        ({"offset_bytes": 1.5}, r"storage\.offset_bytes must be an integer >= 0"),
        ({"event_sync_required": 1}, r"storage\.event_sync_required must be true or false"),
        ({"ref_counter_offset": ...}, r"storage: missing fields \['ref_counter_offset'\]"),
        ({"pickle": "gASV"}, r"storage: missing fields \[\], unknown fields \['pickle'\]"),
    ],
)
def test_malformed_storage_metadata_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        IpcStorage.from_json(_storage_json(**changes))


def test_a_gpu_is_found_by_its_uuid_whatever_this_process_numbers_it(monkeypatch):
    """The trainer's cuda:3 may be the server's cuda:0 (CUDA_VISIBLE_DEVICES differ): the UUID decides."""
    uuids = ["aaaa-0", "bbbb-1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))
    assert visible_cuda_index("bbbb-1") == 1 and visible_cuda_index("aaaa-0") == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"the bucket's GPU, cccc-3, is not among the 2 GPU\(s\).*'0,1'"):
        visible_cuda_index("cccc-3", "the bucket's GPU")


def test_a_shared_memory_bucket_maps_the_bytes_written_and_is_named_only_by_its_own_kind_of_path(tmp_path):
    shm, flat = ShmFile.create(100)
    try:
        flat.copy_(torch.arange(100, dtype=torch.uint8))
        handle = json.loads(json.dumps(share(flat, shm)))
        assert torch.equal(mapped(handle), torch.arange(100, dtype=torch.uint8))
        assert os.stat(shm.path).st_mode & 0o777 == 0o600  # this user's only
        for path, message in [
            (str(tmp_path / os.path.basename(shm.path)), "must be .*rollouts-ipc-<pid>-<16 hex digits>"),
            (os.path.join(shm_dir(), "rollouts-ipc-1-../../etc"), "must be .*rollouts-ipc-<pid>-<16 hex digits>"),
            (os.path.join(shm_dir(), "psm_1234"), "must be .*rollouts-ipc-<pid>-<16 hex digits>"),
        ]:
            with pytest.raises(ValueError, match=message):
                mapped({"shm": {"path": path, "size_bytes": 100}})
        with pytest.raises(ValueError, match=r"holds 100 bytes, the bucket names 4096"):
            mapped({"shm": {"path": shm.path, "size_bytes": 4096}})  # a read past the file's end would fault
        with pytest.raises(ValueError, match="an object of one key, 'shm' or 'cuda_ipc'"):
            mapped({"shm": handle["shm"], "cuda_ipc": {}})
        with pytest.raises(ValueError, match="only as a file in shared memory"):
            share(flat)  # host memory has no CUDA IPC handle
    finally:
        shm.remove()
    shm.remove()  # gone already: fine


def test_a_bucket_file_holds_its_pages_from_the_start_and_a_full_dev_shm_is_an_error_not_a_crash(monkeypatch):
    """A file only truncated to size has no pages on tmpfs: a write to a full /dev/shm would SIGBUS."""
    shm, _ = ShmFile.create(1 << 20)
    try:
        assert os.stat(shm.path).st_blocks * 512 >= 1 << 20  # reserved, not sparse
    finally:
        shm.remove()
    before = _shm_buckets()

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"no room for an IPC bucket of 4096 bytes .*--shm-size"):
        ShmFile.create(4096)
    assert _shm_buckets() == before  # the file that could not be filled is gone


def test_orphan_removal_neither_waits_on_a_fifo_nor_follows_a_link():
    """Anyone may name a FIFO or a link like a bucket in the shared /dev/shm; neither may hang or break a sync."""
    fifo = os.path.join(shm_dir(), f"rollouts-ipc-1-{secrets.token_hex(8)}")
    link = os.path.join(shm_dir(), f"rollouts-ipc-1-{secrets.token_hex(8)}")
    target, _ = ShmFile.create(16)
    os.mkfifo(fifo, 0o600)
    os.symlink(target.path, link)
    try:
        done = threading.Thread(target=remove_orphans, kwargs={"min_age_s": 0.0}, daemon=True)
        done.start()
        done.join(timeout=60)
        assert not done.is_alive(), "remove_orphans blocked on a FIFO"
        assert os.path.exists(fifo) and os.path.lexists(link) and os.path.exists(target.path)
    finally:
        for path in (fifo, link):
            if os.path.lexists(path):
                os.unlink(path)
        target.remove()


_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print("locked", flush=True)
sys.stdin.read()
"""


def test_only_buckets_no_process_holds_are_removed_when_a_new_one_is_made():
    """A trainer holds a lock on its file while it lives; a killed one's file is free of it."""
    orphan = os.path.join(shm_dir(), f"rollouts-ipc-1-{secrets.token_hex(8)}")  # no process holds it
    held = os.path.join(shm_dir(), f"rollouts-ipc-1-{secrets.token_hex(8)}")  # a live process of another pid does
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, held], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    mine = ShmBuckets()
    try:
        assert holder.stdout.readline() == b"locked\n"
        own, _ = mine.take(10)
        with open(orphan, "wb") as f:
            f.write(b"x" * 10)
        assert orphan not in remove_orphans()  # younger than 10 s: maybe not locked yet
        remove_orphans(min_age_s=0.0)  # (a test run beside this one may be the one that removes it)
        assert not os.path.exists(orphan)
        assert os.path.exists(own.path) and os.path.exists(held)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        mine.close()
        for path in (orphan, held):
            if os.path.exists(path):
                os.unlink(path)
    assert not os.path.exists(own.path)
    mine.close()  # closed already: fine


# ---------------------------------------------------------------- the trainer and a worker


class InProcessWorker(SafetensorsWeightLoader):
    """What the extension needs from vLLM's Worker: the model directory and reload_weights."""

    def __init__(self, model_dir, device="cpu"):
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(model=str(model_dir)))
        self.device = torch.device(device)
        self.loaded = None

    def reload_weights(self, weights_iterator):
        self.loaded = {name: tensor.clone() for name, tensor in weights_iterator}


@pytest.fixture
def model_dir(tmp_path):
    save_file({name: torch.zeros(shape) for name, shape in SHAPES.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _sync(worker, tensors, *, bucket_bytes, version=1):
    """Run one IPC sync into `worker`, as VLLMEngine does: each bucket's call once the last answered."""
    update = IpcUpdate(tensors, bucket_bytes=bucket_bytes, weight_version=version, checksums=True)
    answers, held = [], []
    for rpc in update.rpcs():
        assert rpc["method"] == "rollouts_receive_ipc"
        held.append(len(_shm_buckets()))
        answers.append(worker.rollouts_receive_ipc(**rpc["kwargs"]))
    return update, answers, held


dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64])


@settings(max_examples=25, deadline=None)
@given(
    chosen=st.lists(st.sampled_from(sorted(SHAPES)), min_size=1, max_size=3, unique=True),
    dtype=dtypes,
    seed=st.integers(0, 2**31),
    bucket_bytes=st.integers(1, 400),
)
def test_an_ipc_sync_loads_every_tensor_bit_for_bit_one_bucket_at_a_time(
    tmp_path_factory, chosen, dtype, seed, bucket_bytes
):
    model_dir = tmp_path_factory.mktemp("model")
    save_file({name: torch.zeros(shape) for name, shape in SHAPES.items()}, str(model_dir / "model.safetensors"))
    worker = InProcessWorker(model_dir)
    generator = torch.Generator().manual_seed(seed)
    sent = {
        name: (torch.randn(SHAPES[name], generator=generator) * 100).to(dtype) for name in chosen
    }  # a partial update in another dtype than the checkpoint's: stays in its own
    before = _shm_buckets()
    update, answers, held = _sync(worker, sent, bucket_bytes=bucket_bytes)
    assert held == [len(before) + 1] * len(update.plan.buckets)  # one file in /dev/shm for every bucket
    assert _shm_buckets() == before  # and none left
    assert [a.get("bucket") for a in answers[:-1]] == list(range(len(answers) - 1))
    assert answers[-1]["checksums"] == update.expected() == fingerprint_torch(sent)
    for name, tensor in sent.items():
        got = worker.loaded[name]
        assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
    upload = update.upload()
    assert upload.tensor_bytes == sum(t.numel() * t.element_size() for t in sent.values()) <= upload.shared_bytes
    assert upload.num_requests == len(answers) and upload.fetched_bytes == 0
    assert upload.body_bytes < 1000 * len(answers)  # handles and the plan, no tensor bytes


def test_a_bucket_of_another_sync_or_out_of_order_drops_what_was_staged_and_loads_nothing(model_dir):
    worker = InProcessWorker(model_dir)
    sent = {name: torch.ones(shape) for name, shape in SHAPES.items()}
    before = _shm_buckets()
    first = IpcUpdate(sent, bucket_bytes=16, weight_version=1, checksums=True).rpcs()
    second = IpcUpdate(sent, bucket_bytes=16, weight_version=2, checksums=True).rpcs()
    worker.rollouts_receive_ipc(**next(first)["kwargs"])  # bucket 0 of the first sync
    next(second)
    bucket1 = next(second)["kwargs"]  # (the second sync's bucket 0 is freed now: never mapped)
    with pytest.raises(ValueError, match=r"bucket 1 of sync [0-9a-f]{16} arrived, expected bucket 1 of sync"):
        worker.rollouts_receive_ipc(**bucket1)
    with pytest.raises(ValueError, match=r"expected bucket 0 of a sync"):  # the first sync was dropped
        worker.rollouts_receive_ipc(**next(first)["kwargs"])
    assert worker.loaded is None
    first.close()
    second.close()
    assert _shm_buckets() == before
    # a whole sync after those loads
    update, answers, _ = _sync(worker, sent, bucket_bytes=16, version=3)
    assert answers[-1]["num_tensors"] == 3 and torch.equal(worker.loaded["c"], sent["c"])


def test_a_clients_file_is_kept_from_sync_to_sync_and_the_worker_keeps_its_mapping(model_dir):
    worker = InProcessWorker(model_dir)
    shm = ShmBuckets()
    try:
        paths, mappings = set(), []
        for version in (1, 2):
            sent = {name: torch.full(shape, float(version)) for name, shape in SHAPES.items()}
            update = IpcUpdate(sent, bucket_bytes=64, weight_version=version, checksums=True, shm=shm)
            for rpc in update.rpcs():
                paths.add(json.loads(rpc["kwargs"]["handle_json"])["shm"]["path"])
                worker.rollouts_receive_ipc(**rpc["kwargs"])
                mappings.append(worker._rollouts_shm[1])  # kept alive here: the same object, or a new one
            assert all(torch.equal(worker.loaded[n], t) for n, t in sent.items())  # what this sync sent
        assert len(paths) == 1 and os.path.exists(paths.pop())
        assert len(mappings) > 2 and all(m is mappings[0] for m in mappings)
    finally:
        shm.close()
    assert not _shm_buckets()


def test_a_sync_abandoned_by_the_trainer_leaves_no_bucket_behind(model_dir):
    before = _shm_buckets()
    rpcs = IpcUpdate({"a": torch.ones(3, 5)}, bucket_bytes=1, weight_version=1, checksums=True).rpcs()
    next(rpcs)
    assert len(_shm_buckets()) == len(before) + 1
    rpcs.close()  # what VLLMEngine does when a call fails
    assert _shm_buckets() == before


def test_the_fault_hook_corrupts_the_named_tensor_after_receipt_not_the_trainers(model_dir, monkeypatch):
    monkeypatch.setenv("ROLLOUTS_SYNC_FAULT", "corrupt:b")
    worker = InProcessWorker(model_dir)
    sent = {name: torch.ones(shape) for name, shape in SHAPES.items()}
    update, answers, _ = _sync(worker, sent, bucket_bytes=64)
    expected = update.expected()
    assert [n for n in sorted(expected) if expected[n] != answers[-1]["checksums"][n]] == ["b"]
    assert torch.equal(sent["b"], torch.ones(7))  # the worker copied before corrupting


def test_views_shared_storage_and_empty_tensors_travel_as_their_values(tmp_path):
    shapes = {"a": (3, 5), "t": (5, 3), "row": (5,), "z": (0, 4)}
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, str(tmp_path / "model.safetensors"))
    worker = InProcessWorker(tmp_path)
    a = torch.arange(15.0).view(3, 5)
    sent = {"a": a, "t": a.T, "row": a[1], "z": torch.zeros(0, 4)}  # a view, a transposed one, no bytes at all
    update, answers, _ = _sync(worker, sent, bucket_bytes=32)
    assert answers[-1]["checksums"] == fingerprint_torch({n: t.contiguous() for n, t in sent.items()})
    assert all(torch.equal(worker.loaded[name], tensor) for name, tensor in sent.items())


def test_a_bucket_that_cannot_be_read_at_the_end_loads_nothing(model_dir):
    worker = InProcessWorker(model_dir)
    update = IpcUpdate({n: torch.ones(s) for n, s in SHAPES.items()}, bucket_bytes=64, weight_version=1, checksums=True)
    last = len(update.plan.buckets) - 1
    rpcs = update.rpcs()
    for k, rpc in enumerate(rpcs):
        kwargs = rpc["kwargs"]
        if k == last:  # its handle names more bytes than the file holds
            handle = json.loads(kwargs["handle_json"])
            handle["shm"]["size_bytes"] += 1
            with pytest.raises(ValueError, match="the bucket names"):
                worker.rollouts_receive_ipc(**{**kwargs, "handle_json": json.dumps(handle)})
        else:
            worker.rollouts_receive_ipc(**kwargs)
    assert last > 0 and worker.loaded is None and worker._rollouts_ipc is None


def _plan_json(**bucket_changes):
    plan = json.loads(
        plan_buckets([("w", "float32", [4]), ("b", "bfloat16", [3])], bucket_bytes=64, weight_version=2).to_json()
    )
    plan["buckets"][0].update(bucket_changes)
    return json.dumps(plan)


@pytest.mark.parametrize(
    ("plan_json", "message"),
    [
        ("[]", r"plan must be an object with a non-empty list 'buckets'"),
        ('{"version": 1, "buckets": []}', r"non-empty list 'buckets'"),
        ('{"version": -1, "buckets": [{}]}', r"plan\.version must be an integer >= 0, got -1"),
        (_plan_json(nbytes=1.5), r"plan\.buckets\[0\]\.nbytes must be an integer >= 0, got 1\.5"),
        (_plan_json(tensors=[["w", "float32", [4], -16]]), r"tensors\[0\].*offset must be an integer >= 0, got -16"),
        (_plan_json(tensors=[["w", "float32", [40], 0]]), r"tensors\[0\].*end within the bucket's 22 bytes"),
        (
            _plan_json(tensors=[["w", "float32", [4], 0], ["b", "bfloat16", [3], 8]]),
            r"tensors\[1\].*after the tensor before it \(which ends at 16\)",
        ),
        (_plan_json(tensors=[["w", "float32", [4], 2]]), r"must start at a multiple of 4 bytes"),
        (_plan_json(tensors=[["w", "float32", [2], 0], ["w", "float32", [1], 16]]), r"the name 'w' comes twice"),
        (_plan_json(tensors=[["w", "Tensor", [4], 0]]), r"the dtype must be one of \['bfloat16'"),
        (_plan_json(tensors=[["w", "qint8", [4], 0]]), r"the dtype must be one of"),
        (_plan_json(tensors=[["w", "uint8", [2**32, 2**32], 0]]), r"end within the bucket's 22 bytes"),
        (_plan_json(pieces=[[0, 8], [16, 22]]), r"bytes \[0, 16\) of a tensor are in none of its pieces"),
        (_plan_json(tensors=[["w", "float32", [4]]]), r"must be \[name, dtype, shape, offset\]"),
        (_plan_json(pieces=[[0, 16], [8, 22]]), r"pieces: \[8, 22\] must be \[start, end\] in order within 22 bytes"),
    ],
)
def test_a_malformed_plan_is_refused_naming_the_field_before_any_bucket_is_read(plan_json, message):
    with pytest.raises(ValueError, match=message):
        read_plan(plan_json)


@settings(max_examples=50, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=6),
    dtype=st.sampled_from(["float32", "bfloat16", "int64", "uint8"]),
    bucket_bytes=st.integers(1, 100),
)
def test_every_plan_the_trainer_makes_is_read_back_as_written(shapes, dtype, bucket_bytes):
    plan = plan_buckets(
        [(f"t{i}", dtype, s) for i, s in enumerate(shapes)], bucket_bytes=bucket_bytes, weight_version=1
    )
    for checksums in (True, False):
        assert read_plan(plan.to_json(checksums=checksums)) == json.loads(plan.to_json(checksums=checksums))


def test_the_worker_takes_every_dtype_a_plan_carries_and_no_other():
    from rollouts.sync.broadcast_group import _WIRE_DTYPES
    from rollouts.sync.broadcast_wire import DTYPE_BYTES

    assert _WIRE_DTYPES == set(DTYPE_BYTES)


@settings(max_examples=30, deadline=None)
@given(st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(1, 254)))
def test_every_loopback_address_is_this_machine_and_a_documentation_address_is_not(octets):
    assert is_this_machine("127.{}.{}.{}".format(*octets))
    assert not is_this_machine(f"192.0.2.{octets[2]}")  # TEST-NET-1: never a machine's own


def test_the_ipc_wire_is_refused_for_a_server_on_another_machine():
    assert VLLMEngine("http://127.0.0.1:8000", tensor_wire="ipc").tensor_wire == "ipc"
    with pytest.raises(ValueError, match=r"must run on this machine, and '192\.0\.2\.7' .* use 'fetch'"):
        VLLMEngine("http://192.0.2.7:8000", tensor_wire="ipc")


def test_what_cannot_travel_by_ipc_is_refused_naming_it():
    with pytest.raises(ValueError, match="non-empty mapping"):
        IpcUpdate({}, bucket_bytes=16, weight_version=1, checksums=True)
    with pytest.raises(TypeError, match=r"tensors\['z'\]: dtype complex64 cannot travel by IPC"):
        IpcUpdate({"z": torch.zeros(2, dtype=torch.complex64)}, bucket_bytes=16, weight_version=1, checksums=True)
    with pytest.raises(ValueError, match="bucket_bytes"):
        IpcUpdate({"a": torch.zeros(2)}, bucket_bytes=0, weight_version=1, checksums=True)
    meta = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match=r"all on one CUDA device or all on the CPU, got \['meta'\]"):
        IpcUpdate({"a": meta}, bucket_bytes=16, weight_version=1, checksums=True)


# ---------------------------------------------------------------- a worker in a process of its own


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_a_worker_process_maps_the_trainers_buckets(model_dir, device):
    """On the CPU through /dev/shm; on a GPU by CUDA IPC handles, staged on the worker's GPU."""
    sent = {name: torch.randn(shape).to(torch.bfloat16).to(device) for name, shape in SHAPES.items()}
    update = IpcUpdate(sent, bucket_bytes=64, weight_version=1, checksums=True)
    with StandInWorker(model_dir, device="cuda:0" if device == "cuda" else "cpu") as worker:
        answers = []
        for rpc in update.rpcs():
            assert set(json.loads(rpc["kwargs"]["handle_json"])) == ({"cuda_ipc"} if device == "cuda" else {"shm"})
            answers.append(worker.call(rpc["kwargs"]))
        with pytest.raises(RuntimeError, match=r"stand-in worker failed: ValueError: bucket 1 of sync"):
            worker.call({**rpc["kwargs"], "index": "1"})  # a bucket out of turn: named, the worker serves on
    expected = update.expected()
    assert len(answers) == len(update.plan.buckets) > 1
    assert answers[-1]["checksums"] == expected
    assert answers[-1]["loaded"] == expected
    assert answers[-1]["devices"] == (["cuda:0"] if device == "cuda" else ["cpu"])


# ---------------------------------------------------------------- through VLLMEngine, against the fake server


@pytest.mark.anyio
async def test_a_failed_bucket_is_never_sent_again_and_the_engines_own_error_is_raised():
    """A bucket is not idempotent (the worker dropped the sync when it failed): a retry could only fail
    out of turn, hiding the cause, or, after a lost answer to the last, load behind the trainer's back."""
    state = FakeEngineState()
    retrying = HTTPOptions(retry=RetryPolicy(max_retries=3, backoff_base_s=0.0, backoff_max_s=0.0))
    weights = {name: torch.ones(shape) for name, shape in SHAPES.items()}
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=retrying, tensor_wire="ipc") as engine:
        await engine.update_weights_from_tensors(weights, 1, chunk_bytes=64)  # the fake learns the names
        state.calls.clear()
        wrong = {**weights, "extra": torch.ones(2)}
        with pytest.raises(EngineError, match=r"tensors not in the model's checkpoint: \['extra'\]"):
            await engine.update_weights_from_tensors(wrong, 2, chunk_bytes=64)
        assert await engine.weight_version() == 1 and not state.paused
    buckets = len(IpcUpdate(wrong, bucket_bytes=64, weight_version=2, checksums=True).plan.buckets)
    # each bucket once, then (the sync failed after a bucket went out) the discard of what it may hold
    assert state.calls.count(("POST", "/collective_rpc")) == buckets + 1 and buckets > 1


@pytest.mark.anyio
async def test_two_syncs_of_one_engine_at_once_run_one_after_the_other():
    """They share the client's file in /dev/shm and the server's pause: interleaved, each would break the other."""
    state = FakeEngineState(reload_delay_s=0.02)  # each bucket's answer waits: the two would overlap
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, tensor_wire="ipc") as engine:
        async with anyio.create_task_group() as group:
            for version in (1, 2):
                sent = {name: torch.full(shape, float(version)) for name, shape in SHAPES.items()}
                group.start_soon(functools.partial(engine.update_weights_from_tensors, sent, version, chunk_bytes=64))
        final = await engine.weight_version()
    calls = [urlsplit(target).path for _, target in state.calls]
    calls = [path for path in calls if path in ("/pause", "/resume", "/collective_rpc")]
    per_sync = ["/pause"] + ["/collective_rpc"] * 4 + ["/resume"]  # SHAPES' three tensors: a bucket each; the load
    assert calls == per_sync * 2
    assert final in (1, 2) and all(np.all(state.weights[n].view(np.float32) == final) for n in SHAPES)
