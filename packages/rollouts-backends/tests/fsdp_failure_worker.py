"""Run under `torchrun --nproc_per_node 2`: a checkpoint failure on one rank raises on every rank.

Without that, the ranks that did not fail would wait forever in the next collective. The process
group's timeout is short (60 s) so that a regression fails the test instead of hanging it.
Writes OUT_DIR/rank<r>.json with what each case raised on that rank.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from fsdp_worker import sharded_components

import rollouts.backends.checkpoint.save_load as ck
from rollouts.backends import CheckpointWriter, latest_checkpoint, save_checkpoint
from rollouts.backends.train.distributed import close_process_group
from rollouts.types import TrainingState


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _outcome(fn) -> str:
    try:
        fn()
    except (OSError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    components = sharded_components()
    root = out / "ckpt"
    results = {}

    writer = CheckpointWriter()
    # 1. Rank 0's background publish fails: the next save through the writer raises on every rank.
    fsync = ck.fsync_path
    if rank == 0:
        ck.fsync_path = _disk_full
    save_checkpoint(components, TrainingState(step=1), root, writer=writer)
    results["publish"] = _outcome(lambda: save_checkpoint(components, TrainingState(step=2), root, writer=writer))
    ck.fsync_path = fsync

    # 2. Rank 1 cannot write its optimizer shard: every rank raises.
    write = ck.write_tensors
    if rank == 1:
        ck.write_tensors = _disk_full
    results["shard"] = _outcome(lambda: save_checkpoint(components, TrainingState(step=3), root))
    ck.write_tensors = write

    # 3. Saving works again, and the writer's wait lets every rank see the background save.
    save_checkpoint(components, TrainingState(step=4), root, writer=writer)
    writer.wait()
    results["latest"] = str(latest_checkpoint(root))
    writer.close()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    close_process_group()  # monitored barrier, then destroy: no rank leaves under a peer's send


if __name__ == "__main__":
    main(Path(sys.argv[1]))
