"""LoRA adapters with PEFT: add them to a causal LM, switch them off for the KL reference.

The adapter is injected into the transformers model itself (`peft.inject_adapter_in_model`), so
the trained model stays the same `PreTrainedModel`: `forward_backward`, `compute_logprobs` and the
fused log-probs path see the same modules (`model.base_model`, the output projection) as with full
fine-tuning, and FSDP2 shards it the same way. Only adapter parameters require gradients, so
`build_optimizer` holds only them. The reference policy is the same weights with the adapter
disabled (`reference_components`): no second copy of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from rollouts.backends.train.components import TrainingComponents, model_attr, set_model_attr
from rollouts.types import LoraConfig

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

__all__ = [
    "AdapterDisabled",
    "adapter_disabled",
    "adapter_config_dict",
    "adapter_state_dict",
    "base_fingerprint",
    "load_adapter_tensors",
    "merge_lora_tensors",
    "merged_copy",
    "syncs_adapter",
    "apply_lora",
    "has_lora",
    "lora_layers",
    "reference_components",
    "require_peft",
]

_EXTRA = "rollouts-backends[lora]"


def require_peft() -> Any:
    """The `peft` module, or an ImportError naming the extra that installs it."""
    try:
        import peft
    except ImportError as e:
        raise ImportError(
            f"LoRA (model.lora.rank > 0) needs PEFT, which is not installed: pip install '{_EXTRA}' "
            "(or 'rollouts-loops[lora]')"
        ) from e
    return peft


def _matches(full_name: str, target: str) -> bool:
    """PEFT's rule: a plain name matches the last name component(s); a regex matches the whole name."""
    if full_name == target or full_name.endswith("." + target):
        return True
    return re.fullmatch(target, full_name) is not None


def _targets(model: torch.nn.Module, config: LoraConfig) -> dict[str, torch.nn.Linear]:
    """Linear layers that get an adapter; errors name a target that matches nothing and a rank too large."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    out_proj = model_attr(model, "get_output_embeddings")() if hasattr(model, "get_output_embeddings") else None
    chosen: dict[str, torch.nn.Linear] = {}
    for target in config.target_modules:
        found = {n: m for n, m in linears.items() if _matches(n, target)}
        if not found:
            names = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ValueError(
                f"LoraConfig.target_modules entry {target!r} matches no linear layer of the model "
                f"(its linear layers are named {names})"
            )
        chosen.update(found)
    for name, layer in chosen.items():
        if layer is out_proj:
            raise ValueError(
                f"LoraConfig.target_modules selects the output projection {name!r}: log-probs are computed "
                "from its weight directly, so it cannot carry an adapter (leave it out)"
            )
        limit = min(layer.in_features, layer.out_features)
        if config.rank > limit:
            raise ValueError(
                f"LoraConfig.rank = {config.rank} is larger than layer {name!r} allows "
                f"({layer.in_features} -> {layer.out_features}: rank <= {limit})"
            )
    return chosen


def _peft_targets(config: LoraConfig, targets: dict[str, torch.nn.Linear]) -> list[str]:
    """Plain names stay as given (what PEFT and vLLM expect); with a regex, the full names it chose."""
    if all(re.fullmatch(r"[\w.]+", t) for t in config.target_modules):
        return sorted(set(config.target_modules))
    return sorted(targets)


def check_lora_targets(model_dir: str, config: LoraConfig) -> None:
    """The checks `apply_lora` makes (every target matches a linear layer, the rank fits each
    layer, the output projection stays out), on the model at `model_dir` built on the meta device:
    no weights read, so a run refuses bad LoRA settings before it loads anything."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        config_of_model = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config_of_model)  # type: ignore[no-untyped-call]  # unannotated upstream
    _targets(model, config)


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """Inject a LoRA adapter ('default') into `model` in place and freeze every other weight.

    Returns the same model. Call before `shard_model` and before building the optimizer. The
    adapter starts as a no-op (B = 0), so the model's outputs are unchanged until it trains.
    """
    if not config.enabled:
        raise ValueError(f"LoraConfig.rank = {config.rank}: apply_lora needs rank >= 1 (0 means no adapter)")
    if has_lora(model):
        raise ValueError("the model already has a LoRA adapter")
    peft = require_peft()
    targets = _targets(model, config)
    peft_config = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=_peft_targets(config, targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    name_or_path = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    peft_config.base_model_name_or_path = name_or_path or None
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    peft.inject_adapter_in_model(peft_config, model, adapter_name="default")
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    for layer in lora_layers(model).values():  # the adapter in the model's dtype and device
        cast(torch.nn.Module, layer).to(device=device, dtype=dtype)  # PEFT's layers are Modules and LoraLayers
    set_model_attr(model, "rollouts_lora_config", peft_config)  # read by adapter checkpoints and sync
    set_model_attr(model, "rollouts_lora", config)  # its sync mode is read by the loops' weight sync
    # before sharding: every weight is whole here
    set_model_attr(model, "rollouts_base_fingerprint", base_fingerprint(model))
    return model


def lora_layers(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """Module name -> PEFT LoRA layer, in model order (empty without an adapter)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: torch.nn.Module) -> bool:
    """Whether `model` (or the model an `AdapterDisabled` wraps) carries a LoRA adapter."""
    return bool(lora_layers(model))


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run `model` as its base model: every LoRA layer passes its input to the frozen weight only."""
    layers = list(lora_layers(model).values())
    if not layers:
        raise ValueError("adapter_disabled: the model has no LoRA adapter")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        # enable_adapters marks adapter weights trainable again; only adapter weights ever are.
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_" in name)


class AdapterDisabled(torch.nn.Module):
    """The base model behind a LoRA model: forward runs with the adapter switched off.

    It shares every weight with the trained model (no copy). `model.base_model`,
    `get_output_embeddings()` and `config` are the wrapped model's, so the log-prob functions
    treat it as the model itself; train/eval apply to the wrapped model for the call only.
    """

    _wrapped: torch.nn.Module

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        if not has_lora(model):
            raise ValueError("AdapterDisabled needs a model with a LoRA adapter (apply_lora)")
        object.__setattr__(self, "_wrapped", model)  # not a submodule: its mode is its own

    @property
    def wrapped(self) -> torch.nn.Module:
        return self._wrapped

    @property
    def config(self) -> Any:
        return model_attr(self._wrapped, "config")

    @property
    def base_model(self) -> torch.nn.Module:
        base: torch.nn.Module = model_attr(self._wrapped, "base_model")
        return base

    def get_output_embeddings(self) -> torch.nn.Module:
        embeddings: torch.nn.Module = model_attr(self._wrapped, "get_output_embeddings")()
        return embeddings

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self._wrapped.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self._wrapped.named_parameters(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._wrapped
        was_training = model.training
        model.train(self.training)
        try:
            with adapter_disabled(model):
                return model(*args, **kwargs)
        finally:
            model.train(was_training)


def reference_components(components: TrainingComponents) -> TrainingComponents:
    """The KL reference for a LoRA run: the same components with the adapter switched off."""
    if not has_lora(components.model):
        raise ValueError("reference_components needs a LoRA model; copy the starting model for full fine-tuning")
    return dataclasses.replace(components, model=AdapterDisabled(components.model).eval())


PEFT_PREFIX = "base_model.model."
"""PeftModel.save_pretrained names adapter weights by the wrapped model's names under this prefix."""


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights under PEFT's file names (`base_model.model.<module>.lora_A.weight`), on CPU.

    Under FSDP2 every rank must call it (each sharded weight is gathered); all ranks get the whole.
    """
    if not has_lora(model):
        raise ValueError("adapter_state_dict: the model has no LoRA adapter")
    out = {}
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            continue
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[PEFT_PREFIX + name.replace(".default.", ".")] = full.detach().to("cpu", copy=True).contiguous()
    return out


def base_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the base weights (names, shapes and each weight's first values).

    An adapter checkpoint records it; loading it into another base model is refused. Cheap on a 7B
    model (it reads 64 values per weight); computed by apply_lora before any sharding.
    """
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if ".lora_" in name:
            continue
        # bfloat16-rounded: the same base loaded in float32 or bfloat16 has the same fingerprint
        head = param.detach().reshape(-1)[:64].to("cpu").to(torch.bfloat16).to(torch.float32)
        digest.update(f"{name.replace('.base_layer.', '.')}|{tuple(param.shape)}|".encode())
        digest.update(head.numpy().tobytes())
    return digest.hexdigest()[:16]


def adapter_config_dict(model: torch.nn.Module) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it (sets as sorted lists), plus `base_model_name_or_path`."""
    config = getattr(model, "rollouts_lora_config", None)
    if config is None:
        raise ValueError("the model has no adapter made by apply_lora (no LoRA config on it)")
    out = {}
    for key, value in config.to_dict().items():
        out[key] = sorted(value) if isinstance(value, (set, frozenset)) else value
    plain: dict[str, Any] = json.loads(json.dumps(out, default=str))
    return plain


def _module_key(peft_name: str) -> str:
    """`base_model.model.X.lora_A.weight` -> the injected parameter name `X.lora_A.default.weight`."""
    if not peft_name.startswith(PEFT_PREFIX) or not peft_name.endswith(".weight"):
        raise ValueError(f"{peft_name!r} is not a PEFT adapter weight name ({PEFT_PREFIX}<module>.lora_A.weight)")
    stem = peft_name[len(PEFT_PREFIX) : -len(".weight")]
    return f"{stem}.default.weight"


def load_adapter_tensors(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], *, base: str | None = None, source: str = "adapter"
) -> None:
    """Copy PEFT-named adapter weights into `model`'s adapter (sharded or not).

    `base` is the fingerprint of the base model the adapter was trained on (base_fingerprint): a
    different one is refused, as is a missing, extra or differently shaped adapter weight.
    """
    if not has_lora(model):
        raise ValueError(f"{source} holds a LoRA adapter but the model has none: set model.lora as it was trained")
    mine = getattr(model, "rollouts_base_fingerprint", None)
    if base is not None and mine is not None and base != mine:
        raise ValueError(
            f"{source} is an adapter for another base model (base fingerprint {base!r}; this model's is "
            f"{mine!r}, from {getattr(model.config, 'name_or_path', '') or 'an unnamed model'!r})"
        )
    params = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    wanted = {_module_key(k): v for k, v in tensors.items()}
    missing, extra = sorted(set(params) - set(wanted)), sorted(set(wanted) - set(params))
    if missing or extra:
        raise ValueError(f"{source} does not fit the model's adapter: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, tensor in wanted.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, the model's adapter {tuple(params[name].shape)} "
                "(another rank or base model)"
            )
    if any(hasattr(p, "full_tensor") for p in params.values()):
        # (a copy typed as the dict of torch's wider value type it declares)
        set_model_state_dict(model, dict(wanted), options=StateDictOptions(full_state_dict=True, strict=False))
        return
    with torch.no_grad():
        for name, tensor in wanted.items():
            params[name].copy_(tensor)


def merge_lora_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named full weights from a LoRA model's full state dict: W + (alpha / r) * B @ A per adapted layer.

    `state` is the model's state dict (whole tensors, e.g. gathered on CPU); adapter entries are
    dropped and `<module>.base_layer.<w>` becomes `<module>.<w>`, so the result loads as the base
    architecture (transformers, vLLM, SGLang).
    """
    out: dict[str, torch.Tensor] = {}
    layers = lora_layers(model)
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        module, _, leaf = name.rpartition(".base_layer.")
        if not _:
            out[name] = tensor
            continue
        if leaf == "weight" and module in layers:
            a = state[f"{module}.lora_A.default.weight"].to(torch.float32)
            b = state[f"{module}.lora_B.default.weight"].to(torch.float32)
            scale = float(layers[module].scaling["default"])
            tensor = (tensor.to(torch.float32) + scale * (b @ a)).to(tensor.dtype)
        out[f"{module}.{leaf}"] = tensor
    return out


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model (no adapter) whose weights are `model`'s with the adapter merged in: what an
    in-process engine with its own copy samples from, and loads merged exported weights into."""
    from transformers import AutoModelForCausalLM

    first = next(model.parameters())
    state = {n: t.detach() for n, t in model.state_dict().items()}
    plain: torch.nn.Module = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        model_attr(model, "config"), dtype=first.dtype
    )
    plain.load_state_dict(merge_lora_tensors(model, state), strict=True)
    return plain.to(first.device).eval()


def syncs_adapter(model: torch.nn.Module) -> bool:
    """Whether engines get `model`'s adapter alone (LoRA with sync 'adapter'), not merged full weights."""
    config = getattr(model.wrapped if isinstance(model, AdapterDisabled) else model, "rollouts_lora", None)
    return isinstance(config, LoraConfig) and config.sync == "adapter" and has_lora(model)
