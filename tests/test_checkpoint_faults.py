"""Checkpoints a run cannot trust are never skipped silently or deleted by retention; --resume-from
is the user's explicit fallback; leftovers of killed runs are swept by the next run."""

import shutil

import pytest
from run_configs import sft_toml

from rollouts.loops import read_jsonl
from rollouts.loops.app.cli import main


def _sft(inputs, tmp_path, out, *, steps, keep_last, every=4):
    path = tmp_path / f"sft-{steps}-{keep_last}.toml"
    return sft_toml(inputs, path, out_dir=out, steps=steps, batch_size=4, every=every, keep_last=keep_last)


def _flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_damaged_newest_checkpoint_stops_the_run_naming_the_file_and_is_kept(
    tiny_run_inputs, tmp_path, capsys, keep_last
):
    """The field case: keep_last = 1 and one flipped bit in the only checkpoint's tokenizer_config.json
    (weights and optimizer intact): continuing exited 0, started again from step 0 and retention
    deleted step_8; with keep_last = 2 it silently dropped back one checkpoint."""
    out = tmp_path / "run"
    assert main(["sft", "--config", str(_sft(tiny_run_inputs, tmp_path, out, steps=8, keep_last=keep_last))]) == 0
    step_8 = out / "checkpoints" / "step_8"
    _flip_a_bit(step_8 / "tokenizer_config.json")
    damaged = (step_8 / "tokenizer_config.json").read_bytes()
    capsys.readouterr()
    longer = _sft(tiny_run_inputs, tmp_path, out, steps=12, keep_last=keep_last)
    assert main(["sft", "--config", str(longer)]) == 2
    err = capsys.readouterr().err
    assert f"the newest checkpoint '{step_8}' failed its check" in err and "tokenizer_config.json" in err, err
    if keep_last == 2:
        assert f"--resume-from {out / 'checkpoints' / 'step_4'}" in err
    assert (step_8 / "tokenizer_config.json").read_bytes() == damaged  # nothing deleted or rewritten
    assert [r["step"] for r in read_jsonl(out / "metrics_sft.jsonl")] == list(range(1, 9))  # nothing trained


def test_resume_from_an_earlier_checkpoint_is_the_users_choice_and_keeps_the_newer_one(
    tiny_run_inputs, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(["sft", "--config", str(_sft(tiny_run_inputs, tmp_path, out, steps=8, keep_last=2))]) == 0
    _flip_a_bit(out / "checkpoints" / "step_8" / "model.safetensors")
    longer = _sft(tiny_run_inputs, tmp_path, out, steps=10, keep_last=2)
    step_4 = out / "checkpoints" / "step_4"
    assert main(["sft", "--config", str(longer), "--resume-from", str(step_4)]) == 0
    assert "resuming the run in" in capsys.readouterr().err
    (abandoned,) = (out / "checkpoints" / "abandoned").iterdir()
    assert abandoned.name.startswith("step_8-")  # moved aside, not deleted, not resumed from again
    steps = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_10", "step_8"]  # the new timeline's step_8 and step_10 (keep_last = 2)
    records = read_jsonl(out / "metrics_sft.jsonl")
    assert [r["step"] for r in records] == list(range(1, 11))  # steps 5..8 logged once, by the resumed run


def test_retention_keeps_a_checkpoint_that_fails_its_check(tiny_run_inputs, tmp_path, caplog):
    from rollouts.backends import build_components, load_hf_model, save_checkpoint
    from rollouts.types import OptimizerConfig, TrainingState

    components = build_components(load_hf_model(tiny_run_inputs / "model"), OptimizerConfig(), num_training_steps=9)
    root = tmp_path / "checkpoints"
    save_checkpoint(components, TrainingState(step=1), root, keep_last=1)
    weights = root / "step_1" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # cut short: fails even the quick check
    save_checkpoint(components, TrainingState(step=2), root, keep_last=1)
    save_checkpoint(components, TrainingState(step=3), root, keep_last=1)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_1", "step_3"]
    assert "retention keeps" in caplog.text and "step_1" in caplog.text


def test_the_leftovers_of_a_killed_run_are_swept_by_the_next_run(tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    config = _sft(tiny_run_inputs, tmp_path, out, steps=4, keep_last=1)
    assert main(["sft", "--config", str(config)]) == 0
    # What a run killed mid-save and mid-export leaves: half-written directories under temporary names.
    leftovers = [out / ".tmp-weights-4242", out / "checkpoints" / ".tmp-step_6-4242", out / ".trash-weights-1-x"]
    for path in leftovers:
        shutil.copytree(out / "checkpoints" / "step_4", path)
    longer = _sft(tiny_run_inputs, tmp_path, out, steps=6, keep_last=1)
    assert main(["sft", "--config", str(longer)]) == 0
    assert not any(p.exists() for p in leftovers)
