"""Loggers: the JSONL file is the record of a run; the console shows progress; plot reads the file."""

import io
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.loops.loggers import ConsoleLogger, JsonlLogger, MultiLogger, read_jsonl
from rollouts.types import MetricsLogger


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(
        st.dictionaries(st.sampled_from(["loss", "lr", "reward_mean"]), st.floats(allow_nan=True)), max_size=8
    )
)
def test_jsonl_round_trip_keeps_every_step(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("log") / "metrics.jsonl"
    logger = JsonlLogger(path)
    assert isinstance(logger, MetricsLogger)
    for step, row in enumerate(rows):
        logger.log(step, row)
    logger.close()
    records = read_jsonl(path) if rows else []
    assert [r["step"] for r in records] == list(range(len(rows)))
    for record, row in zip(records, rows, strict=True):
        for key, value in row.items():
            assert record[key] == (value if math.isfinite(value) else None)  # JSON has no NaN


def test_jsonl_appends_on_resume_and_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlLogger(path)
    first.log(1, {"loss": 1.0})
    first.close()
    with path.open("a") as f:
        f.write('{"step": 2, "lo')  # killed mid-write
    assert [r["step"] for r in read_jsonl(path)] == [1]
    path.write_text(path.read_text().rsplit("\n", 1)[0] + "\n")
    second = JsonlLogger(path)
    second.log(2, {"loss": 0.5})
    second.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    with pytest.raises(ValueError, match="closed"):
        second.log(3, {})


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        read_jsonl(path)


def test_console_and_multi_logger(tmp_path):
    stream = io.StringIO()
    console = ConsoleLogger(3, desc="sft", stream=stream)
    jsonl = JsonlLogger(tmp_path / "m.jsonl")
    multi = MultiLogger([console, jsonl])
    for step in (1, 2, 3):
        multi.log(step, {"loss": 1.0 / step, "lr": 1e-3})
    multi.close()
    assert "3/3" in stream.getvalue() and "loss" in stream.getvalue()
    assert len(read_jsonl(tmp_path / "m.jsonl")) == 3
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])["loss"] == 1.0


def test_tensorboard_logger_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from rollouts.loops.loggers import TensorboardLogger

    logger = TensorboardLogger(tmp_path / "tb")
    assert isinstance(logger, MetricsLogger)
    for step in (1, 2):
        logger.log(step, {"loss": 1.0 / step})
    logger.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.5)]


def test_wandb_logger_runs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from rollouts.loops.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="rollouts-test", config={"lr": 1e-3})
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert list(tmp_path.rglob("*.wandb")), "no offline run file written"
