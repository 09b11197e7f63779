"""How an engine process runs its model, and how long its client waits for it
(rollouts.backends.engine_process.client.ProcessEngine's options)."""

from __future__ import annotations

import dataclasses

from rollouts.backends.engine_process.cuda_ipc import TRANSPORTS
from rollouts.backends.engine_process.shared_weights import DTYPES

__all__ = ["EngineProcessOptions"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineProcessOptions:
    """How an engine process runs its model, and how long its client waits for it."""

    num_threads: int = 1
    """The engine process's torch thread count."""
    device: str = "cpu"
    dtype: str = "float32"
    """The model's dtype in the engine process: float32, bfloat16 or float16."""
    attn_implementation: str = "sdpa"
    timeout_s: float = 600.0
    """Bound on each request's answer; past it the engine process is killed."""
    start_timeout_s: float = 300.0
    """Bound on loading the model until the engine process says it is ready."""
    attest: bool = True
    """After each full-weight sync, the engine process answers the checksums of its weights
    (rollouts.sync.fingerprint) and the client checks them against those of the weights sent, cast
    to `dtype` (AttestationError naming the tensors that differ). LoRA adapter loads are not attested."""
    weights_transport: str = "auto"
    """How `load_weights` moves tensors: "cuda_ipc" (CUDA IPC handles, device to device: the
    weights and the engine on one GPU), "shared_memory" (a file in /dev/shm), or "auto": "cuda_ipc"
    when every tensor is on the engine's own CUDA device, else "shared_memory"."""
    ipc_bucket_bytes: int = 1 << 30
    """The most bytes a CUDA IPC load stages at once on the trainer's GPU (a larger tensor goes alone)."""

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.weights_transport not in TRANSPORTS:
            raise ValueError(f"weights_transport must be one of {TRANSPORTS}, got {self.weights_transport!r}")
        if self.weights_transport == "cuda_ipc" and not self.device.startswith("cuda"):
            raise ValueError(f"weights_transport='cuda_ipc' needs a CUDA device for the engine, got {self.device!r}")
        if self.ipc_bucket_bytes < 1:
            raise ValueError(f"ipc_bucket_bytes must be >= 1, got {self.ipc_bucket_bytes}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.timeout_s > 0 and self.start_timeout_s > 0):
            raise ValueError(f"timeout_s ({self.timeout_s}) and start_timeout_s ({self.start_timeout_s}) must be > 0")

    def args(self) -> list[str]:
        """The engine process's command line options for these."""
        return ["--threads", str(self.num_threads), "--device", self.device, "--dtype", self.dtype]
