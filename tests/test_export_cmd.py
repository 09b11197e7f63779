"""`rollouts export`: what a served model needs comes along, and a target holding anything but an
earlier export is never deleted."""

import pytest

from rollouts.backends import build_components, save_checkpoint
from rollouts.loops.app.cli import main
from rollouts.types import OptimizerConfig, TrainingState

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def checkpoint(tiny_run_inputs, tmp_path_factory):
    """A full-weights checkpoint whose tokenizer has a chat template and whose model has generation defaults."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    components = build_components(tiny_run_inputs / "model", OptimizerConfig(), num_training_steps=1)
    components.model.generation_config = GenerationConfig(max_new_tokens=7, eos_token_id=tokenizer.eos_token_id)
    root = tmp_path_factory.mktemp("export")
    return save_checkpoint(components, TrainingState(step=1), root / "checkpoints", tokenizer=tokenizer)


def test_export_keeps_the_chat_template_and_generation_config(checkpoint, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert AutoTokenizer.from_pretrained(str(out), local_files_only=True).chat_template == CHAT_TEMPLATE
    assert GenerationConfig.from_pretrained(str(out)).max_new_tokens == 7


def test_export_into_a_run_directory_is_refused_and_deletes_nothing(checkpoint, capsys):
    run_dir = checkpoint.parents[1]  # <run>/checkpoints/step_1
    (run_dir / "metrics_rl.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    assert main(["export", str(checkpoint), str(run_dir), "--force"]) == 2
    assert "is a run directory" in capsys.readouterr().err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_export_over_other_files_needs_force_and_over_an_export_does_not(checkpoint, tmp_path, capsys):
    target = tmp_path / "models"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert main(["export", str(checkpoint), str(target)]) == 2
    assert "notes.txt" in capsys.readouterr().err and (target / "notes.txt").read_text() == "mine"
    assert main(["export", str(checkpoint), str(target), "--force"]) == 0
    assert main(["export", str(checkpoint), str(target)]) == 0  # an earlier export is replaced without asking
    assert (target / "config.json").is_file() and not (target / "notes.txt").exists()
