import sys
from pathlib import Path

# Top-level tests import their helpers (layering.py, ...) from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import json

import pytest


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    """A tiny local model directory plus SFT conversations and RL prompts for 2-digit addition."""
    from rollouts.loops.recipes.addition import addition_problems, as_conversation
    from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer, save_model

    root = tmp_path_factory.mktemp("tiny_run")
    records = addition_problems(400, digits=2, seed=0)
    tokenizer = build_tokenizer((r["prompt"] + r["answer"] for r in records), vocab_size=32)
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    save_model(model, tokenizer, root / "model")
    with (root / "sft.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps({"messages": as_conversation(r)}) + "\n")
    with (root / "prompts.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return root
