import sys
from pathlib import Path

# Top-level tests import their helpers (layering.py, ...) from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import json

import pytest


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    """A tiny local model directory plus SFT conversations and RL prompts for 2-digit addition."""
    from rollouts.loops.recipes.addition import addition_problems, as_conversation
    from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer, save_model

    root = tmp_path_factory.mktemp("tiny_run")
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


@pytest.fixture(scope="session")
def vllm_for_tiny_model(tiny_run_inputs, tmp_path_factory):
    """One vLLM server of the tiny model for the session's tests (a start costs about half a minute),
    started the way a user starts one: `rollouts engine vllm` in another process, from another working
    directory, its URL read from what it prints, with runtime LoRA adapters on. Tests sync weights
    into it: a test that needs the model's own weights loads them first
    (run_configs.reset_vllm_weights)."""
    import os
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    from rollouts.sync.testing import find_vllm_python, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU server unavailable: {reason}")
    elsewhere = tmp_path_factory.mktemp("engine_cwd")
    # fmt: off
    cmd = [
        sys.executable, "-m", "rollouts.loops.app.cli", "engine", "vllm",
        "--model", str(tiny_run_inputs / "model"), "--python", find_vllm_python(),
        "--dtype", "float32", "--max-model-len", "64", "--enforce-eager", "--startup-timeout-s", "600",
        "--max-lora-rank", "8",  # test_lora_vllm's adapters: one server for all (a start costs ~35 s)
    ]
    # fmt: on
    launcher = subprocess.Popen(
        cmd, cwd=elsewhere, stdout=subprocess.PIPE, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    try:
        line = launcher.stdout.readline()  # the launcher exits (EOF) if the server is not up in 600 s
        assert line.startswith("engine ready: http://"), (line, launcher.poll(), list(elsewhere.iterdir()))
        yield SimpleNamespace(url=line.split(": ", 1)[1].strip(), cwd=elsewhere)
    finally:
        launcher.send_signal(signal.SIGTERM)  # the launcher stops its server and exits
        launcher.wait(timeout=120)


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
