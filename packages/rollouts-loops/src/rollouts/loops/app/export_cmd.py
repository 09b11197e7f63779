"""`rollouts export CHECKPOINT OUT [--merge] [--base DIR]`: a checkpoint as a model others load.

A LoRA checkpoint (the adapter alone, PEFT's format) is written as that adapter (for
`peft.PeftModel.from_pretrained`, or vLLM's --lora-modules) or, with --merge, as a merged HF model
(base weights + alpha/r * B @ A) that transformers, vLLM and SGLang load as the base architecture.
The base model is the one the adapter records (adapter_config.json's base_model_name_or_path) or
--base; one the adapter was not trained on is refused. A full checkpoint is written as its HF
weights. Tokenizer files found beside the weights (or the base) are copied too.

    rollouts export runs/rl/checkpoints/step_50 merged/ --merge
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from rollouts.backends import build_components, export_weights, load_checkpoint, verify_checkpoint
from rollouts.backends.checkpoint.lora_files import ADAPTER_CONFIG, save_adapter
from rollouts.loops.run.run_dir import LOCK_FILE
from rollouts.types import LoraConfig, OptimizerConfig

# What a served model needs beside its weights: the tokenizer, and the chat template and generation
# defaults, without which a server formats prompts and stops differently from training.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_EXPORT_FILES = frozenset(
    {
        *_TOKENIZER_FILES,
        "config.json",
        "manifest.json",
        "model.safetensors.index.json",
        "adapter_config.json",
        "adapter_model.safetensors",
    }
)
# Files only a run directory holds: an export into one would delete its checkpoints and metrics.
_RUN_DIR_MARKERS = ("checkpoints", "resolved_config.toml", "resolved_config.json", LOCK_FILE)


def check_export_target(out: Path, *, force: bool = False) -> None:
    """Refuse an `out` whose contents the export would delete: a run directory always; any other
    non-empty directory that is not an earlier export unless `force`."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"export target {str(out)!r} exists and is not a directory")
    entries = list(out.iterdir())
    found = [m for m in _RUN_DIR_MARKERS if (out / m).exists()] + [
        e.name for e in entries if e.name.startswith("metrics_")
    ]
    if found:
        raise ValueError(
            f"export target {str(out)!r} is a run directory (it holds {', '.join(sorted(found)[:3])}): an export "
            "replaces its target, so choose another directory"
        )
    foreign = sorted(e.name for e in entries if not _is_export_file(e))
    if foreign and not force:
        raise ValueError(
            f"export target {str(out)!r} holds files an export did not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}): the export replaces the directory; pass --force to replace it"
        )


def _is_export_file(entry: Path) -> bool:
    name = entry.name
    return entry.is_file() and (name in _EXPORT_FILES or (name.startswith("model") and name.endswith(".safetensors")))


def _copy_tokenizer(sources: tuple[Path, ...], out: Path) -> None:
    """Each tokenizer file from the first of `sources` that has it (a file the export wrote stays)."""
    for name in _TOKENIZER_FILES:
        found = next((source / name for source in sources if (source / name).is_file()), None)
        if found is not None and not (out / name).exists():
            shutil.copyfile(found, out / name)


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, *, merge: bool = False, base: str | None = None, force: bool = False
) -> Path:
    """Write `checkpoint` to `out` as described in this module's docstring; returns `out`. `out` is
    replaced: a run directory is refused, and so is another non-empty directory unless `force`."""
    checkpoint, out = Path(checkpoint), Path(out)
    check_export_target(out, force=force)
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise ValueError(f"checkpoint {str(checkpoint)!r} fails its check: {'; '.join(problems)}")
    if not (checkpoint / ADAPTER_CONFIG).is_file():
        if base is not None:
            raise ValueError(f"--base {base!r} is for LoRA checkpoints; {str(checkpoint)!r} holds full weights")
        components = build_components(checkpoint, OptimizerConfig(), num_training_steps=1)
        export_weights(components, out, durable=True)
        _copy_tokenizer((checkpoint,), out)
        return out
    saved = json.loads((checkpoint / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    base_dir = Path(base or saved.get("base_model_name_or_path") or "")
    if not (base_dir / "config.json").is_file():
        source = "--base" if base else "adapter_config.json's base_model_name_or_path"
        raise ValueError(f"base model {str(base_dir)!r} ({source}) is not a local model directory: pass --base DIR")
    lora = LoraConfig(
        rank=int(saved["r"]),
        alpha=float(saved["lora_alpha"]),
        target_modules=tuple(saved["target_modules"]),
    )
    components = build_components(base_dir, OptimizerConfig(), num_training_steps=1, lora=lora, dtype=torch.float32)
    load_checkpoint(components, checkpoint, load_optimizer=False, restore_rng=False)
    if merge:
        export_weights(components, out, durable=True)
    else:
        save_adapter(components.model, out)
    # the run's tokenizer where the checkpoint kept it; what it lacks (generation defaults) from the base
    _copy_tokenizer((checkpoint, base_dir) if (checkpoint / "tokenizer.json").is_file() else (base_dir,), out)
    return out


def cmd_export(args: argparse.Namespace) -> int:
    """Exit 0 with the directory printed, or 2 with what is wrong (a damaged checkpoint, a wrong base)."""
    try:
        out = export_checkpoint(args.checkpoint, args.out, merge=args.merge, base=args.base, force=args.force)
    except ValueError as e:
        print(f"rollouts export: {e}", file=sys.stderr)
        return 2
    print(f"exported: {out}")
    return 0
