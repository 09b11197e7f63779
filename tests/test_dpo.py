"""`rollouts dpo` end to end on a tiny local model: held-out preference accuracy from 50% to over 90%
on a synthetic preference set, resume equal to an uninterrupted run, every loss, config errors."""

import json
import random
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from rollouts.backends import build_components
from rollouts.data import load_preference_pairs
from rollouts.loops.app.cli import main
from rollouts.loops.app.dpo_cmd import tokenize_pairs
from rollouts.loops.dpo.batches import sequence_logps_of
from rollouts.loops.dpo.loop import REFERENCE_FILE, evaluate_pairs
from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer, save_model
from rollouts.loops.run.loggers import read_jsonl
from rollouts.types import DPOConfig, OptimizerConfig
from rollouts.types.preference import PREFERENCE_LOSSES


def _record(rng):
    """A cue word after some noise digits: "up" prefers the completion "high", "down" prefers "low"."""
    cue = rng.choice(["up", "down"])
    chosen, rejected = ("high", "low") if cue == "up" else ("low", "high")
    prompt = " ".join(str(rng.randrange(10)) for _ in range(4)) + f" {cue} "
    if rng.random() < 0.5:  # both accepted shapes: strings and chat messages
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": {"role": "assistant", "content": rejected},
    }


@pytest.fixture(scope="module")
def preference_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    rng = random.Random(0)
    train, held_out = [_record(rng) for _ in range(128)], [_record(rng) for _ in range(64)]
    texts = [f"{r['prompt'] if isinstance(r['prompt'], str) else r['prompt'][0]['content']} high low" for r in train]
    tokenizer = build_tokenizer(texts, vocab_size=40)
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
    for name, records in (("train", train), ("eval", held_out)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def _config(inputs: Path, out: Path, *, steps: int, every: int = 0, eval_every: int = 0, loss: str = "sigmoid") -> Path:
    path = out.parent / f"{out.name}.toml"
    path.write_text(
        f"""
[model]
path = "{inputs / "model"}"
[data]
train_path = "{inputs / "train.jsonl"}"
eval_path = "{inputs / "eval.jsonl"}"
[run]
out_dir = "{out}"
[dpo]
num_steps = {steps}
batch_size = 16
max_length = 32
max_tokens_per_micro_batch = 256
eval_every_steps = {eval_every}
loss = "{loss}"
beta = 0.1
[dpo.optimizer]
lr = 3e-3
schedule = "constant"
[dpo.checkpoint]
every_steps = {every}
"""
    )
    return path


def test_held_out_preference_accuracy_rises_from_half_to_over_ninety_percent(preference_inputs, tmp_path):
    inputs = preference_inputs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(inputs / "model"))
    held_out = tokenize_pairs(load_preference_pairs(inputs / "eval.jsonl"), tokenizer, max_length=32, what="held-out")
    components = build_components(str(inputs / "model"), OptimizerConfig(), num_training_steps=1)
    config = DPOConfig(max_length=32, max_tokens_per_micro_batch=256)
    ref_N, _ = sequence_logps_of(components, held_out, max_tokens=256)
    start = evaluate_pairs(components, held_out, ref_N, config)
    assert start["eval_preference_accuracy"] == 0.5  # policy = reference: every margin is a tie
    simpo = evaluate_pairs(components, held_out, None, DPOConfig(loss="simpo", max_length=32))
    assert 0.2 <= simpo["eval_preference_accuracy"] <= 0.8  # the untrained model's own preferences: chance

    out = tmp_path / "run"
    assert main(["dpo", "--config", str(_config(inputs, out, steps=8, eval_every=4))]) == 0
    records = read_jsonl(out / "metrics_dpo.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["eval_preference_accuracy"] > 0.9
    assert records[-1]["eval_rewards/margins"] > 0 and records[-1]["loss"] < records[0]["loss"]
    assert (out / REFERENCE_FILE).is_file() and (out / "checkpoints" / "step_8" / "model.safetensors").is_file()


def test_resume_equals_an_uninterrupted_run(preference_inputs, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["dpo", "--config", str(_config(preference_inputs, straight, steps=4, every=2))]) == 0
    config = _config(preference_inputs, resumed, steps=4, every=2)
    assert main(["dpo", "--config", str(config), "--set", "dpo.num_steps=2"]) == 0  # stops after step 2
    assert main(["dpo", "--config", str(config)]) == 0  # resumes at step 3, reference log-probs from the cache
    a = load_file(straight / "checkpoints" / "step_4" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_4" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), f"{name} differs after resume"
    losses = [[r["loss"] for r in read_jsonl(d / "metrics_dpo.jsonl")] for d in (straight, resumed)]
    assert losses[0] == losses[1]


@pytest.mark.parametrize("loss", PREFERENCE_LOSSES)
def test_every_loss_trains(preference_inputs, tmp_path, loss):
    out = tmp_path / loss
    assert main(["dpo", "--config", str(_config(preference_inputs, out, steps=2, loss=loss))]) == 0
    (first, second) = read_jsonl(out / "metrics_dpo.jsonl")
    assert {"rewards/accuracies", "rewards/margins", "logps/chosen", "grad_norm"} <= set(first)
    assert second["loss"] == second["loss"]  # finite, not NaN
    assert (out / REFERENCE_FILE).is_file() == (loss not in ("simpo", "orpo"))  # none for reference-free losses


def test_config_errors_name_the_key_before_work(preference_inputs, tmp_path, capsys):
    config = _config(preference_inputs, tmp_path / "bad", steps=2)
    assert main(["dpo", "--config", str(config), "--set", "dpo.beta=0"]) == 2
    assert "DPOConfig.beta must be a finite number > 0" in capsys.readouterr().err
    assert main(["dpo", "--config", str(config), "--set", "dpo.loss='ipo'", "--set", "dpo.label_smoothing=0.1"]) == 2
    assert "label_smoothing must be 0 with loss 'ipo'" in capsys.readouterr().err
    assert main(["dpo", "--config", str(config), "--set", "dpo.max_tokens_per_micro_batch=40"]) == 2
    assert "so a pair's two sequences fit one micro-batch" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # nothing ran
