"""Shared fixtures: a tiny byte-level BPE tokenizer with real chat templates (built locally, no hub)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the tests' shared fakes (partial_fakes.py)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2-style ChatML: a default system turn, then <|im_start|>role\\ncontent<|im_end|>\\n per message."""

THINK_STRIPPING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen3-like: earlier assistant turns lose their <think> block, the last one keeps it."""

_CORPUS = [
    "hello world how are you today",
    "the answer is 42 because six times seven",
    "system user assistant tool think reasoning",
    "please add the numbers and explain the result",
] * 30


def _build_tokenizer(template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    return hf


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return _build_tokenizer(CHATML_TEMPLATE)


@pytest.fixture(scope="session")
def think_tokenizer():
    return _build_tokenizer(THINK_STRIPPING_TEMPLATE)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    """Every `@pytest.mark.anyio` test runs under asyncio and under trio (the loops use trio)."""
    return request.param


@pytest.fixture(scope="session")
def build_tokenizer():
    """template -> the tiny BPE tokenizer with that chat template (built once per template)."""
    cache = {}

    def build(template: str):
        if template not in cache:
            cache[template] = _build_tokenizer(template)
        return cache[template]

    return build
