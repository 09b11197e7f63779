"""Start a vLLM server that rollouts can drive: dev-mode endpoints (pause, reload, collective RPC,
weight version) on, and the worker extension that takes weights in request bodies, so a trainer
syncs weights with or without a shared disk.

    with launch_vllm_server("/models/qwen", python="/opt/vllm/bin/python") as server:
        engine = VLLMEngine(server.url)

    options = VLLMServeOptions(dtype="float32", max_model_len=256, enforce_eager=True)
    with launch_vllm_server("/models/qwen", options=options, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as server:
        ...

`rollouts engine vllm --model DIR` (rollouts-loops) runs this from the command line. The server is
started in its own process group and stopped with it (SIGTERM, then SIGKILL); start-up is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = [
    "DEFAULT_SERVE_OPTIONS",
    "EXTENSION_MODULE",
    "VLLMServeOptions",
    "VLLMServer",
    "free_port",
    "launch_vllm_server",
    "vllm_server_command",
]

EXTENSION_MODULE = "rollouts_worker_extension"
"""The worker extension's module name in the server's environment: the launcher copies
rollouts/sync/worker_extension.py (standard library, torch and safetensors only; with the modules of
ours it imports beside it, each as rollouts_<name>: _EXTENSION_IMPORTS) into a directory of its own on
the server's PYTHONPATH, so nothing else of this environment leaks into vLLM's."""
_EXTENSION_SOURCE = Path(__file__).with_name("worker_extension.py")
_EXTENSION_IMPORTS = ("fingerprint_torch", "broadcast_group", "worker_receive", "worker_ipc", "ipc_handles")
_POLL_INTERVAL_S = 1.0
_STOP_GRACE_S = 15.0  # SIGTERM first, SIGKILL after this
_MAX_LORAS = 2  # the adapter being replaced and its successor, both loaded during a sync


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMServeOptions:
    """What the vLLM server serves and how: the options of its command line."""

    dtype: str = "auto"
    """The weights' and activations' dtype (vLLM's --dtype)."""
    max_model_len: int | None = None
    """Longest prompt + response in tokens (None: the model's own limit)."""
    enforce_eager: bool = False
    """No CUDA graphs (faster start-up, slower decoding; needed on CPU)."""
    worker_extension: bool = True
    """Load rollouts' worker extension, which takes weights in request bodies (off for a reward model)."""
    logprobs_mode: str = "processed_logprobs"
    """"processed_logprobs": the log-probs returned are those of the distribution the tokens were
    drawn from (after temperature, top-k and top-p), which is what the trainer computes for its
    importance ratios; "raw_logprobs" is vLLM's default (the full softmax)."""
    max_lora_rank: int | None = None
    """Serve LoRA adapters up to this rank, loaded at run time as adapter syncs do (None: no LoRA)."""
    extra_args: Sequence[str] = ()
    """More vLLM arguments, appended as they are (kept as a tuple)."""

    def __post_init__(self) -> None:
        rank = self.max_lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"max_lora_rank must be an int >= 1 or None, got {rank!r}")
        # a list given for extra_args is kept as a tuple, so the value stays frozen
        object.__setattr__(self, "extra_args", tuple(self.extra_args))


DEFAULT_SERVE_OPTIONS = VLLMServeOptions()
"""The model's dtype and length, CUDA graphs, the worker extension, processed log-probs, no LoRA."""


@dataclass(frozen=True, slots=True)
class VLLMServer:
    """A running vLLM server started by launch_vllm_server."""

    url: str
    pid: int
    port: int
    log_path: Path
    model_dir: Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def check_port_free(host: str, port: int) -> None:
    """ValueError when another process listens on `port`: a server started there would fail to
    bind while /health answers from the other one, which would pass for this server's start."""
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        if s.connect_ex((probe_host, port)) == 0:
            raise ValueError(f"port {port} on {probe_host} is in use by another process; choose another (or none)")


def vllm_server_command(
    model_dir: str | os.PathLike[str],
    *,
    python: str,
    host: str,
    port: int,
    options: VLLMServeOptions = DEFAULT_SERVE_OPTIONS,
) -> list[str]:
    """The command line of vLLM's OpenAI server for `model_dir` with what rollouts' clients need."""
    rank = options.max_lora_rank
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(Path(model_dir).absolute()),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        options.dtype,
        *(["--max-model-len", str(options.max_model_len)] if options.max_model_len is not None else []),
        *(["--enforce-eager"] if options.enforce_eager else []),
        *(
            ["--worker-extension-cls", f"{EXTENSION_MODULE}.SafetensorsWeightLoader"]
            if options.worker_extension
            else []
        ),
        "--logprobs-mode",
        options.logprobs_mode,
        *(["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(_MAX_LORAS)] if rank else []),
        *options.extra_args,
    ]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # The server runs in its own session, so its pid is its process group: this reaches the
    # engine-core child it forks, and nothing else.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group once the parent is gone
    except ProcessLookupError:
        pass


@contextmanager
def launch_vllm_server(
    model_dir: str | os.PathLike[str],
    *,
    options: VLLMServeOptions = DEFAULT_SERVE_OPTIONS,
    python: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout_s: float = 600.0,
    api_key: str | None = None,
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
) -> Iterator[VLLMServer]:
    """Start a vLLM server for `model_dir`; yields once /health answers; stops it on exit.

    `options`: what the server serves (its command line). `python`: the interpreter of an
    environment with vLLM (default: this one). `env`: extra environment variables for the server.
    Raises RuntimeError with the log's tail when the server exits or is not healthy within
    `startup_timeout_s`.
    """
    model_dir = Path(model_dir).absolute()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
    if not startup_timeout_s > 0:
        raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
    python = python or sys.executable
    if port is not None:
        check_port_free(host, port)
    port = port if port is not None else free_port(host)
    with tempfile.TemporaryDirectory(prefix="rollouts-vllm-") as extension_dir:
        shutil.copyfile(_EXTENSION_SOURCE, Path(extension_dir) / f"{EXTENSION_MODULE}.py")
        for name in _EXTENSION_IMPORTS:
            shutil.copyfile(_EXTENSION_SOURCE.with_name(f"{name}.py"), Path(extension_dir) / f"rollouts_{name}.py")
        log = Path(log_path) if log_path is not None else Path(extension_dir) / "server.log"
        cmd = vllm_server_command(model_dir, python=python, host=host, port=port, options=options)
        server_env = {
            **os.environ,
            **(env or {}),
            "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache
            **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if options.max_lora_rank else {}),
            "PYTHONPATH": os.pathsep.join(p for p in (extension_dir, os.environ.get("PYTHONPATH", "")) if p),
        }
        if api_key is not None:
            server_env["VLLM_API_KEY"] = api_key  # not on the command line, where ps shows it
        url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        url = f"http://{url_host}:{port}"
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=server_env, start_new_session=True
            )
        try:
            _wait_healthy(proc, url, log, startup_timeout_s)
            yield VLLMServer(url=url, pid=proc.pid, port=port, log_path=log, model_dir=model_dir)
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
