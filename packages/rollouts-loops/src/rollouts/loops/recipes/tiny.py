"""Small local models and tokenizers, built in seconds with no hub: for the demo and for tests.

The tokenizer is a BPE trained by the `tokenizers` library on the task's own text (digits stay
single tokens, so arithmetic is learnable), wrapped as a transformers fast tokenizer with a chat
template; the model is a random-init Qwen2 (head_dim >= 32, so vLLM's CPU build serves it too).

The tokens are spelled byte-level, as Qwen2's own are: transformers' AutoTokenizer loads a
tokenizer saved beside a Qwen2 config as Qwen2Tokenizer, which keeps only the vocabulary and the
merges and splits text its own way, then maps bytes to characters (a space becomes "Ġ"). With
raw spellings that lookup misses and every space is dropped; with byte-level spellings, and no
merge across the pieces our split makes, it gives the ids this tokenizer gives.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rollouts.backends.train.components import model_attr

if TYPE_CHECKING:
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, EOS = "<|pad|>", "<|endoftext|>"  # EOS named as in Qwen2, whose tokenizer class adds it otherwise

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}"
    + EOS
    + "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}"
)
"""A minimal chat template: the user's text is the prompt, the assistant's answer ends with EOS."""


def build_tokenizer(corpus: Iterable[str], *, vocab_size: int = 64) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer: BPE over `corpus` with single-digit tokens and PAD/EOS specials."""

    core = Tokenizer(models.BPE(unk_token=None))
    split = [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Split(Regex(r"[^0-9A-Za-z]"), behavior="isolated"),
    ]
    core.pre_tokenizer = pre_tokenizers.Sequence(split)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS], show_progress=False)
    core.train_from_iterator(corpus, trainer)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    respelled = Tokenizer.from_str(json.dumps(_byte_level_spelling(json.loads(core.to_str()), byte_level)))
    respelled.pre_tokenizer = pre_tokenizers.Sequence([*split, byte_level])
    respelled.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves __init__ unannotated
        tokenizer_object=respelled, pad_token=PAD, eos_token=EOS
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_level_spelling(spec: dict[str, Any], byte_level: ByteLevel) -> dict[str, Any]:
    """A trained BPE's JSON with every token spelled byte-level and each id kept (so a model built
    for the raw spelling reads the same ids). A character of several bytes gets its bytes as new
    tokens after the others and merges that rebuild it, ranked before the trained merges."""
    model = spec["model"]
    special = {t["content"] for t in spec["added_tokens"]}

    def spell(token: str) -> str:
        return token if token in special else "".join(piece for piece, _ in byte_level.pre_tokenize_str(token))

    vocab = {spell(t): i for t, i in model["vocab"].items()}
    merges = [[spell(a), spell(b)] for a, b in model["merges"]]
    rebuilds = []
    for token in list(model["vocab"]):
        spelled = spell(token)
        if len(token) == 1 and len(spelled) > 1:  # a trained character of several bytes
            for end in range(1, len(spelled) + 1):
                vocab.setdefault(spelled[end - 1], len(vocab))
                vocab.setdefault(spelled[:end], len(vocab))
                if end > 1 and [spelled[: end - 1], spelled[end - 1]] not in rebuilds:
                    rebuilds.append([spelled[: end - 1], spelled[end - 1]])
    return {**spec, "model": {**model, "vocab": vocab, "merges": rebuilds + merges}}


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 128,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-init Qwen2ForCausalLM, float32, head_dim = hidden_size / num_heads (must be >= 32)."""

    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(
            f"hidden_size ({hidden_size}) / num_heads ({num_heads}) must be a whole head_dim >= 32 "
            "(vLLM's CPU attention needs it)"
        )
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model: torch.nn.Module = Qwen2ForCausalLM(config)
    return model.float()


def save_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> Path:
    """Write an HF-format model directory (config.json, model.safetensors, tokenizer files)."""
    directory = Path(directory)
    model_attr(model, "save_pretrained")(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return directory
