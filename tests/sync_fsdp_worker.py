"""Run under `torchrun --nproc_per_node 2` (gloo): the RL loop's engine sync (`sync_engine`) of an
FSDP2-sharded bf16 model to the fake SGLang server by broadcast, each bucket gathered on both ranks
as rank 0 sends it. Argument: OUT_DIR.

Writes OUT_DIR/rank<r>.json on each rank (the sync's metrics, the largest planned bucket, what a
consumer that keeps every bucket holds, how the sync to an engine that cannot join ended) and, on
rank 0, OUT_DIR/engine.safetensors (what the engine loaded, as float32: exact for bf16),
OUT_DIR/pool0.safetensors and pool1.safetensors (what each engine of a two-engine BroadcastPool
loaded) and OUT_DIR/full.safetensors (the unsharded model's weights, gathered whole by `model_tensors`).
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import trio
from safetensors.torch import save_file

from rollouts.backends import WeightBuckets, build_components, shard_model
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.backends.train.distributed import close_process_group
from rollouts.loops.engines.broadcast import BroadcastPool, BroadcastWeights
from rollouts.loops.engines.remote import BoundedSync
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.generation import sync_engine
from rollouts.sync import BroadcastOptions, HTTPOptions, RetryPolicy, SGLangEngine
from rollouts.sync.broadcast_wire import plan_buckets
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.types import OptimizerConfig, TrainingState

BUCKET_BYTES = 8192  # the tiny model's embeddings (64 x 64 bf16) fill one bucket: several buckets
OPTIONS = BroadcastOptions(bucket_bytes=BUCKET_BYTES, setup_timeout_s=60.0, bucket_timeout_s=60.0)
HTTP = HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0))


def sharded_components():
    model = build_tiny_model(64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model = shard_model(model.to(torch.bfloat16))
    return build_components(model, OptimizerConfig(), num_training_steps=1)


def engine_for(url):
    return BoundedSync(
        BroadcastWeights(SGLangEngine(url, http=HTTP), OPTIONS, sync_timeout_s=60.0), sync_timeout_s=60.0
    )


async def sync(components, engine, version, run_dir):
    state = TrainingState().with_weight_version(version - 1)
    _, metrics = await sync_engine(components, engine, state, run_dir, shares_model=False, lock=trio.Lock())
    return metrics


async def sync_to_fake(components, names, run_dir):
    """Rank 0: the sync to a fake SGLang server holding zeros; returns its metrics and the weights loaded."""
    state = FakeEngineState(weights={n: np.zeros(1, np.float32) for n in names})
    async with serve_fake_engine(state) as server:
        metrics = await sync(components, engine_for(server.url), 1, run_dir)
    assert state.weight_version == "1", state.weight_version
    return metrics, {n: torch.from_numpy(np.asarray(a, np.float32)) for n, a in state.weights.items()}


async def sync_to_pool(components, names, run_dir, out):
    """Rank 0: the sync to two fake SGLang servers behind one BroadcastPool (each bucket gathered
    once, sent to both); writes what each loaded to OUT_DIR/pool<i>.safetensors."""
    states = [FakeEngineState(weights={n: np.zeros(1, np.float32) for n in names}) for _ in range(2)]
    async with serve_fake_engine(states[0]) as a, serve_fake_engine(states[1]) as b:
        pool = BroadcastPool(
            [SGLangEngine(a.url, http=HTTP), SGLangEngine(b.url, http=HTTP)], OPTIONS, sync_timeout_s=60.0
        )
        metrics = await sync(components, pool, 3, run_dir)
    for i, state in enumerate(states):
        assert state.weight_version == "3", state.weight_version
        save_file(
            {n: torch.from_numpy(np.asarray(a, np.float32)) for n, a in state.weights.items()},
            str(out / f"pool{i}.safetensors"),
        )
    return metrics


async def sync_to_nobody(components, run_dir):
    """An engine that cannot join (nothing listens at its URL): rank 0 raises, having gathered every
    bucket with the other rank, which returns."""
    engine = engine_for("http://127.0.0.1:9") if dist.get_rank() == 0 else None
    try:
        await sync(components, engine, 2, run_dir)
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    components = sharded_components()
    specs = WeightBuckets(components.model).specs()
    plan = plan_buckets(specs, bucket_bytes=BUCKET_BYTES, weight_version=0)
    record = {
        "num_buckets": len(plan.buckets),
        "bucket_bytes_max": max(plan.bucket_bytes(k) for k in range(len(plan.buckets))),
        "total_bytes": plan.num_bytes,
    }
    if rank == 0:
        metrics, loaded = trio.run(sync_to_fake, components, [n for n, _, _ in specs], out)
    else:
        metrics = trio.run(sync, components, None, 1, out)
    record["metrics"] = metrics
    hoarder = WeightBuckets(components.model)  # a consumer that keeps every bucket: all of it counted
    kept = list(hoarder.buckets([[spec.name for spec in bucket] for bucket in plan.buckets]))
    record["kept_peak_bytes"], record["kept_held_bytes"] = hoarder.peak_held_bytes, hoarder.held_bytes
    del kept
    record["kept_held_after_drop"] = hoarder.held_bytes
    record["no_engine"] = trio.run(sync_to_nobody, components, out)
    if rank == 0:
        record["pool_metrics"] = trio.run(sync_to_pool, components, [n for n, _, _ in specs], out, out)
    else:
        record["pool_metrics"] = trio.run(sync, components, None, 3, out)
    full = model_tensors(components.model)  # gathered whole (on rank 0), the reference
    if rank == 0:
        save_file(loaded, str(out / "engine.safetensors"))
        save_file({n: t.float() for n, t in full.items()}, str(out / "full.safetensors"))
        record["dtypes"] = sorted({str(t.dtype) for t in full.values()})
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    close_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
