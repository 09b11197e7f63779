"""Loggers: the JSONL file is the record of a run; the console shows progress; plot reads the file."""

import errno
import io
import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.loops.run.loggers import ConsoleLogger, JsonlLogger, MultiLogger, read_jsonl, repair_torn_tail
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
    second = JsonlLogger(path)  # the same command again: the torn line is cut before appending
    second.log(2, {"loss": 0.5})
    second.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    with pytest.raises(ValueError, match="closed"):
        second.log(3, {})


def test_a_full_disk_mid_record_loses_nothing_once_space_is_back(tmp_path, monkeypatch):
    """The case from the field: the disk filled while a line was written; the next run appended
    onto the torn line, that record was lost and every later read failed ("not a JSON object")."""
    path = tmp_path / "metrics_sft.jsonl"
    logger = JsonlLogger(path)
    logger.log(1, {"loss": 1.0})
    real_fsync = os.fsync

    def full_disk(fd):  # the bytes reached the page cache, then the flush to disk fails
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        logger.log(2, {"loss": 0.9})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [r["step"] for r in read_jsonl(path)] == [1]  # cut back to whole lines at once
    logger.log(2, {"loss": 0.9})
    logger.close()
    # A writer killed mid-line (no handler ran) leaves a torn line: the next run repairs it.
    with path.open("ab") as f:
        f.write(b'{"step": 3, "loss": 0.')
    again = JsonlLogger(path)
    again.log(3, {"loss": 0.8})
    again.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    assert path.read_bytes().endswith(b"\n")


def test_a_whole_record_missing_only_its_newline_is_kept(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}')
    assert repair_torn_tail(path) == 0
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Steps logged after the checkpoint a run resumes from are logged again by the resumed run:
    the file keeps the resumed run's records, once each."""
    path = tmp_path / "m.jsonl"
    crashed = JsonlLogger(path)
    for step in (1, 2, 3, 4, 5):  # checkpoint at step 3, killed after logging step 5
        crashed.log(step, {"loss": 1.0})
    crashed.close()
    resumed = JsonlLogger(path)
    for step in (4, 5, 6):
        resumed.log(step, {"loss": 0.5})
    resumed.close()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]


@settings(max_examples=60, deadline=None)
@given(num_records=st.integers(0, 6), cut=st.integers(0, 400), junk=st.binary(max_size=12))
def test_a_run_killed_at_any_byte_continues_with_whole_records(tmp_path_factory, num_records, cut, junk):
    """Killed at any byte of a write (plus any bytes the write left behind without a newline): the
    next run's records follow the whole ones, and the file always reads."""
    path = tmp_path_factory.mktemp("log") / "m.jsonl"
    logger = JsonlLogger(path)
    for step in range(1, num_records + 1):
        logger.log(step, {"loss": float(step)})
    logger.close()
    data = path.read_bytes()
    cut = min(cut, len(data))
    torn = data[:cut] + junk.replace(b"\n", b"")
    path.write_bytes(torn)
    whole = data[:cut].count(b"\n")
    read_jsonl(path)  # tolerated as it is
    nxt = JsonlLogger(path)
    nxt.log(100, {"loss": 0.0})
    nxt.close()
    steps = [r.get("step") for r in read_jsonl(path)]
    assert steps[:whole] == list(range(1, whole + 1)) and steps[-1] == 100
    assert len(steps) in (whole + 1, whole + 2)  # +1: a last line that was a whole object is kept


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
    from rollouts.loops.run.loggers import TensorboardLogger

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
    from rollouts.loops.run.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="rollouts-test", config={"lr": 1e-3})
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert list(tmp_path.rglob("*.wandb")), "no offline run file written"
