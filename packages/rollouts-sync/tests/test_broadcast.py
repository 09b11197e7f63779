"""The broadcast transport without an engine: the bucket plan, the worker extension's receive (on a
stand-in worker), and SGLang's path against the fake server (a gloo group on loopback)."""

from __future__ import annotations

import tempfile
import threading
import time
import types
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")  # the `broadcast` extra
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rollouts.sync import HTTPOptions, SGLangEngine, WeightSyncError  # noqa: E402
from rollouts.sync.broadcast import BroadcastSync  # noqa: E402
from rollouts.sync.broadcast_group import join_group  # noqa: E402
from rollouts.sync.broadcast_wire import (  # noqa: E402
    ALIGN_BYTES,
    SMALL_TENSOR_BYTES,
    BroadcastOptions,
    bucket_pieces,
    plan_buckets,
)
from rollouts.sync.fake_http import Fault  # noqa: E402
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine  # noqa: E402
from rollouts.sync.fingerprint_torch import checksum_torch  # noqa: E402
from rollouts.sync.worker_extension import SafetensorsWeightLoader  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    """Trio alone here: the transport's async code is anyio's (both loops are covered by the other
    sync tests), and its failure tests each wait out a bound."""
    return "trio"


FAST = BroadcastOptions(bucket_bytes=1024, setup_timeout_s=30.0, bucket_timeout_s=5.0, load_timeout_s=30.0)

shapes = st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=3), min_size=1, max_size=12)


@settings(deadline=None, max_examples=60)
@given(shapes=shapes, dtypes=st.data(), bucket_bytes=st.integers(1, 600))
def test_a_plan_holds_every_tensor_once_in_order_at_aligned_offsets(shapes, dtypes, bucket_bytes):
    kinds = [dtypes.draw(st.sampled_from(["float32", "bfloat16", "int64", "uint8"])) for _ in shapes]
    specs = [(f"t{i}", kind, shape) for i, (kind, shape) in enumerate(zip(kinds, shapes, strict=True))]
    plan = plan_buckets(specs, bucket_bytes=bucket_bytes, weight_version=3)
    assert plan.names() == [name for name, _, _ in specs]
    for k, bucket in enumerate(plan.buckets):
        assert len(bucket) == 1 or plan.bucket_bytes(k) <= bucket_bytes  # only a lone tensor may exceed it
        end = 0
        for spec in bucket:
            assert spec.offset % ALIGN_BYTES == 0 and spec.offset >= end
            end = spec.offset + spec.num_bytes
    assert plan.num_bytes == sum(int(np.prod(s, dtype=np.int64)) * {"float32": 4, "bfloat16": 2, "int64": 8, "uint8": 1}[k] for k, s in zip(kinds, shapes, strict=True))  # fmt: skip


@settings(deadline=None, max_examples=60)
@given(
    sizes=st.lists(
        st.sampled_from([1, 7, SMALL_TENSOR_BYTES - 1, SMALL_TENSOR_BYTES, 3 << 20]), min_size=1, max_size=12
    )
)
def test_the_pieces_of_a_bucket_send_each_tensor_once_in_order_and_pack_only_small_ones(sizes):
    """What fills a flat bucket: every tensor in one piece, in order, byte ranges that follow each
    other; a piece of several tensors holds small ones only. flat_pieces gives each piece's bytes."""
    specs = [(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    (bucket,) = plan_buckets(specs, bucket_bytes=sum(sizes) + ALIGN_BYTES * len(sizes), weight_version=0).buckets
    pieces = bucket_pieces(bucket)
    assert [spec for piece in pieces for spec in piece] == list(bucket)
    assert all(len(p) == 1 or all(s.num_bytes < SMALL_TENSOR_BYTES for s in p) for p in pieces)
    tensors = [torch.full((n,), i % 251, dtype=torch.uint8) for i, n in enumerate(sizes)]
    from rollouts.sync.broadcast_pieces import flat_pieces

    buffer = torch.zeros(plan_bytes := bucket[-1].offset + bucket[-1].num_bytes, dtype=torch.uint8)
    for piece, data in zip(pieces, flat_pieces(bucket, tensors), strict=True):
        start, end = piece[0].offset, piece[-1].offset + piece[-1].num_bytes
        assert data.numel() == end - start <= plan_bytes
        buffer[start:end] = data  # what the engine's broadcast into buffer[start:end] receives
    for spec, tensor in zip(bucket, tensors, strict=True):
        assert torch.equal(buffer[spec.offset : spec.offset + spec.num_bytes], tensor)
    big = [data for piece, data in zip(pieces, flat_pieces(bucket, tensors), strict=True) if len(piece) == 1]
    for data, piece in zip(big, [p for p in pieces if len(p) == 1], strict=True):  # no copy: the tensor itself
        assert data.data_ptr() == tensors[bucket.index(piece[0])].data_ptr()


@settings(deadline=None, max_examples=60)
@given(
    sizes=st.lists(st.sampled_from([1, 7, 64, SMALL_TENSOR_BYTES - 1, SMALL_TENSOR_BYTES + 5]), min_size=1, max_size=8),
    kinds=st.data(),
)
def test_a_bucket_laid_out_on_the_host_sends_the_same_bytes_from_one_reused_buffer(sizes, kinds):
    """A GPU's bucket for a gloo group goes through HostStaging: each tensor at its planned offset of
    one buffer, its views equal to the tensors, and the pieces sent are slices of that buffer with the
    bytes the tensors' own pieces carry; the buffer is kept for every later bucket that fits."""
    from rollouts.sync.broadcast_pieces import HostStaging, flat_pieces, needs_host_copy

    dtypes = [kinds.draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32])) for _ in sizes]
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 255, (max(1, n // d.itemsize),), generator=g).to(d) for n, d in zip(sizes, dtypes, strict=True)
    ]
    specs = [(f"t{i}", str(t.dtype)[6:], tuple(t.shape)) for i, t in enumerate(tensors)]
    (bucket,) = plan_buckets(specs, bucket_bytes=sum(sizes) * 2 + ALIGN_BYTES * len(sizes), weight_version=0).buckets
    staging = HostStaging()
    flat = staging.fill(bucket, tensors)
    assert all(torch.equal(v, t) for v, t in zip(staging.views(bucket, flat), tensors, strict=True))
    sent = zip(
        bucket_pieces(bucket), flat_pieces(bucket, tensors, flat=flat), flat_pieces(bucket, tensors), strict=True
    )
    for piece, staged, own in sent:
        start = piece[0].offset
        assert staged.numel() == own.numel() and staged.data_ptr() == flat.data_ptr() + start  # a slice: no copy
        for spec in piece:  # each tensor's bytes (the alignment gaps between them carry nothing)
            a, b = spec.offset - start, spec.offset - start + spec.num_bytes
            assert torch.equal(staged[a:b], own[a:b])
    memory = flat.data_ptr()
    assert staging.fill(bucket[:1], tensors[:1]).data_ptr() == memory  # a smaller bucket: the same buffer
    assert not needs_host_copy(tensors, torch.device("cpu"))
    assert needs_host_copy([t.to("meta") for t in tensors], torch.device("cpu"))  # another device's, for gloo
    assert not needs_host_copy(tensors, torch.device("cuda", 0))  # for NCCL: moved to the GPU, not staged


@pytest.mark.anyio
async def test_a_bucket_from_another_device_is_sent_through_the_host_buffer(monkeypatch):
    """The push of a GPU trainer's weights over gloo, its host copy forced here: the engine gets every
    tensor in its dtype, sync after sync through one buffer."""
    import rollouts.sync.broadcast as broadcast

    monkeypatch.setattr(broadcast, "needs_host_copy", lambda tensors, device: True)
    state = FakeEngineState(weights=_fake_weights())
    async with serve_fake_engine(state) as server, SGLangEngine(server.url) as engine:
        sync = BroadcastSync(FAST)
        await sync.connect([engine])
        memory = []
        for version in (1, 2):
            new = {"w": torch.randn(64, 32), "b": torch.randn(32).bfloat16()}
            await sync.push(new, version)
            np.testing.assert_array_equal(state.weights["w"], new["w"].numpy())
            np.testing.assert_array_equal(state.weights["b"], new["b"].float().numpy())
            memory.append(sync._staging._buffer.data_ptr())
        assert memory[0] == memory[1]


def test_a_plan_refuses_what_an_engine_could_not_allocate():
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        plan_buckets([("w", "complex64", (2,))], bucket_bytes=64, weight_version=0)
    with pytest.raises(ValueError, match="unique"):
        plan_buckets([("w", "float32", (2,)), ("w", "float32", (2,))], bucket_bytes=64, weight_version=0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        BroadcastOptions(bucket_bytes=0)
    with pytest.raises(ValueError, match="bucket_timeout_s"):
        BroadcastOptions(bucket_timeout_s=float("inf"))


class StandInWorker(SafetensorsWeightLoader):
    """What the extension needs from vLLM's Worker: its rank, the model directory and reload_weights."""

    def __init__(self, model_dir):
        self.rank = 0
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(model=str(model_dir)))
        self.loaded = None

    def reload_weights(self, weights_iterator):
        self.loaded = {k: v.clone() for k, v in weights_iterator}


def _trainer_sends(store, plans, tensors, *, stops):
    """The trainer's side: join group "g" on `store` (the trainer's own, as in a run: its server lives
    as long as this thread holds it, so the trainer's join never outlives it), then send each plan's
    buckets of its tensors, stopping before bucket `stops[i]` of plan i (the trainer died there) where
    it is not None."""
    group = join_group(
        store,
        group="g",
        rank=0,
        world_size=2,
        backend="gloo",
        address="127.0.0.1",
        setup_timeout_s=30.0,
        bucket_timeout_s=30.0,
    )
    from rollouts.sync.broadcast_group import broadcast_from_trainer
    from rollouts.sync.broadcast_pieces import flat_pieces

    for plan, named, stop in zip(plans, tensors, stops, strict=True):
        for k, bucket in enumerate(plan.buckets):
            if k == stop:
                return  # the trainer died here
            for piece in flat_pieces(bucket, [named[s.name] for s in bucket]):
                broadcast_from_trainer(group, piece)


@pytest.fixture
def worker(tmp_path):
    weights = {
        "a": torch.zeros(3, 5),
        "b": torch.zeros(7),
        "big": torch.zeros(513, 512),
        "c": torch.zeros(2, 2),
        "d": torch.zeros(300, 512),
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    return StandInWorker(tmp_path)


def _trainer_and_worker(worker, plans, sends, stops, *, bucket_timeout_s: float = 30.0) -> threading.Thread:
    """The trainer's thread sending `plans` (see _trainer_sends), started, with `worker` joined to it
    (each of its receives bounded by `bucket_timeout_s`: a trainer that died breaks the connection, so
    the bound is hit only by one that hangs)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    trainer = threading.Thread(target=_trainer_sends, args=(store, plans, sends), kwargs={"stops": stops})
    trainer.start()
    _join_worker(worker, store, bucket_timeout_s=bucket_timeout_s)
    return trainer


def _join_worker(worker, store, *, bucket_timeout_s: float = 2.0):
    worker.rollouts_init_broadcast(
        host="127.0.0.1",
        port=str(store.port),
        group="g",
        rank_offset="1",
        world_size="2",
        backend="gloo",
        setup_timeout_s="30",
        bucket_timeout_s=str(bucket_timeout_s),
    )


@pytest.mark.parametrize("stop_after_buckets", [None, 1], ids=["all-buckets", "trainer-dies-mid-way"])
def test_the_worker_extension_loads_only_once_every_bucket_arrived(worker, stop_after_buckets):
    """bf16 stays bf16 on the wire; a trainer that stops after one bucket leaves the weights as they
    were, and the worker's wait ends within the bucket timeout, saying so."""
    tensors = {
        "a": torch.randn(3, 5).bfloat16(),
        "b": torch.randn(7),
        "big": torch.randn(513, 512),  # over SMALL_TENSOR_BYTES: a broadcast of its own, no copy
        "c": torch.randn(2, 2),
        "d": torch.randn(300, 512),
    }
    plan = plan_buckets(
        [(n, str(t.dtype)[6:], tuple(t.shape)) for n, t in tensors.items()], bucket_bytes=3 << 19, weight_version=1
    )
    assert [[s.name for s in piece] for piece in bucket_pieces(plan.buckets[0])] == [["a", "b"], ["big"], ["c"]]
    assert [[s.name for s in bucket] for bucket in plan.buckets[1:]] == [["d"]]
    trainer = _trainer_and_worker(worker, [plan], [tensors], [stop_after_buckets], bucket_timeout_s=2.0)
    if stop_after_buckets is None:
        answer = worker.rollouts_receive_broadcast(plan.to_json())
        assert answer["num_tensors"] == 5
        assert answer["checksums"] == {n: checksum_torch(t) for n, t in tensors.items()}  # what attestation compares
        assert all(torch.equal(worker.loaded[n], t) and worker.loaded[n].dtype == t.dtype for n, t in tensors.items())
    else:
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            worker.rollouts_receive_broadcast(plan.to_json())
        assert time.monotonic() - start < 2.0 + 5.0  # the bucket timeout, with room for a loaded machine
        assert worker.loaded is None
    trainer.join(timeout=30)


@pytest.mark.parametrize("stop_after_buckets", [None, 1], ids=["all-buckets", "trainer-dies-mid-way"])
def test_buckets_held_on_the_host_arrive_through_one_buckets_room(worker, monkeypatch, stop_after_buckets):
    """The path of an NCCL sync without room on the GPU (here on gloo, the staging forced): each
    bucket lands in one bucket-sized buffer, is summed there (a fault injected first, so the sum is
    of what the model gets) and copied out to the host before the next bucket reuses the room; the
    load sees every tensor as sent, and a trainer dying mid-way leaves the weights as they were."""
    import rollouts.sync.worker_extension as extension

    monkeypatch.setattr(extension, "stage_on_host", lambda device, stage, num_bytes: stage == "host")
    monkeypatch.setenv("ROLLOUTS_SYNC_FAULT", "corrupt:c")
    tensors = {"a": torch.randn(3, 5), "big": torch.randn(513, 512), "c": torch.randn(2, 2)}
    tensors["d"] = torch.randn(300, 512)
    plan = plan_buckets(
        [(n, "float32", tuple(t.shape)) for n, t in tensors.items()], bucket_bytes=1024, weight_version=1
    )
    sizes = [plan.bucket_bytes(k) for k in range(len(plan.buckets))]
    assert len(sizes) == 4 and len(set(sizes)) > 1
    assert '"stage": "host"' in plan.to_json(stage="host") and "stage" not in plan.to_json()
    allocated = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or empty(*a, **k))
    trainer = _trainer_and_worker(worker, [plan], [tensors], [stop_after_buckets])
    if stop_after_buckets is None:
        answer = worker.rollouts_receive_broadcast(plan.to_json(stage="host"))
        trainer.join(timeout=30)
        assert (max(sizes),) in allocated  # one bucket's room: receive_flat_buckets allocated none
        assert all(torch.equal(worker.loaded[n], t) for n, t in tensors.items() if n != "c")
        assert not torch.equal(worker.loaded["c"], tensors["c"])  # the injected fault reached the model
        sent = {n: checksum_torch(t) for n, t in tensors.items()}
        assert answer["checksums"] == {**sent, "c": checksum_torch(worker.loaded["c"])}
    else:
        with pytest.raises(RuntimeError):
            worker.rollouts_receive_broadcast(plan.to_json(stage="host"))
        trainer.join(timeout=30)
        assert worker.loaded is None


def test_where_buckets_wait_for_the_load_follows_the_gpus_room(monkeypatch):
    """ "auto" holds an NCCL sync on the GPU only when every bucket fits beside a headroom, counting
    what torch's allocator holds free; gloo's buckets are on the host already."""
    from rollouts.sync.worker_receive import DEVICE_HEADROOM_BYTES, stage_on_host

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * gib)  # 1 GiB held free
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    room = 7 * gib - DEVICE_HEADROOM_BYTES
    assert not stage_on_host(gpu, "auto", room) and stage_on_host(gpu, "auto", room + 1)
    assert stage_on_host(gpu, "host", 1) and not stage_on_host(gpu, "device", 100 * gib)
    assert not any(stage_on_host(cpu, stage, 100 * gib) for stage in ("auto", "device", "host"))
    with pytest.raises(ValueError, match="stage must be 'auto', 'device' or 'host', got 'disk'"):
        stage_on_host(gpu, "disk", 1)
    with pytest.raises(ValueError, match="BroadcastOptions.stage"):
        BroadcastOptions(stage="gpu")


def test_an_unattested_broadcast_loads_and_sums_nothing(worker):
    """A plan sent with checksums=False (BroadcastOptions(attest=False)) says so, and the worker
    loads every bucket without summing any."""
    tensors = {"a": torch.randn(3, 5).bfloat16(), "big": torch.randn(513, 512)}
    plan = plan_buckets(
        [(n, str(t.dtype)[6:], tuple(t.shape)) for n, t in tensors.items()], bucket_bytes=1024, weight_version=1
    )
    assert "checksums" not in plan.to_json() and '"checksums": false' in plan.to_json(checksums=False)
    trainer = _trainer_and_worker(worker, [plan], [tensors], [None])
    answer = worker.rollouts_receive_broadcast(plan.to_json(checksums=False))
    trainer.join(timeout=30)
    assert answer["checksums"] == {}
    assert all(torch.equal(worker.loaded[n], t) for n, t in tensors.items())


def test_syncs_reuse_one_receive_buffer_and_the_cache_never_holds_a_view_of_it(worker):
    """Every sync receives into the same host memory (no page mapped afresh per sync), and what the
    worker keeps of a sync outlives the next one overwriting that memory: a partial sync after a full
    one leaves the other tensors as the full one sent, and a trainer dying mid-way through a third
    (its first bucket already written over the buffer) leaves what the worker keeps as it was."""
    full = {"a": torch.randn(3, 5), "b": torch.randn(7), "big": torch.randn(513, 512), "c": torch.randn(2, 2)}
    full["d"] = torch.randn(300, 512)
    partial = {"big": torch.randn(513, 512)}
    dying = {"a": torch.randn(3, 5), "d": torch.randn(300, 512)}
    sends, bucket_sizes = [full, partial, dying], [3 << 19, 3 << 19, 1024]
    plans = [
        plan_buckets([(n, "float32", tuple(t.shape)) for n, t in named.items()], bucket_bytes=size, weight_version=v)
        for v, (named, size) in enumerate(zip(sends, bucket_sizes, strict=True), start=1)
    ]
    assert len(plans[2].buckets) == 2
    trainer = _trainer_and_worker(worker, plans, sends, [None, None, 1])
    worker.rollouts_receive_broadcast(plans[0].to_json())
    memory = worker._rollouts_receive_buffer._buffer.data_ptr()
    worker.rollouts_receive_broadcast(plans[1].to_json())  # "big" lands where "a", "b" and "big" were
    expected = {**full, **partial}
    assert all(torch.equal(worker.loaded[n], t) for n, t in expected.items())
    assert worker._rollouts_receive_buffer._buffer.data_ptr() == memory
    with pytest.raises(RuntimeError):
        worker.rollouts_receive_broadcast(plans[2].to_json())  # "a" arrives over the buffer, "d" never does
    trainer.join(timeout=30)
    assert all(torch.equal(worker.loaded[n], t) for n, t in expected.items())  # never reloaded
    kept = worker._rollouts_base_weights()  # what the next (partial) sync reloads the rest from
    assert all(torch.equal(kept[n], t) for n, t in expected.items())


@pytest.mark.parametrize("stop_after_buckets", [None, 1], ids=["all-buckets", "trainer-dies-mid-way"])
def test_an_adapter_is_written_for_vllm_only_once_every_bucket_arrived(
    worker, stop_after_buckets, tmp_path, monkeypatch
):
    """A LoRA adapter by broadcast, three versions: the worker writes PEFT's two files (the tensors as
    received, in their dtype, and the config) at one path per version under its host's temporary
    directory, keeps the two newest versions, and writes nothing when a bucket never arrives."""
    import json

    from safetensors.torch import load_file

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    adapters = [
        {
            "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 64).bfloat16(),
            "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 8).bfloat16(),
        }
        for _ in range(3)
    ]
    plans = [
        plan_buckets([(n, "bfloat16", tuple(t.shape)) for n, t in a.items()], bucket_bytes=1024, weight_version=v)
        for v, a in enumerate(adapters, start=1)
    ]
    assert all(len(plan.buckets) == 2 for plan in plans)
    stops = [None, None, stop_after_buckets]
    trainer = _trainer_and_worker(worker, plans, adapters, stops)
    token = "0123456789abcdef"  # the trainer's random draw
    root = tmp_path / f"rollouts-adapters-{token}"
    for plan, adapter, stop in zip(plans, adapters, stops, strict=True):
        if stop is not None:
            with pytest.raises(RuntimeError):
                worker.rollouts_receive_adapter(plan.to_json(), json.dumps(config), token)
            continue
        answer = worker.rollouts_receive_adapter(plan.to_json(), json.dumps(config), token)
        path = root / f"v{plan.weight_version}"
        assert answer["path"] == str(path)
        assert answer["checksums"] == {n: checksum_torch(t) for n, t in adapter.items()}
        written = load_file(str(path / "adapter_model.safetensors"))
        assert written.keys() == adapter.keys()
        assert all(torch.equal(written[n], t) and written[n].dtype == torch.bfloat16 for n, t in adapter.items())
        assert json.loads((path / "adapter_config.json").read_text()) == config
    trainer.join(timeout=30)
    kept = sorted(p.name for p in root.iterdir())
    assert kept == (["v2", "v3"] if stop_after_buckets is None else ["v1", "v2"])  # v3 never written
    assert not list(root.rglob("*.partial")) and root.stat().st_mode & 0o077 == 0  # this user's only
    assert worker.loaded is None  # an adapter leaves the base weights alone
    with pytest.raises(ValueError, match="token must be 16 lowercase hex digits"):
        worker.rollouts_receive_adapter(plans[0].to_json(), json.dumps(config), "../../etc")


def _fake_weights():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32)}


@pytest.mark.anyio
@pytest.mark.parametrize("sessions", [False, True], ids=["sglang-before-0.5.23", "sglang-0.5.23-sessions"])
async def test_sglang_broadcast_to_the_fake_server_delivers_every_tensor_in_its_dtype(sessions):
    """The fake joins the trainer's group as SGLang's worker does (its store prefixes and torch's group
    helper); with weight-update sessions (SGLang 0.5.23, which refuses an update outside one) each
    update is inside one, and a server without them (404) is updated without."""
    state = FakeEngineState(weights=_fake_weights(), sessions=sessions)
    new = {"w": torch.randn(64, 32), "b": torch.randn(32).bfloat16()}
    async with serve_fake_engine(state) as server, SGLangEngine(server.url) as engine:
        sync = BroadcastSync(FAST)
        await sync.connect([engine])
        result = await sync.push(new, 7)
        assert result.updated == (engine.name,) and await engine.weight_version() == 7
        np.testing.assert_array_equal(state.weights["w"], new["w"].numpy())
        np.testing.assert_array_equal(state.weights["b"], new["b"].float().numpy())  # received as bf16
        assert sync.last_num_bytes == 64 * 32 * 4 + 32 * 2
        await sync.push({"w": torch.zeros(64, 32)}, 8)  # a second sync on the same group
        assert not state.weights["w"].any() and await engine.weight_version() == 8
    paths = [target for _, target in state.calls]
    assert paths.count("/begin_weight_update") == (2 if sessions else 1)  # without: asked once, a 404
    assert paths.count("/end_weight_update") == (2 if sessions else 0) and not state.in_session


@pytest.mark.anyio
async def test_an_adapter_for_sglang_or_a_malformed_config_is_refused_before_anything_is_sent():
    state = FakeEngineState(weights=_fake_weights())
    async with serve_fake_engine(state) as server, SGLangEngine(server.url) as engine:
        sync = BroadcastSync(FAST)
        await sync.connect([engine])
        config = {"r": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
        with pytest.raises(ValueError, match=r"\(SGLang\) load LoRA adapters from a path only"):
            await sync.push({"w": torch.ones(64, 32)}, 1, adapter_config=config)
        with pytest.raises(ValueError, match="adapter_config must be PEFT's adapter_config.json"):
            await sync.push({"w": torch.ones(64, 32)}, 1, adapter_config={"rank": 8})
        assert state.weight_version == "default" and not state.paused
        assert (await sync.push({"w": torch.ones(64, 32)}, 2)).updated == (engine.name,)  # the group is intact
        assert (state.weights["w"] == 1).all()


@pytest.mark.anyio
async def test_an_engine_that_fails_mid_sync_is_named_and_the_others_load():
    healthy, failing = FakeEngineState(weights=_fake_weights()), FakeEngineState(weights=_fake_weights())
    before = {k: v.copy() for k, v in failing.weights.items()}
    new = {"w": torch.ones(64, 32), "b": torch.ones(32)}
    async with serve_fake_engine(healthy) as a, serve_fake_engine(failing) as b:
        http = HTTPOptions(timeout_s=20.0)
        async with SGLangEngine(a.url, http=http) as good, SGLangEngine(b.url, http=http) as bad:
            sync = BroadcastSync(FAST)
            await sync.connect([good, bad])
            failing.faults.append(Fault(path="/update_weights_from_distributed", kind="status", status=500))
            start = time.monotonic()
            with pytest.raises(WeightSyncError) as info:
                await sync.push(new, 1)
            assert time.monotonic() - start < FAST.bucket_timeout_s * 2 + 5.0
            assert info.value.updated == (good.name,)
            assert [f.engine for f in info.value.failures] == [bad.name]
            assert "HTTP 500" in str(info.value)
            assert (healthy.weights["w"] == 1).all() and await good.weight_version() == 1
            assert all((failing.weights[k] == before[k]).all() for k in before)  # old weights, whole
            with pytest.raises(WeightSyncError, match="connect again"):  # its group is never reused
                await sync.push(new, 2)


@pytest.mark.anyio
async def test_an_engine_that_never_joins_is_named_within_the_setup_timeout():
    state = FakeEngineState(weights=_fake_weights())
    state.faults.append(Fault(path="/init_weights_update_group", kind="delay", delay_s=30.0))
    async with serve_fake_engine(state) as server, SGLangEngine(server.url) as engine:
        sync = BroadcastSync(BroadcastOptions(setup_timeout_s=1.0))
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="did not join") as info:
            await sync.connect([engine])
        assert time.monotonic() - start < 1.0 + 5.0
        assert info.value.failures[0].engine == engine.name


@pytest.mark.anyio
async def test_a_connect_releases_the_groups_of_the_one_before(monkeypatch):
    """Each connect makes new groups; the old ones' connections (an NCCL communicator's GPU memory) go first."""
    import rollouts.sync.broadcast as broadcast_module

    closed = []
    real = broadcast_module.close_group
    monkeypatch.setattr(broadcast_module, "close_group", lambda group: (closed.append(group), real(group)))
    state = FakeEngineState(weights=_fake_weights())
    async with serve_fake_engine(state) as server, SGLangEngine(server.url) as engine:
        sync = BroadcastSync(FAST)
        await sync.connect([engine])
        first = sync._links[0].group
        await sync.push({"w": torch.ones(64, 32)}, 1)
        await sync.connect([engine])
        assert closed == [first] and sync._links[0].group is not first
        await sync.push({"w": torch.full((64, 32), 2.0)}, 2)
        assert (state.weights["w"] == 2).all() and await engine.weight_version() == 2


@pytest.mark.anyio
async def test_connect_again_after_a_broken_group_syncs_again():
    state = FakeEngineState(weights=_fake_weights())
    async with serve_fake_engine(state) as server, SGLangEngine(server.url) as engine:
        sync = BroadcastSync(FAST)
        await sync.connect([engine])
        state.faults.append(Fault(path="/update_weights_from_distributed", kind="status", status=500))
        with pytest.raises(WeightSyncError):
            await sync.push({"w": torch.ones(64, 32)}, 1)
        assert not sync.connected
        await sync.connect([engine])  # fresh group names on the same store
        assert sync.connected
        await sync.push({"w": torch.ones(64, 32)}, 2)
        assert (state.weights["w"] == 1).all() and await engine.weight_version() == 2
    # the server's old group was destroyed before the new one was made (its communicator released)
    assert [t for _, t in state.calls].count("/destroy_weights_update_group") == 1


class _Answers:
    """A VLLMEngine's `_call` stood in for: records each /collective_rpc body, answers one worker."""

    def __init__(self):
        self.bodies = []

    async def __call__(self, method, path, *, json=None, **kwargs):
        import httpx

        if path == "/collective_rpc":
            self.bodies.append(json)
        return httpx.Response(200, json={"results": [{"checksums": {}}]})


@pytest.mark.anyio
@pytest.mark.parametrize("attest", [True, False])
async def test_vllm_receives_are_held_only_when_attested_and_commit_or_discard_name_their_token(attest):
    from rollouts.sync import VLLMEngine
    from rollouts.sync.broadcast_receivers import VLLMReceiver

    plan = plan_buckets([("a", "float32", (4,))], bucket_bytes=1 << 20, weight_version=3)
    options = BroadcastOptions(attest=attest)
    async with VLLMEngine("http://127.0.0.1:9", http=HTTPOptions(timeout_s=1.0)) as engine:
        engine._call = answers = _Answers()
        receiver = VLLMReceiver(engine)
        await receiver.receive(plan, options)
        await receiver.finish(3)
        await receiver.receive(plan, options)
        await receiver.reject()
    methods = [(b["method"], b["kwargs"].get("hold"), b["kwargs"].get("token")) for b in answers.bodies]
    if not attest:  # as before attestation held anything: no hold, no commit, nothing to discard
        assert methods == [("rollouts_receive_broadcast", None, None)] * 2
        return
    (first, _, _), (commit, _, committed), (second, _, _), (discard, _, discarded) = methods
    holds = [m[1] for m in methods if m[0] == "rollouts_receive_broadcast"]
    assert (first, commit, second, discard) == (
        "rollouts_receive_broadcast",
        "rollouts_commit",
        "rollouts_receive_broadcast",
        "rollouts_discard",
    )
    assert holds == [committed, discarded] and committed != discarded  # each sync its own token
