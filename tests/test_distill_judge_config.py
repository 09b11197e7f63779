"""[distill] and [reward.judge] are checked with the rest of the run file, before any work: a judge
needs a server and a rubric showing the response, a teacher of another vocabulary is refused
naming both sizes."""

import pytest

from rollouts.loops.app.cli import main
from rollouts.loops.app.config import ConfigError, RLRun, build_run


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"reward": {"fn": "judge"}}, "RewardSpec.judge.url must be set"),
        (
            {"reward": {"fn": "judge", "judge": {"url": "http://x:1", "template": "{prompt}"}}},
            r"template must include \{response\}",
        ),
        ({"reward": {"judge": {"url": "ftp://x"}}}, "JudgeSpec.url must start with http"),
        ({"reward": {"judge": {"low": 5.0, "high": 1.0}}}, r"JudgeSpec.high must be > low"),
        ({"reward": {"judge": {"pattern": "no group"}}}, "have a group capturing the score"),
        ({"reward": {"judge": {"labels": [{"label": " ", "score": 1.0}]}}}, "non-empty word"),
        ({"distill": {"path": "t", "coef": 0.0}}, "DistillSpec.coef must be > 0"),
        ({"distill": {"mode": "both"}}, "distill.mode must be one of"),
        ({"distill": {"estimate": "exact"}}, "distill.estimate must be one of"),
        ({"distill": {"estimate": "full", "beta": 1.5}}, r"DistillSpec.beta must be in \[0, 1\]"),
        ({"distill": {"beta": 0.5}}, "DistillSpec.beta must be 1 unless estimate = 'full'"),
        ({"distill": {"url": "http://x:1", "estimate": "full"}}, "must be 'sampled' with a served teacher"),
    ],
)
def test_bad_sections_are_refused_naming_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        build_run(RLRun, data, source="run.toml")


def test_a_teacher_of_another_vocabulary_is_refused_before_the_run_directory_is_written(
    tiny_run_inputs, tmp_path, capsys
):
    from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer, save_model

    tokenizer = build_tokenizer(["1+2=3", "40+2=42"], vocab_size=20)
    other = build_tiny_model(len(tokenizer) + 40, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    save_model(other, tokenizer, tmp_path / "teacher")
    out = tmp_path / "run"
    (tmp_path / "rl.toml").write_text("[rl]\nnum_steps = 1\n")
    args = [
        "rl",
        "--config",
        str(tmp_path / "rl.toml"),
        "--set",
        f"model.path='{tiny_run_inputs / 'model'}'",
        "--set",
        f"run.out_dir='{out}'",
    ]
    args += ["--set", f"data.train_path='{tiny_run_inputs / 'prompts.jsonl'}'"]
    args += ["--set", f"distill.path='{tmp_path / 'teacher'}'"]
    assert main(args) == 2
    vocab = len(build_tokenizer(["1+2=3", "40+2=42"], vocab_size=20)) + 40
    assert f"has vocab_size {vocab}, the student" in capsys.readouterr().err
    assert not out.exists()
