"""Fixtures: one real vLLM CPU server per test session (start-up takes 70-100 s), for a tiny model built here."""

from __future__ import annotations

import pytest

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
    """A vLLM server (dev mode, worker extension loaded) serving a random tiny Qwen2 built for this session."""
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_model(root / "model_v0", python=vllm_python, seed=0)
    with launch_vllm_server(model_dir, python=vllm_python, log_path=root / "server.log") as server:
        yield server


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    """Every `@pytest.mark.anyio` test runs under asyncio and under trio (the loops use trio)."""
    return request.param
