"""Run configs: TOML in, validated frozen configs out; errors name the file and the key."""

import dataclasses
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.loops.algorithms import ALGORITHMS, algorithm_preset
from rollouts.loops.app.config import ConfigError, RLRun, SFTRun, apply_overrides, build_run, load_run
from rollouts.loops.app.toml_out import to_toml


def _write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_rl_file_with_preset_and_overrides(tmp_path):
    path = _write(
        tmp_path,
        """
preset = "dapo"
[model]
path = "/models/tiny"
[engine]
kind = "vllm"
urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
[rl]
num_steps = 7
[rl.algorithm]
eps_high = 0.3
""",
    )
    run = load_run(RLRun, path, ["rl.rollout.batch_size=16", "run.out_dir=runs/x"])
    assert run.rl.num_steps == 7 and run.rl.rollout.batch_size == 16 and run.run.out_dir == "runs/x"
    assert run.rl.algorithm.eps_high == 0.3  # the user's setting wins over the preset
    assert run.rl.algorithm.loss_aggregation == "token-mean"  # from the preset
    assert run.rl.rollout.dynamic_sampling  # DAPO implies dynamic sampling
    assert run.engine.urls == ("http://127.0.0.1:8000", "http://127.0.0.1:8001")


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        (
            "[rl]\nnum_step = 3\n",
            [],
            r"run\.toml: RLRun\.rl: unknown key\(s\) \['num_step'\]; allowed keys: .*num_steps",
        ),
        (
            "[rl.rollout]\nbatch_size = 'big'\n",
            [],
            r"run\.toml: RLRun\.rl\.rollout\.batch_size must be int, got str 'big'",
        ),
        (
            "[rl.algorithm]\npolicy_loss = 'sgd'\n",
            [],
            r"policy_loss must be one of 'ppo_clip', 'gspo', 'cispo', 'pg', .*got 'sgd'",
        ),
        ("[rl.optimizer]\nlr = -1.0\n", [], r"run\.toml: .*OptimizerConfig\.lr must be > 0, got -1\.0"),
        ("preset = 'ppo2'\n", [], r"RLRun\.preset must be one of \[.*'grpo'"),
        ("[engine]\nkind = 'vllm'\n", [], r"EngineSpec\.urls must name at least one server"),
        (
            "",
            ["rl.rollout.max_concurrency=0"],
            r"with --set rl\.rollout\.max_concurrency=0: .*max_concurrency must be >= 1",
        ),
        ("[rl\n", [], r"run\.toml: not valid TOML"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path, text, overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_run(RLRun, _write(tmp_path, text), overrides)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_run(SFTRun, tmp_path / "absent.toml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_overrides({}, ["rl.num_steps"])
    with pytest.raises(ConfigError, match="is a value, not a table"):
        apply_overrides({"rl": 3}, ["rl.num_steps=2"])


@settings(max_examples=30, deadline=None)
@given(
    steps=st.integers(1, 10**6),
    lr=st.floats(1e-8, 1.0),
    preset=st.sampled_from(sorted(ALGORITHMS)),
    clip=st.none() | st.floats(0.01, 10.0),
    is_cap=st.none() | st.floats(1.0, 10.0),
)
def test_resolved_toml_round_trips(steps, lr, preset, clip, is_cap):
    """None (no clipping, no IS cap) is written as "none" and read back as None, not as the default."""
    run = load_run(
        RLRun,
        None,
        [
            f"rl.num_steps={steps}",
            f"rl.optimizer.lr={lr!r}",
            f"preset={preset!r}",
            f"rl.optimizer.max_grad_norm={'none' if clip is None else repr(clip)}",
            f"rl.algorithm.is_cap={'none' if is_cap is None else repr(is_cap)}",
        ],
    )
    assert run.rl.optimizer.max_grad_norm == clip and run.rl.algorithm.is_cap == is_cap
    assert build_run(RLRun, tomllib.loads(to_toml(run))) == run


def test_none_is_refused_where_a_setting_cannot_be_off(tmp_path):
    with pytest.raises(ConfigError, match=r"RLRun\.rl\.optimizer\.lr must be float, got str 'none'"):
        load_run(RLRun, None, ["rl.optimizer.lr=none"])
    with pytest.raises(
        ConfigError, match=r"run\.toml: RLRun\.rl\.algorithm must be a table of AlgorithmConfig fields, got str 'grpo'"
    ):
        load_run(RLRun, _write(tmp_path, "preset = 'grpo'\n[rl]\nalgorithm = 'grpo'\n"))


def test_presets_are_distinct_and_valid():
    assert len({dataclasses.astuple(c) for c in ALGORITHMS.values()}) == len(ALGORITHMS)
    assert algorithm_preset("drgrpo").advantage_scale == "none"
    assert algorithm_preset("dapo").eps_high == 0.28
    assert algorithm_preset("gpg").advantage_estimator == "gpg" and algorithm_preset("gpg").policy_loss == "pg"
    assert algorithm_preset("grpo_passk").advantage_estimator == "grpo_passk"
    with pytest.raises(ValueError, match="unknown algorithm preset 'x'; allowed"):
        algorithm_preset("x")


def test_partial_rollouts_load_round_trip_and_are_refused_by_name_when_invalid(tmp_path):
    path = _write(tmp_path, "[rl]\noverlap = true\n[rl.rollout]\npartial = true\n")
    run = load_run(RLRun, path)
    assert run.rl.rollout.partial and run.rl.overlap
    assert build_run(RLRun, tomllib.loads(to_toml(run))) == run  # the resolved config keeps it
    assert not load_run(RLRun, None).rl.rollout.partial  # off by default
    with pytest.raises(ConfigError, match=r"rl\.rollout\.partial must be bool, got str 'yes'"):
        load_run(RLRun, _write(tmp_path, "[rl.rollout]\npartial = 'yes'\n"))
    with pytest.raises(ConfigError, match=r"RLConfig\.rollout\.partial must be false without overlap"):
        load_run(RLRun, None, ["rl.rollout.partial=true"])


def test_a_set_value_toml_reads_as_a_date_asks_for_quotes():
    from rollouts.loops.app.config import ConfigError, apply_overrides

    with pytest.raises(
        ConfigError,
        match=r"2026-01-02 reads as a TOML date or time; quote it for a string: log.wandb_name='2026-01-02'",
    ):
        apply_overrides({}, ["log.wandb_name=2026-01-02"])
    assert apply_overrides({}, ["log.wandb_name='2026-01-02'"]) == {"log": {"wandb_name": "2026-01-02"}}
