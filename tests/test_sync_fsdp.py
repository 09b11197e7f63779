"""FSDP2 on two gloo ranks syncs to one engine by broadcast through the RL loop's `sync_engine`:
each bucket gathered on both ranks as rank 0 sends it, never more than one bucket held."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

_TORCHRUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_fsdp")
    worker = Path(__file__).parent / "sync_fsdp_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(worker), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_TORCHRUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_engine_loads_the_unsharded_models_weights_bit_for_bit(ranks):
    out, records = ranks
    loaded, full = load_file(str(out / "engine.safetensors")), load_file(str(out / "full.safetensors"))
    assert records[0]["dtypes"] == ["torch.bfloat16"]  # sent in the trainer's dtype (bf16 -> float32 is exact)
    # the tied lm_head is the embeddings: sent once, as a one-process export does
    assert full["lm_head.weight"].equal(full["model.embed_tokens.weight"])
    assert sorted(loaded) == sorted(n for n in full if n != "lm_head.weight")
    for name, tensor in loaded.items():
        assert tensor.equal(full[name]), name
    assert all(r["metrics"]["sync_export_s"] == 0.0 for r in records)  # nothing was written to disk
    assert not (out / "weights").exists()


def test_a_pool_of_two_engines_loads_the_same_weights_from_one_gather_per_bucket(ranks):
    out, records = ranks
    full = load_file(str(out / "full.safetensors"))
    for i in range(2):
        loaded = load_file(str(out / f"pool{i}.safetensors"))
        assert sorted(loaded) == sorted(n for n in full if n != "lm_head.weight")
        for name, tensor in loaded.items():
            assert tensor.equal(full[name]), (i, name)
    for record in records:
        assert record["pool_metrics"]["sync_export_s"] == 0.0
        assert 0 < record["pool_metrics"]["sync_gathered_bytes_max"] <= record["bucket_bytes_max"]


def test_no_rank_holds_more_than_one_bucket_of_gathered_weights(ranks):
    _, records = ranks
    for record in records:
        assert record["num_buckets"] > 2
        peak = record["metrics"]["sync_gathered_bytes_max"]
        assert 0 < peak <= record["bucket_bytes_max"] < record["total_bytes"]
        # the count sees what a consumer keeps: every bucket, until it drops them
        assert record["kept_peak_bytes"] == record["kept_held_bytes"] == record["total_bytes"]
        assert record["kept_held_after_drop"] == 0


def test_an_engine_that_cannot_join_fails_rank_0_and_leaves_no_rank_waiting(ranks):
    _, records = ranks
    assert "did not join" in records[0]["no_engine"] and "127.0.0.1:9" in records[0]["no_engine"]
    assert records[1]["no_engine"] == "returned"
