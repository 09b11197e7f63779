"""Run configs for the `rollouts` command: TOML files mapped onto frozen configs, strictly.

A run file has the training config under [sft] or [rl] (rollouts-types' SFTConfig / RLConfig)
plus the run's own sections: [model], [data], [engine], [run]. Unknown keys, wrong types and
out-of-range values are errors naming the file, the key and the rule, raised before any work.
`--set key.path=value` overrides (the value is parsed as TOML, falling back to a bare string).
TOML has no null: an optional setting is switched off with the string "none"
(`rl.optimizer.max_grad_norm = "none"`), and the resolved config writes None that way.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollouts.loops.algorithms import ALGORITHMS, preset_dicts
from rollouts.loops.app.agent_spec import AgentSpec
from rollouts.loops.app.overrides import apply_overrides as apply_overrides  # the --set edits, re-exported
from rollouts.loops.app.reward_spec import BUILTIN_REWARDS as BUILTIN_REWARDS  # re-exported
from rollouts.loops.app.reward_spec import RewardModelSpec as RewardModelSpec
from rollouts.loops.app.reward_spec import RewardSpec as RewardSpec
from rollouts.loops.app.run_sections import DistillSpec
from rollouts.loops.app.toml_out import NONE
from rollouts.loops.errors import ConfigError as ConfigError  # re-exported: the config's own error
from rollouts.types import LoraConfig, RLConfig, SFTConfig, check_fields, from_dict, require

EngineKind = Literal["inprocess", "process", "rollout_process", "vllm", "sglang"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Where the model comes from and how it is placed."""

    path: str = ""
    """HF-format model directory (config.json + safetensors); empty only for the demo."""
    tokenizer_path: str = ""
    """Tokenizer directory (default: `path`)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gradient_checkpointing: bool = False
    compile: Literal["none", "layers"] = "none"
    """`layers`: each decoder layer compiled with torch.compile (fused norms, rotary and activations;
    the first steps pay the compile time)."""
    gather_once_per_step: bool = False
    """Under torchrun (FSDP2): gather each layer once per step and reduce its gradients once, not per
    micro-batch; fewer collectives, at the memory of the whole model's weights and gradients per rank
    during the step (rollouts.backends.shard_model)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (rank 0: off); needs rollouts-backends[lora]."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec:
    """Training and evaluation data files (JSONL or JSON)."""

    train_path: str = ""
    eval_path: str = ""
    prompt_key: str = "prompt"
    """Field holding the prompt text (RL) ; SFT reads `messages`."""
    answer_key: str = "answer"
    """Field holding the reference answer the reward compares against."""
    num_eval: int = 200
    """Evaluate on at most this many eval records."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.num_eval >= 0, "DataSpec.num_eval", self.num_eval, "be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """Which inference engine generates rollouts."""

    kind: EngineKind = "inprocess"
    """"inprocess": the in-process sampler; "process": the same sampler in a process of its own (runs
    beside training instead of sharing its interpreter: for rl.overlap); "rollout_process": that
    process runs the rollout manager too (rollouts.loops.RolloutProcess: the reward and hooks by
    import path, no rl.rollout.partial); "vllm" / "sglang": servers."""
    urls: tuple[str, ...] = ()
    """Server base URLs for vllm / sglang (several spread the load)."""
    api_key_env: str = ""
    """Name of the environment variable holding the API key (never the key itself)."""
    timeout_s: float = 120.0
    """Bound on one request (a generate call, a weight load) to an engine."""
    max_retries: int = 3
    sync_timeout_s: float = 600.0
    """Bound on one weight sync to all engines."""
    sync: Literal["disk", "http", "broadcast"] = "disk"
    """How new weights reach remote engines: "disk" sends the absolute path of the exported weights
    (the engines must see the trainer's filesystem at that path); "http" sends the weights in request
    bodies, chunked (no shared disk; vLLM started with the worker extension: `rollouts engine vllm`);
    "broadcast" through a process group with the engine's workers (vLLM's worker extension, or
    SGLang; `broadcast_backend` says which kind)."""
    http_wire: Literal["fetch", "inline", "ipc"] = "fetch"
    """With sync = "http": "fetch" serves the weights' raw safetensors bytes on a short-lived endpoint
    of the trainer that the engine's workers download (the bytes on the wire are the weights' own;
    the engine must be able to connect back to the trainer); "inline" sends them base64 in the
    requests to the engine (4/3 the bytes, slower), for an engine that cannot reach the trainer;
    "ipc", for a server on the trainer's machine, has its workers copy the weights out of the
    trainer's memory, bucket by bucket: by CUDA IPC handles from the trainer's GPU, through files in
    /dev/shm from the CPU (one server: straight from the model, nothing exported)."""
    broadcast_backend: Literal["gloo", "nccl"] = "gloo"
    """With sync = "broadcast": "gloo" (the default; runs everywhere: the weights travel through host
    memory, and the engine's workers receive them there) or "nccl" (GPU to GPU: the trainer on CUDA,
    the engine's workers on GPUs of their own; NCCL cannot put two ranks on one GPU, so not for an
    engine sharing the trainer's GPU)."""
    num_threads: int = 1
    """Torch threads of the engine process (kind = "process" or "rollout_process")."""
    attest: bool = True
    """After every sync the engine reports checksums of the weights it loaded, computed where they live
    (vLLM's worker extension, the engine process), and a mismatch with the trainer's stops the run naming
    the tensors (rollouts.sync.fingerprint). Off: for an engine that cannot report (SGLang; vLLM without
    the worker extension). The in-process engine loads in the trainer's own process: nothing to attest."""
    weights_transport: Literal["auto", "shared_memory", "cuda_ipc"] = "auto"
    """How a sync hands the weights to the engine process (kind = "process" or "rollout_process"):
    "cuda_ipc" by CUDA IPC handles, device to device (the engine on the trainer's GPU);
    "shared_memory" through a file in /dev/shm; "auto": "cuda_ipc" where the trainer's weights are
    on the engine's GPU, else "shared_memory"."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.timeout_s > 0, "EngineSpec.timeout_s", self.timeout_s, "be > 0")
        require(self.max_retries >= 0, "EngineSpec.max_retries", self.max_retries, "be >= 0")
        require(self.sync_timeout_s > 0, "EngineSpec.sync_timeout_s", self.sync_timeout_s, "be > 0")
        require(self.sync in ("disk", "http", "broadcast"), "EngineSpec.sync", self.sync, "be disk, http or broadcast")
        if self.sync in ("http", "broadcast"):
            kinds = ("vllm",) if self.sync == "http" else ("vllm", "sglang")
            require(self.kind in kinds, "EngineSpec.sync", self.sync, f"be 'disk' unless kind is one of {kinds}")
        require(
            self.http_wire in ("fetch", "inline", "ipc"),
            "EngineSpec.http_wire",
            self.http_wire,
            "be fetch, inline or ipc",
        )
        if self.http_wire != "fetch":
            require(self.sync == "http", "EngineSpec.http_wire", self.http_wire, "be 'fetch' unless sync is 'http'")
        backends = ("gloo", "nccl")
        require(
            self.broadcast_backend in backends,
            "EngineSpec.broadcast_backend",
            self.broadcast_backend,
            "be gloo or nccl",
        )
        if self.broadcast_backend != "gloo":
            require(
                self.sync == "broadcast",
                "EngineSpec.broadcast_backend",
                self.broadcast_backend,
                "be 'gloo' unless sync is 'broadcast'",
            )
        require(self.num_threads >= 1, "EngineSpec.num_threads", self.num_threads, "be >= 1")
        if self.kind in ("inprocess", "process", "rollout_process"):
            require(not self.urls, "EngineSpec.urls", self.urls, f"be empty for kind={self.kind!r}")
        else:
            require(
                len(self.urls) >= 1, "EngineSpec.urls", self.urls, f"name at least one server for kind={self.kind!r}"
            )
            for i, url in enumerate(self.urls):
                require(
                    url.startswith(("http://", "https://")),
                    f"EngineSpec.urls[{i}]",
                    url,
                    "start with http:// or https://",
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    """Where a run writes and whether it resumes."""

    out_dir: str = ""
    """Run directory; empty: a new one, runs/<command>-<date>-<time>."""
    resume: Literal["auto", "never", "must"] = "auto"
    """'auto': continue from out_dir's newest checkpoint if there is one; 'never': refuse a directory
    that has one; 'must': refuse one that has none. A resume whose config or inputs changed is refused."""
    resume_from: str = ""
    """A checkpoint directory (out_dir/checkpoints/step_N) to resume from instead of the newest, e.g.
    when the newest failed its check; newer ones are moved to checkpoints/abandoned/."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class LogSpec:
    """Where metrics go besides out_dir/metrics_<stage>.jsonl and the console."""

    wandb: bool = False
    """Log to Weights & Biases (needs rollouts-loops[wandb])."""
    wandb_project: str = "rollouts"
    wandb_name: str = ""
    """Run name (default: the out_dir's name)."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    tensorboard: bool = False
    """Write TensorBoard scalars to out_dir/tensorboard (needs rollouts-loops[tensorboard])."""
    num_sample_completions: int = 2
    """Completions (prompt, response, reward) logged per RL step at INFO level; 0: none."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(
            self.num_sample_completions >= 0, "LogSpec.num_sample_completions", self.num_sample_completions, "be >= 0"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalSpec:
    """Evaluation during RL on data.eval_path (its first data.num_eval records)."""

    every_steps: int = 0
    """Evaluate after every this many steps and after the last; 0: never."""
    samples_per_prompt: int = 1
    """k of pass@k and maj@k (1: pass@1 only); correct: reward >= rl.correct_min_reward."""
    temperature: float = 0.0
    """0: greedy (then use samples_per_prompt = 1)."""
    stop_on_error: bool = False
    """A failed evaluation stops the run (after the step's metrics and checkpoint are saved); false: it is
    logged, counted as eval_failed, and the run goes on."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.every_steps >= 0, "EvalSpec.every_steps", self.every_steps, "be >= 0")
        require(self.samples_per_prompt >= 1, "EvalSpec.samples_per_prompt", self.samples_per_prompt, "be >= 1")
        require(self.temperature >= 0, "EvalSpec.temperature", self.temperature, "be >= 0")
        require(
            self.temperature > 0 or self.samples_per_prompt == 1,
            "EvalSpec.samples_per_prompt",
            self.samples_per_prompt,
            "be 1 with temperature 0 (greedy samples are all the same)",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HooksSpec:
    """The RL loop's other plug points, by import path; empty: the built-in."""

    rollout: str = ""
    """rollout(record, ctx) -> Samples (default: single turn; rollouts.loops.tool_rollout builds a multi-turn one)."""
    filter: str = ""
    """filter(group) -> None to keep, or the reason it was dropped."""
    advantages: str = ""
    """advantages(rewards_N, groups_N) -> advantages_N (torch tensors)."""
    loss: str = ""
    """A rollouts.losses.LossFn: loss(logprobs_B_T, batch, *, num_tokens, num_sequences, entropy_B_T)."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class SFTRun:
    """`rollouts sft`: a model, conversations, and an SFTConfig."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    run: RunSpec = field(default_factory=RunSpec)
    log: LogSpec = field(default_factory=LogSpec)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class RLRun:
    """`rollouts rl`: a model, prompts, engines, and an RLConfig (optionally from a preset)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    run: RunSpec = field(default_factory=RunSpec)
    reward: RewardSpec = field(default_factory=RewardSpec)
    hooks: HooksSpec = field(default_factory=HooksSpec)
    agent: AgentSpec = field(default_factory=AgentSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    log: LogSpec = field(default_factory=LogSpec)
    preset: str = ""
    """Name of an algorithm preset (grpo, drgrpo, dapo, gspo, cispo, rloo, reinforce_pp, ppo, ppo_no_critic, ...)."""
    rl: RLConfig = field(default_factory=RLConfig)
    distill: DistillSpec = field(default_factory=DistillSpec)
    """On-policy distillation from a teacher (off unless distill.path or distill.url is set)."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(
            not self.preset or self.preset in ALGORITHMS, "RLRun.preset", self.preset, f"be one of {sorted(ALGORITHMS)}"
        )
        if self.agent.fn:  # the agent is the rollout, in this process (its endpoint is the engine's)
            require(not self.hooks.rollout, "RLRun.hooks.rollout", self.hooks.rollout, "be empty with [agent] fn")
            require(
                self.engine.kind != "rollout_process",
                "RLRun.engine.kind",
                self.engine.kind,
                "not be 'rollout_process' with [agent] fn",
            )
        if self.model.lora.enabled and self.model.lora.sync == "adapter" and self.engine.kind != "inprocess":
            require(
                self.engine.kind == "vllm" and self.engine.sync == "disk",
                "RLRun.model.lora.sync",
                self.model.lora.sync,
                "be 'merged' unless engine.kind = 'vllm' with engine.sync = 'disk' (vLLM loads the adapter "
                f"from the trainer's path; got kind {self.engine.kind!r}, sync {self.engine.sync!r})",
            )


def _with_preset(data: dict[str, Any]) -> dict[str, Any]:
    """Merge a named algorithm preset under the user's [rl.algorithm] and [rl.rollout] settings."""
    name = data.get("preset", "")
    if not isinstance(name, str) or name not in ALGORITHMS:
        return data  # RLRun's own validation names the bad preset
    rl = data.get("rl", {})
    if not isinstance(rl, Mapping) or not all(isinstance(rl.get(k, {}), Mapping) for k in ("algorithm", "rollout")):
        return data  # not tables: RLRun's own validation names the key and what it got
    algorithm, rollout = preset_dicts(name)
    rl = dict(rl)
    rl["algorithm"] = {**algorithm, **rl.get("algorithm", {})}
    rl["rollout"] = {**rollout, **rl.get("rollout", {})}
    return {**data, "rl": rl}


def _takes_none_string(tp: Any) -> bool:
    """An optional field whose other members are not str, so the string "none" can only mean None."""
    args = typing.get_args(tp)
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args and str not in args


def _resolve_nones(cls: type, data: Any) -> Any:
    """`data` with "none" replaced by None wherever `cls` (nested dataclasses included) allows None."""
    if not isinstance(data, Mapping):
        return data  # from_dict names what it got
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for f in dataclasses.fields(cls):
        if f.name not in out:
            continue
        tp, value = hints[f.name], out[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out[f.name] = _resolve_nones(tp, value)
        elif value == NONE and _takes_none_string(tp):
            out[f.name] = None
    return out


def build_run(cls: type, data: Mapping[str, Any], *, source: str = "<config>") -> Any:
    """Build SFTRun / RLRun from a mapping; errors are ConfigError naming `source` and the key."""
    if cls is RLRun:
        data = _with_preset(dict(data))
    try:
        return from_dict(cls, _resolve_nones(cls, data))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from e


def load_run(cls: type, path: str | Path | None, overrides: Sequence[str] = ()) -> Any:
    """Read a TOML run file (or nothing) plus --set overrides into a validated SFTRun / RLRun."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError(f"{source}: no such config file") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{source}: not valid TOML: {e}") from e
    if overrides:
        source += " with --set " + " ".join(overrides)
        data = apply_overrides(data, overrides)
    return build_run(cls, data, source=source)
