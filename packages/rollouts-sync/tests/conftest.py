"""Fixtures: one real vLLM CPU server per test session (start-up takes 70-100 s), for a tiny model built here."""

from __future__ import annotations

import pytest

from rollouts.sync.fingerprint import FAULT_ENV
from rollouts.sync.testing import build_tiny_model, find_vllm_python, launch_vllm_server, vllm_unavailable_reason


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM venv's python; skips the test (with the reason) where vLLM is not set up."""
    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU server unavailable: {reason}")
    python = find_vllm_python()
    assert python is not None
    return python


@pytest.fixture(scope="session")
def vllm_server(vllm_python, tmp_path_factory):
    """A vLLM server (dev mode, worker extension loaded) serving a random tiny Qwen2 built for this session.
    Its workers corrupt the tensor named in the file `vllm_fault_file` (`corrupt:<name>`) while it exists."""
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_model(root / "model_v0", python=vllm_python, seed=0)
    fault = {FAULT_ENV: f"file:{root / 'fault'}"}
    with launch_vllm_server(model_dir, python=vllm_python, log_path=root / "server.log", env=fault) as server:
        yield server


@pytest.fixture
def vllm_fault_file(vllm_server):
    """The file that turns the session server's fault injection on (written) and off (removed after the test)."""
    path = vllm_server.model_dir.parent / "fault"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    """Every `@pytest.mark.anyio` test runs under asyncio and under trio (the loops use trio)."""
    return request.param
