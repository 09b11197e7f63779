"""User functions named in the run config drive `rollouts rl`: rewards (async, batched, failing),
a rollout function, and the errors a bad name gets before any work."""

import json

import pytest
from run_configs import rl_toml

from rollouts.loops.app.cli import main
from rollouts.loops.run.loggers import read_jsonl

_USER_CODE = '''
import trio

CALLS = []


async def async_reward(sample, record):
    await trio.sleep(0)
    return 1.0 if sample.response.strip() == record["answer"] else 0.0


def batched_reward(samples, records):
    """Scores each sample with the size of the batch it was given: one whole group."""
    assert len(records) == len(samples)
    return [float(len(samples))] * len(samples)


def failing_reward(sample, record):
    raise KeyError("solution")


async def rollout(record, ctx):
    """The default rollout plus a marker: proves the loop called this function."""
    samples = await ctx.engine.generate([list(ctx.encode_prompt(record))], ctx.sampling)
    return [s.with_metadata(custom_rollout=True) for s in samples]


def trl_style_reward(prompts, completions, **kwargs):
    return [1.0 for _ in completions]


def reward_of_custom_rollouts(sample, record):
    return 1.0 if sample.metadata.get("custom_rollout") else 0.0
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_code.py"
    path.write_text(_USER_CODE)
    return path


def _rl(tiny_run_inputs, tmp_path, name, *sets):
    config = rl_toml(tiny_run_inputs, tmp_path / name, tiny_run_inputs / "model")
    return main(["rl", "--config", str(config), "--set", "rl.num_steps=2", *(x for s in sets for x in ("--set", s))])


def test_an_async_reward_and_a_rollout_function_from_a_user_file_drive_the_run(tiny_run_inputs, tmp_path, user_file):
    sets = [f"reward.fn='{user_file}:reward_of_custom_rollouts'", f"hooks.rollout='{user_file}:rollout'"]
    assert _rl(tiny_run_inputs, tmp_path, "custom", *sets) == 0
    records = read_jsonl(tmp_path / "custom" / "metrics_rl.jsonl")
    assert [r["reward_mean"] for r in records] == [1.0, 1.0]  # every sample came from the user's rollout
    assert _rl(tiny_run_inputs, tmp_path, "async", f"reward.fn='{user_file}:async_reward'") == 0


def test_a_batched_reward_scores_whole_groups(tiny_run_inputs, tmp_path, user_file):
    assert (
        _rl(tiny_run_inputs, tmp_path, "batched", f"reward.fn='{user_file}:batched_reward'", "reward.batched=true") == 0
    )
    records = read_jsonl(tmp_path / "batched" / "metrics_rl.jsonl")
    assert [r["reward_mean"] for r in records] == [4.0, 4.0]  # called with whole groups of samples_per_prompt=4


def test_a_reward_failing_for_a_whole_step_names_its_error_in_the_run_error(
    tiny_run_inputs, tmp_path, user_file, capsys
):
    # on_error = "zero" scores some failures 0 (tests/test_faults.py), but a step with no reward left stops
    for name, policy in (("raise", ()), ("zero", ("reward.on_error='zero'",))):
        assert _rl(tiny_run_inputs, tmp_path, name, f"reward.fn='{user_file}:failing_reward'", *policy) == 1
        err = capsys.readouterr().err
        assert "RewardError: 16 of 16 rewards failed; first: \"KeyError: 'solution'\" x16" in err
        assert not (tmp_path / name / "metrics_rl.jsonl").exists() or not read_jsonl(
            tmp_path / name / "metrics_rl.jsonl"
        )


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "reward.fn='no_such_module_xyz:f'",
            "reward.fn 'no_such_module_xyz:f': module 'no_such_module_xyz' does not import",
        ),
        ("hooks.rollout='FILE:CALLS'", "hooks.rollout: [] is a list, not a function"),
        ("hooks.filter='FILE:async_reward'", "cannot be called with 1 positional argument(s)"),
    ],
)
def test_a_bad_plugin_is_a_config_error_before_any_work(tiny_run_inputs, tmp_path, user_file, capsys, setting, message):
    assert _rl(tiny_run_inputs, tmp_path, "bad", setting.replace("FILE", str(user_file))) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_evaluation_during_training_and_of_a_saved_checkpoint(tiny_run_inputs, tmp_path, capsys):
    prompts = tiny_run_inputs / "prompts.jsonl"
    evaluation = [
        f"data.eval_path='{prompts}'",
        "data.num_eval=8",
        "eval.every_steps=2",
        "eval.samples_per_prompt=4",
        "eval.temperature=1.0",
    ]
    config = rl_toml(tiny_run_inputs, tmp_path / "eval", tiny_run_inputs / "model")
    assert main(["rl", "--config", str(config), *(x for s in evaluation for x in ("--set", s))]) == 0
    records = read_jsonl(tmp_path / "eval" / "metrics_rl.jsonl")
    assert [r["step"] for r in records if "eval_pass@1" in r] == [2, 3]  # every 2 steps and after the last
    for r in records[1:]:
        assert 0.0 <= r["eval_pass@1"] <= r["eval_pass@4"] <= 1.0 and 0.0 <= r["eval_maj@4"] <= 1.0
    capsys.readouterr()
    checkpoint = tmp_path / "eval" / "checkpoints" / "step_3"
    assert (
        main(
            [
                "eval",
                "--config",
                str(config),
                "--checkpoint",
                str(checkpoint),
                *(x for s in evaluation for x in ("--set", s)),
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["num_eval"] == 8.0 and set(printed) >= {
        "eval_reward_mean",
        "eval_pass@1",
        "eval_pass@4",
        "eval_maj@4",
    }


def test_evaluation_without_an_eval_file_is_a_config_error(tiny_run_inputs, tmp_path, capsys):
    assert _rl(tiny_run_inputs, tmp_path, "noeval", "eval.every_steps=1") == 2
    assert "eval.every_steps > 0 needs data.eval_path" in capsys.readouterr().err


def test_a_relative_plugin_path_is_read_from_the_run_files_directory(tiny_run_inputs, tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "my_reward.py").write_text("def reward(sample, record):\n    return 1.0\n")
    config = rl_toml(tiny_run_inputs, configs / "run", tiny_run_inputs / "model")
    config.write_text(config.read_text().replace('fn = "exact_match"', 'fn = "my_reward.py:reward"'))
    monkeypatch.chdir(tmp_path)  # the run file's directory is not the current one
    assert main(["rl", "--config", str(config), "--set", "rl.num_steps=1"]) == 0
    assert [r["reward_mean"] for r in read_jsonl(configs / "run" / "metrics_rl.jsonl")] == [1.0]


def test_a_reward_written_for_strings_is_refused_before_any_work(tiny_run_inputs, tmp_path, user_file, capsys):
    assert _rl(tiny_run_inputs, tmp_path, "trl", f"reward.fn='{user_file}:trl_style_reward'") == 2
    err = capsys.readouterr().err
    assert "'trl_style_reward'(prompts, completions, ...) reads like a reward over strings" in err
    assert not (tmp_path / "trl").exists()  # refused before the run directory was made
