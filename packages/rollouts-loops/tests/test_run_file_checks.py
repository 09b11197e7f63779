"""Run files: one key for responses per prompt, peer baselines need peers, and the correctness
threshold reaches the evaluation."""

import json

import pytest

from rollouts.loops.app.commands import _evaluation
from rollouts.loops.app.config import ConfigError, RLRun, load_run


def _write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_sampling_n_that_disagrees_with_samples_per_prompt_is_a_config_error(tmp_path):
    text = "[rl.rollout]\nsamples_per_prompt = 4\n[rl.rollout.sampling]\nn = 8\n"
    with pytest.raises(ConfigError, match=r"run\.toml: .*sampling\.n must be 1 \(unset\) or equal samples_per_prompt"):
        load_run(RLRun, _write(tmp_path, text))
    assert load_run(RLRun, _write(tmp_path, "[rl.rollout]\nsamples_per_prompt = 4\n")).rl.rollout.sampling.n == 1


@pytest.mark.parametrize("preset", ["grpo", "drgrpo", "dapo", "rloo"])
def test_a_group_preset_with_one_response_per_prompt_is_a_config_error(tmp_path, preset):
    text = f"preset = '{preset}'\n[rl.rollout]\nsamples_per_prompt = 1\n"
    with pytest.raises(ConfigError, match=r"samples_per_prompt must be >= 2 with '(grpo|rloo)' advantages.*got 1"):
        load_run(RLRun, _write(tmp_path, text))


def test_one_response_per_prompt_is_fine_with_reinforce_pp(tmp_path):
    run = load_run(RLRun, _write(tmp_path, "preset = 'reinforce_pp'\n[rl.rollout]\nsamples_per_prompt = 1\n"))
    assert run.rl.rollout.samples_per_prompt == 1


def test_the_run_files_threshold_reaches_the_evaluation(tmp_path):
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    text = f"[data]\neval_path = '{eval_path}'\n[eval]\nevery_steps = 1\n[rl]\ncorrect_min_reward = 0.5\n"
    run = load_run(RLRun, _write(tmp_path, text))
    assert run.rl.correct_min_reward == 0.5
    assert _evaluation(run).correct_min_reward == 0.5
    assert load_run(RLRun, _write(tmp_path, "")).rl.correct_min_reward == 1.0
