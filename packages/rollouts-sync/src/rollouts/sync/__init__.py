"""rollouts-sync: inference-engine clients (vLLM, SGLang) over HTTP and parallel weight sync (no torch)."""

import importlib.metadata

from rollouts.sync._common import is_adapter_dir, is_this_machine
from rollouts.sync._http import DEFAULT_HTTP, EngineError, HTTPOptions, RetryPolicy
from rollouts.sync.broadcast_wire import DEFAULT_BROADCAST, BroadcastOptions
from rollouts.sync.fingerprint import AttestationError, check_attestation, fingerprint, fingerprint_dir
from rollouts.sync.openai_clients import ChatClient, PromptLogprobsClient
from rollouts.sync.pool import EnginePool, NoHealthyEngineError
from rollouts.sync.raw import RawTensor
from rollouts.sync.sglang import SGLangEngine
from rollouts.sync.tensor_rpc import WORKER_EXTENSION_CLS, TensorUpload
from rollouts.sync.vllm import VLLMEngine
from rollouts.sync.weight_sync import EngineFailure, SyncResult, WeightSyncError, sync_weights_to_engines


def _version() -> str:
    try:
        return importlib.metadata.version("rollouts-sync")  # written once, in pyproject.toml
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "DEFAULT_BROADCAST",
    "DEFAULT_HTTP",
    "AttestationError",
    "ChatClient",
    "WORKER_EXTENSION_CLS",
    "BroadcastOptions",
    "EngineError",
    "EngineFailure",
    "EnginePool",
    "HTTPOptions",
    "NoHealthyEngineError",
    "PromptLogprobsClient",
    "RawTensor",
    "RetryPolicy",
    "SGLangEngine",
    "SyncResult",
    "TensorUpload",
    "VLLMEngine",
    "WeightSyncError",
    "check_attestation",
    "fingerprint",
    "fingerprint_dir",
    "is_adapter_dir",
    "is_this_machine",
    "sync_weights_to_engines",
]
