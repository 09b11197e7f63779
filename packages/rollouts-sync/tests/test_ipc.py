"""The IPC wire without vLLM: handles travel as JSON and malformed ones are refused by field; a sync's
buckets, staged one at a time in the trainer's memory, reach the worker extension (in this process,
and in a worker process of its own: through /dev/shm on the CPU, by CUDA IPC on a GPU) bit for bit
in their own dtype, loaded all or nothing, with nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")  # the IPC wire shares torch tensors
from safetensors.torch import save_file  # noqa: E402

from rollouts.sync.fingerprint_torch import fingerprint_torch  # noqa: E402
from rollouts.sync.ipc import IpcUpdate, ShmBuckets  # noqa: E402
from rollouts.sync.ipc_handles import IpcStorage, ShmFile, mapped, remove_orphans, share, shm_dir  # noqa: E402
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
        paths, mappings = set(), set()
        for version in (1, 2):
            sent = {name: torch.full(shape, float(version)) for name, shape in SHAPES.items()}
            update = IpcUpdate(sent, bucket_bytes=64, weight_version=version, checksums=True, shm=shm)
            for rpc in update.rpcs():
                paths.add(json.loads(rpc["kwargs"]["handle_json"])["shm"]["path"])
                worker.rollouts_receive_ipc(**rpc["kwargs"])
                mappings.add(id(worker._rollouts_shm[1]))
            assert all(torch.equal(worker.loaded[n], t) for n, t in sent.items())  # what this sync sent
        assert len(paths) == 1 and len(mappings) == 1 and os.path.exists(paths.pop())
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
