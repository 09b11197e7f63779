"""rollouts-types: the shared vocabulary of the rollouts packages (standard library only)."""

from importlib.metadata import PackageNotFoundError, version

from rollouts.types.arrays import LogProbs, LossMask, TokenIds
from rollouts.types.configs import (
    AlgorithmConfig,
    CheckpointConfig,
    CriticConfig,
    OptimizerConfig,
    ReferenceConfig,
    RLConfig,
    RolloutConfig,
    SamplingParams,
    SFTConfig,
    from_dict,
)
from rollouts.types.frozen import freeze, thaw
from rollouts.types.lora import DEFAULT_LORA_TARGETS, LoraConfig, LoraSync
from rollouts.types.micro_batch import MicroBatch
from rollouts.types.preference import DPOConfig, PreferenceConfig, PreferenceLoss
from rollouts.types.protocols import (
    Abortable,
    BatchedRewardFn,
    Environment,
    EnvStep,
    FilterFn,
    GenerateFn,
    InferenceEngine,
    MetricsLogger,
    RewardFn,
    SyncSampler,
    Tokenizer,
    WeightLoader,
)
from rollouts.types.samples import Prompt, RolloutBatch, Sample, Status
from rollouts.types.state import TrainingState
from rollouts.types.validation import check_fields, require


def _version() -> str:
    try:
        return version("rollouts-types")  # written once, in pyproject.toml
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "BatchedRewardFn",
    "DEFAULT_LORA_TARGETS",
    "Abortable",
    "LogProbs",
    "LoraConfig",
    "LossMask",
    "LoraSync",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "DPOConfig",
    "EnvStep",
    "Environment",
    "FilterFn",
    "GenerateFn",
    "InferenceEngine",
    "MetricsLogger",
    "MicroBatch",
    "OptimizerConfig",
    "PreferenceConfig",
    "PreferenceLoss",
    "Prompt",
    "RLConfig",
    "ReferenceConfig",
    "RewardFn",
    "RolloutBatch",
    "RolloutConfig",
    "SFTConfig",
    "Sample",
    "SamplingParams",
    "Status",
    "SyncSampler",
    "Tokenizer",
    "WeightLoader",
    "TokenIds",
    "TrainingState",
    "check_fields",
    "freeze",
    "from_dict",
    "require",
    "thaw",
]
