"""`rollouts demo --quick` completes and writes everything the full demo promises."""

import json

from rollouts.loops.app.cli import main
from rollouts.loops.run.loggers import read_jsonl


def test_quick_demo_writes_summary_plot_metrics_and_a_loadable_model(quick_demo):
    out, printed = quick_demo
    summary = json.loads((out / "summary.json").read_text())
    # --quick learns: SFT takes held-out accuracy from 0 to most of the teacher's (its RL gain varies
    # with the engine's batching, so it is printed, not asserted)
    assert "SFT loss" in printed and "RL reward" in printed and "after RL" in printed
    first, last = summary["sft_loss_first_last"]
    assert not summary["smoke_run"] and last < 0.2 * first, summary["sft_loss_first_last"]
    assert summary["accuracy_before_sft"] == 0.0 and summary["accuracy_after_sft"] >= 0.4, summary
    assert 0.0 <= summary["accuracy_after_rl"] <= 1.0
    assert summary["wall_time_s"] > 0
    assert (out / "metrics.png").stat().st_size > 0
    assert read_jsonl(out / "metrics_sft.jsonl") and read_jsonl(out / "metrics_rl.jsonl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out / "final_model"), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "final_model"), local_files_only=True)
    ids = tokenizer("12+34=", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == len(tokenizer)
    assert (out / "sft_model" / "config.json").is_file() and summary["sft_model"] == str(out / "sft_model")


def test_the_demo_rl_stage_trains_a_lora_adapter_with_set(tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "demo"
    sets = ["--set", "model.lora.rank=8", "--set", "rl_steps=2", "--set", "sft_steps=20", "--set", "smoke=true"]
    assert main(["demo", "--quick", *sets, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["lora"]["rank"] == 8 and summary["config"]["rl_steps"] == 2
    assert len(read_jsonl(out / "metrics_rl.jsonl")) == 2
    with safe_open(str(out / "final_model" / "model.safetensors"), "pt") as f:  # merged: the base names only
        assert not any(".lora_" in k or "base_layer" in k for k in f.keys())
    capsys.readouterr()
    assert main(["demo", "--quick", "--set", "model.lora.rank=-1", "--out", str(tmp_path / "bad")]) == 2
    assert "LoraConfig.rank must be >= 0 (0: no adapter), got -1" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_the_demo_rl_stage_runs_any_preset_and_refuses_an_unknown_one(tmp_path, capsys):
    from rollouts.loops.app.demo import DemoConfig, demo_overrides

    assert demo_overrides(DemoConfig.quick(), ["rl_preset=ppo"]).rl_preset == "ppo"
    assert main(["demo", "--quick", "--set", "rl_preset=nope", "--out", str(tmp_path / "bad")]) == 2
    assert "DemoConfig.rl_preset" in capsys.readouterr().err and not (tmp_path / "bad").exists()
