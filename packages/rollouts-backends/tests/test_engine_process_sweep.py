"""The files an engine process's parent made (shared files in /dev/shm, its stderr file, a model
directory it owns) are removed when the parent dies without reaping it: SIGTERM to the parent
alone, to the whole process group, or SIGKILL."""

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts engine processes (seconds each)

_PARENT = """
import json, sys, time
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from rollouts.backends import ProcessEngine

engine = ProcessEngine.from_model(tiny_model(seed=0))
child = engine._child
print(json.dumps({{"pid": engine.pid, "paths": [str(p) for p in child.files + child.dirs]}}), flush=True)
time.sleep(600)  # until the test signals this process
"""
_WAIT_S = 60.0  # bound on the engine process's exit once its parent is gone (it is idle: at once)


def _wait_gone(pid: int) -> None:
    """Until process `pid` (not our child) has exited, at most _WAIT_S."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], _WAIT_S)  # readable once the process has exited
        assert ready, f"engine process {pid} still running {_WAIT_S} s after its parent died"
    finally:
        os.close(fd)


def test_the_files_of_an_engine_process_are_removed_when_its_parent_dies():
    """The three ways, each with a parent of its own, started together (each start imports torch
    and transformers twice: side by side they share the wait)."""
    tests = str(Path(__file__).parent)
    parents = {
        how: subprocess.Popen(
            [sys.executable, "-c", _PARENT.format(tests=tests)],
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own group, so that the group signal reaches only it and its child
        )
        for how in ("sigterm_parent", "sigterm_group", "sigkill_parent")
    }
    try:
        started = {how: json.loads(parent.stdout.readline()) for how, parent in parents.items()}  # once ready
        for how, parent in parents.items():
            paths = [Path(p) for p in started[how]["paths"]]
            assert paths and all(p.exists() for p in paths), how
            if how == "sigterm_group":
                os.killpg(parent.pid, signal.SIGTERM)
            else:
                parent.send_signal(signal.SIGKILL if how == "sigkill_parent" else signal.SIGTERM)
        for how, parent in parents.items():
            parent.wait(timeout=_WAIT_S)
            _wait_gone(started[how]["pid"])
            assert [p for p in map(Path, started[how]["paths"]) if p.exists()] == [], how
    finally:
        for parent in parents.values():
            if parent.poll() is None:
                parent.kill()
                parent.wait(timeout=_WAIT_S)
            parent.stdout.close()
