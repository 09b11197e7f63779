"""Weights by CUDA IPC: which transport a load takes, the handle metadata's JSON (round trip, and
refusal of malformed data naming the field), the staging buckets; on a CUDA device, a ProcessEngine
synced by IPC samples what the in-process engine samples, with no shared-memory file written."""

import pytest
import torch
import trio
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import EngineProcessOptions, InProcessEngine, ProcessEngine
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.backends.engine_process.cuda_ipc import (
    IpcTensor,
    buckets,
    choose_transport,
    ipc_tensors,
    mapped_views,
    stage_bucket,
)
from rollouts.sync.ipc_handles import IpcStorage
from rollouts.types import SamplingParams

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")


@pytest.mark.parametrize(
    ("requested", "devices", "engine", "expected"),
    [
        ("auto", [GPU0, GPU0], GPU0, "cuda_ipc"),  # colocated
        ("auto", [CPU], CPU, "shared_memory"),
        ("auto", [CPU], GPU0, "shared_memory"),  # a CPU trainer, an engine on a GPU
        ("auto", [GPU1], GPU0, "shared_memory"),  # another GPU
        ("auto", [GPU0, CPU], GPU0, "shared_memory"),  # mixed
        ("auto", [], GPU0, "shared_memory"),
        ("shared_memory", [GPU0], GPU0, "shared_memory"),  # the override wins
        ("cuda_ipc", [GPU0], GPU0, "cuda_ipc"),
    ],
)
def test_the_transport_is_cuda_ipc_exactly_when_the_weights_are_on_the_engines_gpu(
    requested, devices, engine, expected
):
    assert choose_transport(requested, devices, engine) == expected


def test_cuda_ipc_asked_of_weights_elsewhere_is_refused_naming_the_devices():
    with pytest.raises(ValueError, match=r"needs every tensor on the engine's device cuda:0; .*\['cpu', 'cuda:0'\]"):
        choose_transport("cuda_ipc", [GPU0, CPU], GPU0)
    with pytest.raises(ValueError, match="weights_transport must be one of"):
        choose_transport("nccl", [GPU0], GPU0)
    with pytest.raises(ValueError, match="needs a CUDA device for the engine, got 'cpu'"):
        EngineProcessOptions(weights_transport="cuda_ipc")
    with pytest.raises(ValueError, match="weights_transport must be one of"):
        EngineProcessOptions(weights_transport="disk")
    with pytest.raises(ValueError, match="ipc_bucket_bytes must be >= 1"):
        EngineProcessOptions(ipc_bucket_bytes=0)


def _storage(size_bytes=4096):
    """A bucket's storage as its handle names it (rollouts.sync.ipc_handles; tested there): the size counts here."""
    return IpcStorage(device=0, device_uuid="GPU-0", handle=b"\x01" * 64, size_bytes=size_bytes, offset_bytes=512,
                      ref_counter_handle=b"/torch_1_2", ref_counter_offset=3, event_handle=b"\x02" * 64,
                      event_sync_required=True)  # fmt: skip


def test_malformed_tensor_metadata_is_refused_naming_the_field():
    storage = _storage()
    good = {"name": "w", "dtype": "bfloat16", "shape": [4, 8], "offset_bytes": 64}
    assert ipc_tensors({"tensors": [good]}, storage) == [
        IpcTensor(name="w", dtype="bfloat16", shape=(4, 8), offset_bytes=64)
    ]
    last = {**good, "offset_bytes": 4096 - 64}  # its 64 bytes end exactly at the bucket's end
    assert ipc_tensors({"tensors": [good, last]}, storage)[1].offset_bytes == 4032
    for change, message in [
        ({"dtype": "int64"}, r"tensors\[1\]\.dtype must be one of"),
        ({"shape": [4, -8]}, r"tensors\[1\]\.shape must be a list of integers >= 0"),
        ({"offset_bytes": 65}, r"tensors\[1\]\.offset_bytes must be a multiple of 64"),
        ({"name": None}, r"tensors\[1\]\.name must be a string"),
        ({"offset_bytes": 4096}, r"tensors\[1\] \('w'\) spans bytes 4096\.\.4160 of a 4096-byte bucket"),
    ]:
        with pytest.raises(ValueError, match=message):
            ipc_tensors({"tensors": [good, {**good, **change}]}, storage)
    with pytest.raises(ValueError, match="'tensors' must be a list"):
        ipc_tensors({"tensors": "w"}, storage)


shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(shapes, min_size=1, max_size=8),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), min_size=8, max_size=8),
    bucket_bytes=st.integers(min_value=1, max_value=400),
)
def test_buckets_keep_the_order_and_a_staged_bucket_reads_back_its_tensors(shapes, dtypes, bucket_bytes):
    tensors = {f"t{i}": torch.randn(shape).to(dtypes[i]) for i, shape in enumerate(shapes)}
    groups = buckets(tensors, bucket_bytes)
    assert [name for group in groups for name in group] == list(tensors)
    for group in groups:
        aligned = sum(-(-tensors[n].numel() * tensors[n].element_size() // 64) * 64 for n in group)
        assert len(group) == 1 or aligned <= bucket_bytes
        flat, layout = stage_bucket({n: tensors[n] for n in group}, CPU)  # the layout logic, on CPU bytes
        views = mapped_views(flat, ipc_tensors({"tensors": [t.to_json() for t in layout]}, _sized(flat)))
        assert list(views) == group
        for name in group:
            assert views[name].dtype == tensors[name].dtype and torch.equal(views[name], tensors[name])


def _sized(flat):
    return _storage(size_bytes=flat.numel())


# ---------------------------------------------------------------- on a CUDA device

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
GREEDY = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)


def _tokens(engine):
    return [s.tokens for s in trio.run(engine.generate, PROMPTS, GREEDY)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bucket_bytes", [1 << 30, 4096])  # one bucket; many (a weight larger than one goes alone)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_on_the_trainers_gpu_syncs_by_ipc_and_samples_the_new_weights(bucket_bytes, dtype):
    base, other = tiny_model(seed=0, dtype=dtype).cuda(), tiny_model(seed=5, dtype=dtype).cuda()
    reference = InProcessEngine(other, shares_training_model=False, weight_version=1)
    expected = _tokens(reference)
    with ProcessEngine.from_model(base, device="cuda:0", ipc_bucket_bytes=bucket_bytes) as engine:
        assert _tokens(engine) != expected
        tensors = model_tensors(other, keep_device=True)  # views of `other`'s own parameters
        assert all(t.is_cuda for t in tensors.values())
        trio.run(engine.load_weights, tensors, 1)
        assert _tokens(engine) == expected
        assert engine._child.weights is None and engine._child.weights_file.stat().st_size == 0  # no host copy
        for t in tensors.values():
            t.zero_()  # as the trainer's next step would: the engine copied, it does not alias
        assert _tokens(engine) == expected
        trio.run(engine.load_weights, model_tensors(base, keep_device=True), 2)  # again, other weights
        assert _tokens(engine) == _tokens(InProcessEngine(base, shares_training_model=False))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_override_keeps_shared_memory_and_cuda_ipc_refuses_cpu_weights():
    base, other = tiny_model(seed=0).cuda(), tiny_model(seed=5).cuda()
    reference = InProcessEngine(other, shares_training_model=False, weight_version=1)
    with ProcessEngine.from_model(base, device="cuda:0", weights_transport="shared_memory") as engine:
        trio.run(engine.load_weights, model_tensors(other, keep_device=True), 1)
        assert _tokens(engine) == _tokens(reference)
        assert engine._child.weights_file.stat().st_size > 0  # through the host, as asked
    with ProcessEngine.from_model(base, device="cuda:0", weights_transport="cuda_ipc") as engine:
        with pytest.raises(ValueError, match="needs every tensor on the engine's device cuda:0"):
            trio.run(engine.load_weights, model_tensors(other), 1)  # on CPU
        assert trio.run(engine.health)  # refused before anything was sent
