"""Fixtures: one real vLLM CPU server per test session (start-up takes 70-100 s, started right after
collection when a test needs it), for a tiny model built here."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

from rollouts.sync.fingerprint import FAULT_ENV
from rollouts.sync.launch import VLLMServer
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


class _StartingServer:
    """A vLLM server (dev mode, worker extension loaded) for a random tiny Qwen2 built in `root`,
    started in a thread: `wait()` gives it once it answers, `close()` stops it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._stack = contextlib.ExitStack()
        self._server: VLLMServer | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="vllm-server-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            python = find_vllm_python()
            assert python is not None
            model_dir = build_tiny_model(self.root / "model_v0", python=python, seed=0)
            fault = {FAULT_ENV: f"file:{self.root / 'fault'}"}
            server = launch_vllm_server(model_dir, python=python, log_path=self.root / "server.log", env=fault)
            self._server = self._stack.enter_context(server)
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), in the test that needs the server
            self._error = exc

    def wait(self) -> VLLMServer:
        self._thread.join()  # launch_vllm_server bounds the start (its startup timeout)
        if self._error is not None:
            raise self._error
        assert self._server is not None
        return self._server

    def close(self) -> None:
        self._thread.join()
        self._stack.close()


_STARTED: dict[str, _StartingServer] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """When a collected test uses `vllm_server`, start it now, in the background: its start (70-100 s)
    overlaps the tests that run before the first one that needs it."""
    if not any("vllm_server" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if vllm_unavailable_reason() is None:  # else the fixture skips, saying why
        _STARTED["server"] = _StartingServer(session.config._tmp_path_factory.mktemp("vllm"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A server started ahead that no fixture took (the run stopped first) is stopped too."""
    started = _STARTED.pop("server", None)
    if started is not None:
        started.close()


@pytest.fixture(scope="session")
def vllm_server(vllm_python, tmp_path_factory):
    """A vLLM server (dev mode, worker extension loaded) serving a random tiny Qwen2 built for this session.
    Its workers corrupt the tensor named in the file `vllm_fault_file` (`corrupt:<name>`) while it exists."""
    started = _STARTED.pop("server", None) or _StartingServer(tmp_path_factory.mktemp("vllm"))
    try:
        yield started.wait()
    finally:
        started.close()


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
