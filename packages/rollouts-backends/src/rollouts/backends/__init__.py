"""rollouts-backends: training as functions, crash-safe checkpoints, FSDP2, in-process sampling."""

from importlib.metadata import PackageNotFoundError, version

from rollouts.backends.checkpoint.dirs import (
    has_optimizer_state,
    latest_checkpoint,
    step_checkpoints,
    sweep_temporary,
    verify_checkpoint,
)
from rollouts.backends.checkpoint.export import export_weights, load_model_weights, read_weights
from rollouts.backends.checkpoint.model_files import load_tokenizer, resolve_model_dir
from rollouts.backends.checkpoint.save_load import load_checkpoint, save_checkpoint
from rollouts.backends.checkpoint.weight_buckets import WeightBuckets
from rollouts.backends.checkpoint.writer import CheckpointWriter
from rollouts.backends.engine_process.client import EngineProcessError, EngineProcessOptions, ProcessEngine
from rollouts.backends.sampling.engine import InProcessEngine
from rollouts.backends.sampling.sampler import generate, sample_next_tokens
from rollouts.backends.train.components import (
    TrainingComponents,
    build_components,
    build_optimizer,
    build_scheduler,
    check_model_dir,
    load_hf_model,
    lr_multiplier,
)
from rollouts.backends.train.cpu_memory import retain_freed_cpu_memory
from rollouts.backends.train.distributed import shard_model, transformer_blocks
from rollouts.backends.train.inputs import attention_mask_4d, document_masked, micro_batch_to_torch, packed_only
from rollouts.backends.train.step import (
    DISTILL_DIVERGENCE_METRIC,
    DistillTerm,
    NonFiniteError,
    compute_logprobs,
    forward_backward,
    optim_step,
    token_logprobs_of_model,
)


def _version() -> str:
    try:
        return version("rollouts-backends")  # written once, in pyproject.toml
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "DISTILL_DIVERGENCE_METRIC",
    "CheckpointWriter",
    "DistillTerm",
    "EngineProcessError",
    "EngineProcessOptions",
    "InProcessEngine",
    "NonFiniteError",
    "ProcessEngine",
    "TrainingComponents",
    "attention_mask_4d",
    "build_components",
    "check_model_dir",
    "build_optimizer",
    "build_scheduler",
    "compute_logprobs",
    "document_masked",
    "WeightBuckets",
    "export_weights",
    "forward_backward",
    "generate",
    "has_optimizer_state",
    "latest_checkpoint",
    "load_checkpoint",
    "load_hf_model",
    "load_model_weights",
    "load_tokenizer",
    "lr_multiplier",
    "micro_batch_to_torch",
    "optim_step",
    "packed_only",
    "read_weights",
    "resolve_model_dir",
    "retain_freed_cpu_memory",
    "sample_next_tokens",
    "save_checkpoint",
    "shard_model",
    "step_checkpoints",
    "sweep_temporary",
    "token_logprobs_of_model",
    "transformer_blocks",
    "verify_checkpoint",
]
