"""Remote engines (vLLM, SGLang) as the loops use them, built from an EngineSpec's fields
(`remote_engine`): each weight sync bounded, the weights sent the way `engine.sync` says.

`SendWeights` sends the weights as tensors (sync "http", by the wire `http_wire` names: fetched by
the server, inline, or mapped from the trainer's memory by IPC): one server straight from the model
(the loops' direct loader: nothing exported), several from the exported files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import trio

from rollouts.sync import (
    EnginePool,
    HTTPOptions,
    RawTensor,
    SGLangEngine,
    VLLMEngine,
    is_adapter_dir,
    is_this_machine,
    sync_weights_to_engines,
)
from rollouts.sync.fingerprint import AttestationError
from rollouts.sync.raw import read_safetensors_dir
from rollouts.sync.weight_sync import WeightSyncError, engine_failure
from rollouts.types import InferenceEngine, Sample, SamplingParams

log = logging.getLogger(__name__)


def remote_engine(
    kind: str,
    urls: Sequence[str],
    *,
    api_key_env: str,
    http: HTTPOptions,
    sync_timeout_s: float,
    sync: str = "disk",
    partial: bool = False,
    attest: bool = True,
    http_wire: str = "fetch",
    broadcast_backend: str = "gloo",
) -> InferenceEngine:
    """A vLLM / SGLang client (a pool of them for several URLs); the API key comes from `api_key_env`,
    each call's bound and retries from `http`.

    `sync`: "disk" reloads each engine from the exported weights' absolute path (a shared
    filesystem); "http" sends them in request bodies (`SendWeights`); "broadcast" through process
    groups with the engines' workers (`BroadcastWeights`; for several URLs one `BroadcastPool`, each
    bucket sent to them all). `partial` (rl.rollout.partial, vLLM only): a sync pauses the server in
    mode "abort" and the responses it cuts short come back as partial samples
    (`VLLMEngine(keep_partial=True)`), to be continued. `attest`: vLLM engines check the checksums of
    the weights each sync loaded (`VLLMEngine(attest=...)`, and the broadcast's
    `BroadcastOptions(attest=...)`); SGLang cannot report them, and the log says once that its syncs
    go unattested. `http_wire` (sync "http"): how the bytes travel (`VLLMEngine(tensor_wire=...)`);
    one server takes them from the model itself (`SendWeights.load_weights`), several from the export.
    `broadcast_backend` (sync "broadcast"): the process group's, "gloo" or "nccl" (the trainer on
    CUDA: `BroadcastOptions(backend=...)`)."""
    if sync not in ("disk", "http", "broadcast"):
        raise ValueError(f"sync must be 'disk', 'http' or 'broadcast', got {sync!r}")
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        raise ValueError(f"environment variable {api_key_env!r} (engine.api_key_env) is not set")
    elsewhere = [u for u in urls if http_wire == "ipc" and not is_this_machine(urlsplit(u).hostname or "")]
    if sync == "http" and elsewhere:
        raise ValueError(
            f"engine.http_wire = 'ipc' has the server copy the weights out of this process's memory, so it must "
            f"run on this machine; {', '.join(elsewhere)} is not this machine's address: use http_wire = 'fetch'"
        )
    if partial and kind != "vllm":
        raise ValueError(f"rl.rollout.partial needs an engine that keeps aborted responses: 'vllm', not {kind!r}")
    common: dict[str, Any] = {"api_key": api_key, "http": http}
    if partial:
        common |= {"keep_partial": True, "pause_mode": "abort"}
    if kind == "vllm":
        common |= {"attest": attest, "tensor_wire": http_wire}
    if not attest or kind == "sglang":
        why = "engine.attest = false" if not attest else "SGLang has no call that reports checksums of its weights"
        log.warning("weight sync attestation is off for %s engine(s) %s (%s)", kind, ", ".join(urls), why)
    cls = {"vllm": VLLMEngine, "sglang": SGLangEngine}[kind]
    engines: list[InferenceEngine] = [cls(url, **common) for url in urls]
    if sync == "http":
        engines = [SendWeights(e, sync_timeout_s=sync_timeout_s) for e in engines]
    if sync == "broadcast":
        import torch

        from rollouts.loops.engines.broadcast import BroadcastPool, BroadcastWeights  # it imports this module
        from rollouts.sync import BroadcastOptions

        if broadcast_backend == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                "engine.broadcast_backend = 'nccl' sends the weights from the trainer's GPU, but this "
                "process sees no CUDA device: use 'gloo'"
            )
        options = BroadcastOptions(attest=attest, backend=broadcast_backend)
        if len(engines) > 1:  # one broadcast to them all: each bucket read or gathered once
            return BroadcastPool(engines, options, sync_timeout_s=sync_timeout_s)
        engines = [BroadcastWeights(engines[0], options, sync_timeout_s=sync_timeout_s)]
    if len(engines) == 1:
        return BoundedSync(engines[0], sync_timeout_s=sync_timeout_s)
    return EnginePool(engines, sync_timeout_s=sync_timeout_s)


_CAPABILITIES = ("abort", "resume", "load_weights", "push_weights", "bucket_bytes")
"""What an engine may offer beyond InferenceEngine (rollouts.types.Abortable, WeightLoader, the loops'
BucketLoader), passed on as attributes of the wrapper itself when the engine has them."""


class _Wrapped:
    """An engine wrapper: the InferenceEngine calls pass through to `engine` explicitly (so the
    protocol sees them), and so do the optional capabilities the engine has (`_CAPABILITIES`): from
    Python 3.12 a runtime protocol's isinstance check looks attributes up statically, never through
    `__getattr__`. Anything else (pause, last_upload, ...) passes through attribute lookup."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        for name in _CAPABILITIES:
            if not hasattr(type(self), name) and hasattr(engine, name):  # a subclass's own method stays
                setattr(self, name, getattr(engine, name))

    @property
    def name(self) -> str:
        return self.engine.name

    def __getattr__(self, attribute: str) -> object:
        return getattr(self.engine, attribute)

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        return await self.engine.generate(prompts, params)

    async def weight_version(self) -> int | None:
        return await self.engine.weight_version()

    async def health(self) -> bool:
        return await self.engine.health()


class SendWeights(_Wrapped):
    """An engine synced by tensors (sync "http"; vLLM with the worker extension), so it needs no view
    of the trainer's disk, each tensor in its own dtype (a bf16 model moves its bf16 bytes), by the
    engine's wire (`VLLMEngine(tensor_wire=...)`: fetched, inline, or mapped from this process's
    memory by IPC). `load_weights(tensors, version)` sends the model's tensors as they are (the loops
    hand them over without exporting: one server, one process; on a GPU and the IPC wire, by CUDA IPC
    handles), bounded by `sync_timeout_s` and a failure named as a WeightSyncError;
    `update_weights_from_disk(path, version)` reads the exported safetensors at `path` here and sends
    them. `last_upload` says what the last sync moved."""

    def __init__(self, engine: InferenceEngine, *, sync_timeout_s: float = 600.0) -> None:
        if not callable(getattr(engine, "update_weights_from_tensors", None)):
            raise ValueError(
                f"engine {engine.name} cannot take weights in request bodies (no update_weights_from_tensors): "
                "use engine.sync = 'disk'"
            )
        if not sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be > 0, got {sync_timeout_s}")
        super().__init__(engine)
        self.sync_timeout_s = sync_timeout_s
        self.last_upload: Any = None

    async def load_weights(self, tensors: Mapping[str, Any], weight_version: int) -> None:
        try:
            with anyio.fail_after(self.sync_timeout_s):
                self.last_upload = await self.engine.update_weights_from_tensors(tensors, weight_version)  # type: ignore[attr-defined]
        except AttestationError:
            raise  # the engine received other weights than those sent (not loaded): it names the tensors
        except Exception as exc:  # noqa: BLE001 - named as the engine's failure, as a pool's sync names it
            timeout = f"did not finish within sync_timeout_s={self.sync_timeout_s}"
            raise WeightSyncError(weight_version, [engine_failure(self.name, exc, timeout_text=timeout)], []) from exc

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        if is_adapter_dir(path):
            raise ValueError(
                f"{path!r} is a LoRA adapter: engine.sync = 'http' sends full weights only; use engine.sync = "
                "'disk' (the engine loads the adapter from that path) or model.lora.sync = 'merged'"
            )
        tensors = await trio.to_thread.run_sync(read_raw_weights, path)
        self.last_upload = await self.engine.update_weights_from_tensors(tensors, weight_version)  # type: ignore[attr-defined]


def read_raw_weights(path: str | os.PathLike[str]) -> dict[str, RawTensor]:
    """Every tensor of the safetensors files in directory `path`, in the dtype it was written in."""
    if not any(Path(path).glob("*.safetensors")):
        raise ValueError(f"{path} holds no .safetensors file to send")
    return read_safetensors_dir(Path(path))


class BoundedSync(_Wrapped):
    """One engine whose weight reloads are bounded by `sync_timeout_s`, as a pool bounds each of its
    engines: a reload that hangs or ends on another version is a WeightSyncError naming the engine
    (the client's own request timeout and retries alone could run far past the setting).
    Everything else passes straight through to the engine."""

    def __init__(self, engine: InferenceEngine, *, sync_timeout_s: float) -> None:
        if not sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be > 0, got {sync_timeout_s}")
        super().__init__(engine)
        self.sync_timeout_s = sync_timeout_s

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        await sync_weights_to_engines([self.engine], path, weight_version, timeout_s=self.sync_timeout_s)
