"""Crash-test worker: resume from the latest checkpoint, train, checkpoint after every step.

`run` reports progress lines ("START n", "SAVING n", "SAVED n", "DONE") through `emit`; the test
forks a process running it and SIGKILLs that process at chosen moments. With `wait=False` the
checkpoints are flushed and published in the background by a CheckpointWriter, so "SAVED n" kills land mid-publish.
"""

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from helpers import fresh_components, train_steps

from rollouts.backends import CheckpointWriter, latest_checkpoint, load_checkpoint, save_checkpoint
from rollouts.types import TrainingState


def run(root: Path, total: int, emit: Callable[[str], None], wait: bool = True) -> None:
    torch.manual_seed(1234)
    components = fresh_components(num_training_steps=total)
    state = TrainingState()
    path = latest_checkpoint(root)
    if path is not None:
        state, extra = load_checkpoint(components, path)
        assert extra == {"step": state.step}, extra
    emit(f"START {state.step}")

    writer = None if wait else CheckpointWriter()

    def checkpoint(components, state):
        emit(f"SAVING {state.step}")
        save_checkpoint(components, state, root, extra={"step": state.step}, keep_last=2, writer=writer)
        emit(f"SAVED {state.step}")

    train_steps(components, state, total - state.step, on_step=checkpoint)
    if writer is not None:
        writer.close()
    emit("DONE")


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(Path(sys.argv[1]), int(sys.argv[2]), lambda line: print(line, flush=True))
