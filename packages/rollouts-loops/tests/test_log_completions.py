"""The completions a step shows go to the run directory's completions.jsonl; on the console they are
INFO on a terminal and DEBUG in a log file, so a long run's log keeps its progress lines readable."""

import io
import json
import logging

from rollouts.loops.rl.step import COMPLETIONS_FILE, log_completions
from rollouts.types import RolloutBatch, Sample


class _Stderr(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _batch() -> RolloutBatch:
    samples = tuple(
        Sample(
            prompt=f"{i}+1=", response=str(i + 1), tokens=[1, 2, 3], num_prompt_tokens=2, loss_mask=[0, 0, 1]
        ).replace(reward=1.0)
        for i in range(3)
    )
    return RolloutBatch(samples=samples, step=1)


def test_completions_are_kept_in_the_run_directory_and_quiet_in_a_log_file(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="rollouts.loops.rl.step")
    monkeypatch.setattr("sys.stderr", _Stderr(tty=False))
    log_completions(_batch(), 1, 2, run_dir=tmp_path)
    log_completions(_batch(), 2, 2, run_dir=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / COMPLETIONS_FILE).read_text().splitlines()]
    assert [(r["step"], r["prompt"], r["response"], r["reward"]) for r in lines] == [
        (1, "0+1=", "1", 1.0),
        (1, "1+1=", "2", 1.0),
        (2, "0+1=", "1", 1.0),
        (2, "1+1=", "2", 1.0),
    ]
    assert {r.levelno for r in caplog.records} == {logging.DEBUG}


def test_completions_are_info_on_a_terminal(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="rollouts.loops.rl.step")
    monkeypatch.setattr("sys.stderr", _Stderr(tty=True))
    log_completions(_batch(), 1, 1)
    assert [r.levelno for r in caplog.records] == [logging.INFO] and not (tmp_path / COMPLETIONS_FILE).exists()
