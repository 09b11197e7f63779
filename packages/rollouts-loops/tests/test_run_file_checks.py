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


def test_a_critic_without_gae_is_a_config_error(tmp_path):
    text = "preset = 'grpo'\n[rl.critic]\nclip_range = 0.5\n"
    with pytest.raises(ConfigError, match=r"RLConfig\.critic must be left unset unless .*'gae'.*'grpo' advantages"):
        load_run(RLRun, _write(tmp_path, text))
    ppo = load_run(RLRun, _write(tmp_path, "preset = 'ppo'\n[rl.critic]\nclip_range = 0.5\n"))
    assert ppo.rl.critic.clip_range == 0.5


def test_an_overlong_buffer_as_long_as_the_budget_is_a_config_error(tmp_path):
    # the dapo preset's 64-token buffer against a 64-token budget penalizes every response
    text = "preset = 'dapo'\n[rl.rollout.sampling]\nmax_new_tokens = 64\n"
    with pytest.raises(ConfigError, match=r"overlong_buffer_length must be < rollout\.sampling\.max_new_tokens \(64\)"):
        load_run(RLRun, _write(tmp_path, text))
    run = load_run(RLRun, _write(tmp_path, "preset = 'dapo'\n[rl.rollout.sampling]\nmax_new_tokens = 65\n"))
    assert run.rl.algorithm.overlong_buffer_length == 64


def test_a_loss_hook_with_the_documented_keyword_only_counts_is_accepted(tmp_path):
    from rollouts.loops.app.rl_hooks import resolve_hooks

    code = tmp_path / "losses.py"
    code.write_text(
        "def documented(logprobs_B_T, batch, *, num_tokens, num_sequences):\n    return logprobs_B_T.sum(), {}\n"
        "def no_counts(logprobs_B_T, batch):\n    return logprobs_B_T.sum(), {}\n"
    )
    run = load_run(RLRun, _write(tmp_path, f"[hooks]\nloss = '{code}:documented'\n"))
    assert resolve_hooks(run, str(tmp_path / "run.toml"))["loss_fn"].__name__ == "documented"
    run = load_run(RLRun, _write(tmp_path, f"[hooks]\nloss = '{code}:no_counts'\n"))
    with pytest.raises(ConfigError, match=r"keyword argument\(s\) num_tokens, num_sequences"):
        resolve_hooks(run, str(tmp_path / "run.toml"))
