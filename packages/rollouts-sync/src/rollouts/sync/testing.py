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
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from rollouts.sync import launch
from rollouts.sync.launch import VLLMServer, free_port

VENV_ENV_VAR = "ROLLOUTS_VLLM_VENV"
# Run by the vLLM venv's python (it has torch); lives in the source tree, not in rollouts.sync,
# which never imports torch.
_SCRIPT = Path(__file__).resolve().parents[5] / "scripts" / "vllm_tiny_model.py"
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
    env: Mapping[str, str] | None = None,
) -> Iterator[VLLMServer]:
    """The tests' vLLM CPU server for `model_dir` on loopback (rollouts.sync.launch with float32,
    eager mode and a 1 GiB KV cache); start-up takes 70 to 100 s on CPU. `env`: more environment
    variables for the server (e.g. ROLLOUTS_SYNC_FAULT)."""
    python = python if python is not None else find_vllm_python()
    if python is None:
        raise RuntimeError(vllm_unavailable_reason() or "no vLLM python")
    port = port if port is not None else free_port()
    log = Path(log_path) if log_path is not None else Path(model_dir).absolute().with_name(f"vllm-{port}.log")
    with launch.launch_vllm_server(
        model_dir,
        options=launch.VLLMServeOptions(
            dtype="float32",
            max_model_len=max_model_len,
            enforce_eager=True,
            worker_extension=worker_extension,
            extra_args=extra_args,
        ),
        python=python,
        port=port,
        startup_timeout_s=startup_timeout_s,
        api_key=api_key,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        log_path=log,
    ) as server:
        yield server


if __name__ == "__main__":  # python -m rollouts.sync.testing: say whether the vLLM tests can run here
    print(vllm_unavailable_reason() or f"vLLM available: {find_vllm_python()}")
    sys.exit(0)
