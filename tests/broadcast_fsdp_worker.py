"""Run under `torchrun --nproc_per_node 2` (gloo): an FSDP2-sharded model pushed to a vLLM server by
BroadcastSync, each DTensor gathered as its bucket is sent; only rank 0 talks to the engine.

Arguments: MODEL_DIR URL OUT_DIR VERSION. Each rank perturbs the model the same way (seed 1), shards
it, and pushes; rank 0 then writes the full weights it sent to OUT_DIR/model.safetensors (with the
model directory's other files) for the test's transformers reference.
"""

import shutil
import sys
from pathlib import Path

import anyio
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from rollouts.backends import load_hf_model, shard_model
from rollouts.sync import BroadcastOptions, HTTPOptions, VLLMEngine
from rollouts.sync.broadcast import BroadcastSync

BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model


async def push(sync, tensors, url, version, rank):
    if rank != 0:
        await sync.push(tensors, version)
        return
    async with VLLMEngine(url, http=HTTPOptions(timeout_s=60.0)) as engine:
        await sync.connect([engine])
        result = await sync.push(tensors, version)
        assert result.updated == (engine.name,), result


def main() -> None:
    model_dir, url, out, version = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = load_hf_model(model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model = shard_model(model)
    in_checkpoint = set(load_file(str(model_dir / "model.safetensors")))  # a tied lm_head is not there
    tensors = {n: t for n, t in model.state_dict().items() if n in in_checkpoint}
    assert any(isinstance(t, DTensor) for t in tensors.values())
    sync = BroadcastSync(BroadcastOptions(bucket_bytes=BUCKET_BYTES, bucket_timeout_s=60.0))
    anyio.run(push, sync, tensors, url, version, rank)
    full = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in tensors.items()}
    if rank == 0:
        shutil.copytree(model_dir, out)
        save_file(
            {n: t.contiguous() for n, t in full.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
