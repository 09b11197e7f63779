"""rollouts-sync: inference-engine clients (vLLM, SGLang) over HTTP and parallel weight sync (no torch)."""

from rollouts.sync._http import EngineError, RetryPolicy
from rollouts.sync.pool import EnginePool, NoHealthyEngineError
from rollouts.sync.sglang import SGLangEngine
from rollouts.sync.vllm import WORKER_EXTENSION_CLS, VLLMEngine
from rollouts.sync.weight_sync import EngineFailure, SyncResult, WeightSyncError, sync_weights_to_engines

__version__ = "0.1.0"

__all__ = [
    "WORKER_EXTENSION_CLS",
    "EngineError",
    "EngineFailure",
    "EnginePool",
    "NoHealthyEngineError",
    "RetryPolicy",
    "SGLangEngine",
    "SyncResult",
    "VLLMEngine",
    "WeightSyncError",
    "sync_weights_to_engines",
]
