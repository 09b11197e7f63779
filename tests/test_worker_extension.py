"""The vLLM worker extension (run here on a stand-in worker): chunked updates apply whole or not at all."""

import types

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rollouts.sync.fingerprint import fingerprint, fingerprint_dir
from rollouts.sync.vllm import tensor_rpc_bodies
from rollouts.sync.worker_extension import SafetensorsWeightLoader


class StandInWorker(SafetensorsWeightLoader):
    """What the extension needs from vLLM's Worker: the model directory and reload_weights."""

    def __init__(self, model_dir, fail_reload=False):
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(model=str(model_dir)))
        self.loaded = None
        self.fail_reload = fail_reload

    def reload_weights(self, weights_iterator):
        weights = {k: v.tolist() for k, v in weights_iterator}
        if self.fail_reload:
            raise RuntimeError("reload failed")
        self.loaded = weights


@pytest.fixture
def worker(tmp_path):
    save_file({name: torch.zeros(4) for name in "abc"}, str(tmp_path / "model.safetensors"))
    return StandInWorker(tmp_path)


def _send(worker, tensors, chunk_bytes=1 << 20):
    for body in tensor_rpc_bodies(tensors, chunk_bytes=chunk_bytes):
        worker.rollouts_load_weights(**body["kwargs"])


def test_a_chunked_update_applies_all_its_tensors_at_its_last_chunk(worker):
    bodies = tensor_rpc_bodies({"a": np.full(4, 1.0, np.float32), "b": np.full(4, 2.0, np.float32)}, chunk_bytes=16)
    assert [(b["kwargs"]["first"], b["kwargs"]["apply"]) for b in bodies] == [("1", "0"), ("0", "1")]
    assert worker.rollouts_load_weights(**bodies[0]["kwargs"])["applied"] is False
    assert worker.loaded is None
    worker.rollouts_load_weights(**bodies[1]["kwargs"])
    assert worker.loaded == {"a": [1.0] * 4, "b": [2.0] * 4, "c": [0.0] * 4}


@pytest.mark.parametrize("chunk_bytes", [16, 1 << 20], ids=["across-chunks", "one-request"])
def test_a_failed_update_never_leaks_into_the_next(worker, chunk_bytes):
    with pytest.raises(ValueError, match=r"tensor 'c' has shape \(5,\)"):
        _send(worker, {"a": np.full(4, 9.0, np.float32), "c": np.full(5, 9.0, np.float32)}, chunk_bytes)
    _send(worker, {"b": np.full(4, 2.0, np.float32)})
    assert worker.loaded == {"a": [0.0] * 4, "b": [2.0] * 4, "c": [0.0] * 4}


def test_an_update_abandoned_mid_way_is_dropped_by_the_next_first_chunk(worker):
    bodies = tensor_rpc_bodies({"a": np.full(4, 9.0, np.float32), "b": np.full(4, 9.0, np.float32)}, chunk_bytes=16)
    worker.rollouts_load_weights(**bodies[0]["kwargs"])  # the sender gave up after this chunk
    _send(worker, {"c": np.full(4, 3.0, np.float32)})
    assert worker.loaded == {"a": [0.0] * 4, "b": [0.0] * 4, "c": [3.0] * 4}


def test_a_failed_reload_keeps_the_cached_weights(tmp_path):
    save_file({name: torch.zeros(4) for name in "abc"}, str(tmp_path / "model.safetensors"))
    worker = StandInWorker(tmp_path, fail_reload=True)
    with pytest.raises(RuntimeError, match="reload failed"):
        _send(worker, {"a": np.full(4, 9.0, np.float32)})
    worker.fail_reload = False
    _send(worker, {"b": np.full(4, 2.0, np.float32)})
    assert worker.loaded == {"a": [0.0] * 4, "b": [2.0] * 4, "c": [0.0] * 4}


def test_each_load_answers_the_checksums_of_what_the_worker_received(worker):
    sent = {"a": torch.randn(4, dtype=torch.bfloat16), "b": torch.randn(4)}
    (body,) = tensor_rpc_bodies(sent, chunk_bytes=1 << 20)
    answer = worker.rollouts_load_weights(**body["kwargs"])
    assert answer["checksums"] == fingerprint(sent)
    assert worker.loaded["a"] == sent["a"].float().tolist()  # bf16 sent as bf16, cast by the loader


def test_the_fault_hook_corrupts_the_named_tensor_after_receipt(worker, monkeypatch):
    monkeypatch.setenv("ROLLOUTS_SYNC_FAULT", "corrupt:b")
    sent = {"a": torch.ones(4), "b": torch.ones(4)}
    (body,) = tensor_rpc_bodies(sent, chunk_bytes=1 << 20)
    answer = worker.rollouts_load_weights(**body["kwargs"])
    expected = fingerprint(sent)
    assert answer["checksums"]["a"] == expected["a"] and answer["checksums"]["b"] != expected["b"]
    assert worker.loaded["b"] != [1.0] * 4  # the corruption reached the model, as a real fault would


def test_the_fingerprint_rpc_reads_the_checkpoint_a_disk_reload_loaded(worker, tmp_path):
    directory = tmp_path / "v1"
    directory.mkdir()
    save_file({"a": torch.randn(4, dtype=torch.bfloat16), "c": torch.randn(4)}, str(directory / "model.safetensors"))
    assert worker.rollouts_fingerprint(str(directory)) == {"checksums": fingerprint_dir(directory)}


def _receive_held(worker, how, tensors, root, token="sync-1"):
    """`tensors` received, held under `token`, by an inline update or a disk read (a checkpoint in `root`)."""
    if how == "inline":
        (body,) = tensor_rpc_bodies(tensors, chunk_bytes=1 << 20)
        return worker.rollouts_load_weights(**body["kwargs"], hold=token)
    root.mkdir(exist_ok=True)
    directory = root / f"v{len(list(root.iterdir()))}"
    directory.mkdir()
    save_file({**{n: torch.zeros(4) for n in "abc"}, **tensors}, str(directory / "model.safetensors"))
    return worker.rollouts_load_dir(str(directory), hold=token)


@pytest.mark.parametrize("how", ["inline", "dir"])
def test_a_held_receive_loads_only_when_committed_and_a_discard_or_the_next_receive_drops_it(worker, how, tmp_path):
    """An attested sync: the checksums come back with nothing loaded; its commit loads, its discard
    drops; another sync's token does neither."""
    root = tmp_path / "dirs"
    answer = _receive_held(worker, how, {"a": torch.full((4,), 1.0)}, root)
    assert answer["held"] is True and answer["checksums"]["a"] == fingerprint({"a": torch.full((4,), 1.0)})["a"]
    assert worker.loaded is None
    assert worker.rollouts_discard("sync-0") == {"num_tensors": 0}  # another sync's: left held
    with pytest.raises(RuntimeError, match="commit of receive 'sync-0': the one held is 'sync-1'"):
        worker.rollouts_commit("sync-0")
    assert worker.rollouts_commit("sync-1")["num_tensors"] >= 1
    assert worker.loaded["a"] == [1.0] * 4
    with pytest.raises(RuntimeError, match="none is held"):
        worker.rollouts_commit("sync-1")  # a commit loads once

    _receive_held(worker, how, {"a": torch.full((4,), 2.0)}, root, token="sync-2")
    assert worker.rollouts_discard("sync-2")["num_tensors"] >= 1
    with pytest.raises(RuntimeError, match="none is held"):
        worker.rollouts_commit("sync-2")
    assert worker.loaded["a"] == [1.0] * 4  # the discarded weights were never loaded

    _receive_held(worker, how, {"a": torch.full((4,), 3.0)}, root, token="sync-3")
    _send(worker, {"b": torch.full((4,), 4.0).numpy()})  # the next sync, unattested: the held one is gone
    with pytest.raises(RuntimeError, match="none is held"):
        worker.rollouts_commit("sync-3")
    assert worker.loaded["a"] == [1.0] * 4 and worker.loaded["b"] == [4.0] * 4
