"""`rollouts demo --quick` completes and writes everything the full demo promises."""

import json

from rollouts.loops.app.cli import main
from rollouts.loops.loggers import read_jsonl


def test_quick_demo_writes_summary_plot_metrics_and_a_loadable_model(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before_sft", "accuracy_after_sft", "accuracy_after_rl"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["wall_time_s"] > 0
    assert (out / "metrics.png").stat().st_size > 0
    assert read_jsonl(out / "metrics_sft.jsonl") and read_jsonl(out / "metrics_rl.jsonl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out / "final_model"), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "final_model"), local_files_only=True)
    ids = tokenizer("12+34=", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == len(tokenizer)
