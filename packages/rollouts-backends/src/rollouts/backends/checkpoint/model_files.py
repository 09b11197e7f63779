"""Where a model's files come from: a local directory or a Hugging Face Hub id, and the tokenizer
saved with them, loaded so that it gives the ids it gave when it was saved.

Nothing here downloads unless given a hub id that is not a local directory; with HF_HUB_OFFLINE=1
a hub id resolves from the local hub cache only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["load_tokenizer", "resolve_model_dir"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
"""What a hub download fetches: configs, safetensors weights and tokenizer files (never pickles)."""
_GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def resolve_model_dir(path_or_id: str | Path, *, revision: str | None = None) -> Path:
    """The local directory of a model: `path_or_id` itself when it is a directory, else the
    snapshot of that Hugging Face Hub id (downloaded, or from the hub cache when offline).

    A value that is neither an existing directory nor a hub id ("org/name"), or a hub id the hub
    cannot provide (offline, unknown, gated), is a ValueError naming the value and the cause.
    """
    path = Path(path_or_id)
    if path.is_dir():
        return path
    text = str(path_or_id)
    if not _HUB_ID.match(text):
        raise ValueError(f"model path {text!r} is not an existing directory (nor a hub id like 'org/name')")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=text, revision=revision, allow_patterns=_MODEL_FILES))
    except Exception as e:  # offline, unknown repo, gated, network: one clear error
        raise ValueError(
            f"model path {text!r} is not a local directory, and the Hugging Face Hub could not provide it "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); download it where the hub is "
            "reachable (huggingface-cli download) and give the directory"
        ) from e


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in `path`, as it was saved.

    AutoTokenizer picks the tokenizer class from the model's config.json when the saved
    tokenizer_config.json names only the generic class: a tokenizer built with the `tokenizers`
    library and saved beside a Qwen2 config then loads as Qwen2Tokenizer, which rebuilds its own
    pre-tokenizer and drops spaces unless the tokens are spelled byte-level ("self._cmd = cmd":
    6 ids instead of 8). A tokenizer saved as the generic class is loaded as that class, from its
    tokenizer.json; any other goes through AutoTokenizer. rollouts' tiny tokenizers
    (rollouts.loops.recipes.tiny) are spelled byte-level, so AutoTokenizer loads them correctly too.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    config_file = path / "tokenizer_config.json"
    saved_class = None
    if config_file.is_file():
        try:
            saved_class = json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    if saved_class in _GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
