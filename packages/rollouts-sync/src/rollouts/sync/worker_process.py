"""vLLM's worker extension in a process of its own, without vLLM: the other side of an IPC sync
(rollouts.sync.ipc) for tests and benchmarks, where a worker must map what the trainer shares from
another process (a CUDA IPC handle cannot be mapped by the process that made it).

    with StandInWorker(model_dir, device="cuda:0") as worker:
        for rpc in IpcUpdate(tensors, bucket_bytes=..., weight_version=1, checksums=True).rpcs():
            answer = worker.call(rpc["kwargs"])   # one bucket: mapped, copied out, answered

The child runs rollouts.sync.worker_extension.SafetensorsWeightLoader with vLLM's `reload_weights`
stood in for: the weights are copied into tensors of the child's own on `device` (allocated at the
first load, written in place after, as vLLM's load does), and the last bucket's answer also holds
"loaded": the checksums of what the child then holds, and "devices": where it staged what it
received. The model directory gives the checkpoint the extension checks names and shapes against.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Any, Self

__all__ = ["StandInWorker"]

_CHILD = """
import json, sys, types, torch
from rollouts.sync.fingerprint_torch import fingerprint_torch
from rollouts.sync.worker_extension import SafetensorsWeightLoader

class Worker(SafetensorsWeightLoader):
    def __init__(self, model_dir, device):
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(model=model_dir))
        self.device = torch.device(device)
        self.params = {}
    def reload_weights(self, weights_iterator):
        self.received_on = set()
        for name, tensor in weights_iterator:
            self.received_on.add(str(tensor.device))
            own = self.params.get(name)
            if own is None or own.shape != tensor.shape or own.dtype != tensor.dtype:
                own = self.params[name] = torch.empty_like(tensor, device=self.device)
            own.copy_(tensor)

worker = Worker(sys.argv[1], sys.argv[2])
for line in sys.stdin:
    try:
        answer = worker.rollouts_receive_ipc(**json.loads(line))
        if "checksums" in answer:
            answer |= {"loaded": fingerprint_torch(worker.params), "devices": sorted(worker.received_on)}
    except Exception as exc:
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(answer), flush=True)
"""


class StandInWorker:
    """The worker extension in a child process (`python`, default this one), loading into `device`."""

    def __init__(self, model_dir: str | os.PathLike[str], *, device: str = "cpu", python: str = sys.executable) -> None:
        self._child = subprocess.Popen(
            [python, "-c", _CHILD, str(model_dir), device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def call(self, kwargs: dict[str, Any], *, timeout_s: float = 120.0) -> dict[str, Any]:
        """`rollouts_receive_ipc(**kwargs)` in the child, its answer within `timeout_s`; RuntimeError
        for an error it raised, its death, or no answer in time (the child is then killed: a late
        answer would be taken for the next call's)."""
        stdin, stdout = self._child.stdin, self._child.stdout
        assert stdin is not None and stdout is not None
        if self._child.poll() is not None:
            raise RuntimeError(f"the stand-in worker is not running (exit status {self._child.returncode})")
        try:
            stdin.write(json.dumps(kwargs) + "\n")
            stdin.flush()
        except BrokenPipeError as e:
            raise RuntimeError(f"the stand-in worker died (exit status {self._child.wait(timeout=10)})") from e
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        if not ready:
            self._child.kill()
            self._child.wait(timeout=10)
            raise RuntimeError(f"the stand-in worker gave no answer within {timeout_s} s, and was killed")
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the stand-in worker died (exit status {self._child.wait(timeout=10)})")
        try:
            answer: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as e:
            raise RuntimeError(f"the stand-in worker answered a line that is not JSON: {line[:200]!r}") from e
        if "error" in answer:
            raise RuntimeError(f"the stand-in worker failed: {answer['error']}")
        return answer

    def close(self) -> None:
        if self._child.stdin is not None and not self._child.stdin.closed:
            self._child.stdin.close()
        try:
            self._child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
