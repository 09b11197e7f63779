import sys
from pathlib import Path

# Top-level tests import their helpers (layering.py, ...) from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import json

import pytest


def _build_tiny_run_inputs(root):
    """A tiny local model directory plus SFT conversations and RL prompts for 2-digit addition, in `root`."""
    from rollouts.loops.recipes.addition import addition_problems, as_conversation
    from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer, save_model

    records = addition_problems(400, digits=2, seed=0)
    tokenizer = build_tokenizer((r["prompt"] + r["answer"] for r in records), vocab_size=32)
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    save_model(model, tokenizer, root / "model")
    with (root / "sft.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps({"messages": as_conversation(r)}) + "\n")
    with (root / "prompts.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return root


_SESSION = {}
"""What the session built or started ahead of the fixtures that hand it out: "inputs" (the tiny run
inputs) and "vllm" (the vLLM server's launcher and its readiness line, read in a thread)."""


def _start_vllm(inputs, cwd):
    """`rollouts engine vllm` for the tiny model, started the way a user starts one (another process,
    another working directory); a thread reads its readiness line. Returns (launcher, thread, lines)."""
    import os
    import subprocess
    import threading

    from rollouts.sync.testing import find_vllm_python

    # fmt: off
    cmd = [
        sys.executable, "-m", "rollouts.loops.app.cli", "engine", "vllm",
        "--model", str(inputs / "model"), "--python", find_vllm_python(),
        "--dtype", "float32", "--max-model-len", "64", "--enforce-eager", "--startup-timeout-s", "600",
        "--max-lora-rank", "8",  # test_lora_vllm's adapters: one server for all (a start costs ~35 s)
    ]
    # fmt: on
    launcher = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    lines = []
    thread = threading.Thread(target=lambda: lines.append(launcher.stdout.readline()), daemon=True)
    thread.start()
    return launcher, thread, lines


def pytest_collection_finish(session):
    """When a collected test uses the session's vLLM server, start it now, in the background: its
    start (about 35 s) overlaps the tests that run before the first one that needs it."""
    if not any("vllm_for_tiny_model" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    from rollouts.sync.testing import vllm_unavailable_reason

    if vllm_unavailable_reason() is not None:
        return  # the fixture skips, saying why
    factory = session.config._tmp_path_factory
    _SESSION["inputs"] = _build_tiny_run_inputs(factory.mktemp("tiny_run"))
    cwd = factory.mktemp("engine_cwd")
    _SESSION["vllm"] = (*_start_vllm(_SESSION["inputs"], cwd), cwd)


def pytest_sessionfinish(session):
    """A server started ahead that no fixture took (the run stopped first) is stopped too."""
    _stop_vllm(_SESSION.pop("vllm", None))


def _stop_vllm(started):
    import signal

    if started is None:
        return
    launcher = started[0]
    launcher.send_signal(signal.SIGTERM)  # the launcher stops its server and exits
    launcher.wait(timeout=120)


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    """A tiny local model directory plus SFT conversations and RL prompts for 2-digit addition."""
    if "inputs" not in _SESSION:
        _SESSION["inputs"] = _build_tiny_run_inputs(tmp_path_factory.mktemp("tiny_run"))
    return _SESSION["inputs"]


@pytest.fixture(scope="session")
def vllm_for_tiny_model(tiny_run_inputs, tmp_path_factory):
    """One vLLM server of the tiny model for the session's tests (a start costs about half a minute;
    started right after collection when a test needs it), started the way a user starts one:
    `rollouts engine vllm` in another process, from another working directory, its URL read from
    what it prints, with runtime LoRA adapters on. Tests sync weights into it: a test that needs the
    model's own weights loads them first (run_configs.reset_vllm_weights)."""
    from types import SimpleNamespace

    from rollouts.sync.testing import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU server unavailable: {reason}")
    started = _SESSION.pop("vllm", None)
    if started is None:
        cwd = tmp_path_factory.mktemp("engine_cwd")
        started = (*_start_vllm(tiny_run_inputs, cwd), cwd)
    launcher, thread, lines, cwd = started
    try:
        thread.join(timeout=660)  # the launcher prints its line, or exits (EOF), within its 600 s
        line = lines[0] if lines else ""
        assert line.startswith("engine ready: http://"), (line, launcher.poll(), list(cwd.iterdir()))
        yield SimpleNamespace(url=line.split(": ", 1)[1].strip(), cwd=cwd)
    finally:
        _stop_vllm(started)


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory):
    """`rollouts demo --quick`, run once for the session: (its output directory, what it printed)."""
    import contextlib
    import io

    from rollouts.loops.app.cli import main

    out = tmp_path_factory.mktemp("quick_demo") / "demo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        status = main(["demo", "--quick", "--out", str(out)])
    assert status == 0, printed.getvalue()[-4000:]
    return out, printed.getvalue()
