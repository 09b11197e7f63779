"""AlgorithmConfig's loss-variant, correction and adaptive-KL fields: ranges refused by name, round trips."""

import dataclasses

import pytest

from rollouts.types import AlgorithmConfig, from_dict


@pytest.mark.parametrize(
    ("fields", "name", "rule"),
    [
        ({"sapo_tau_pos": 0.0}, "sapo_tau_pos", "be > 0"),
        ({"sapo_tau_neg": -1.0}, "sapo_tau_neg", "be > 0"),
        ({"cov_fraction": 0.0}, "cov_fraction", r"be in \(0, 1\]"),
        ({"cov_fraction": 1.5}, "cov_fraction", r"be in \(0, 1\]"),
        ({"clip_cov_bounds": (5.0, 1.0)}, "clip_cov_bounds", "low < high"),
        ({"kl_cov_coef": -0.1}, "kl_cov_coef", "be >= 0"),
        ({"log_ratio_sq_coef": -1e-3}, "log_ratio_sq_coef", "be >= 0"),
        ({"off_policy_mask_threshold": -0.5}, "off_policy_mask_threshold", "be >= 0"),
        ({"top_entropy_quantile": 0.0}, "top_entropy_quantile", r"be in \(0, 1\]"),
        ({"top_entropy_quantile": 1.2}, "top_entropy_quantile", r"be in \(0, 1\]"),
        ({"kl_target": 0.0, "kl_coef": 0.1, "kl_placement": "loss"}, "kl_target", "be > 0"),
        ({"kl_target": 0.1}, "kl_target", r"kl_coef > 0 \(got 0.0\)"),
        ({"kl_horizon": 0}, "kl_horizon", "be >= 1"),
        ({"rs_level": "token"}, "rs_level", "rs_low or rs_high"),
        ({"rs_level": "seq_sum", "rs_low": 1.0, "rs_high": 0.5}, "rs_low", r"be < rs_high \(0.5\)"),
        ({"policy_loss": "dppo"}, "policy_loss", "one of"),
        ({"kl_kind": "k2+"}, "kl_kind", "one of"),
        ({"advantage_estimator": "remax2"}, "advantage_estimator", "one of"),
    ],
)
def test_bad_values_are_refused_naming_field_value_and_rule(fields, name, rule):
    with pytest.raises(
        ValueError, match=rf"AlgorithmConfig\.{name} must {rule}|AlgorithmConfig\.{name} .*{rule}"
    ) as info:
        AlgorithmConfig(**fields)
    assert repr(fields[name]) in str(info.value)


def test_new_fields_round_trip_and_flag_rollout_logprobs():
    config = AlgorithmConfig(
        policy_loss="dppo_kl",
        advantage_estimator="grpo_passk",
        kl_kind="k3+",
        kl_coef=0.01,
        kl_placement="loss",
        kl_target=0.05,
        kl_horizon=100,
        clip_cov_bounds=(0.5, 2.0),
        rs_level="seq_max",
        rs_estimator="k2",
        rs_high=0.1,
        off_policy_mask_threshold=0.2,
        top_entropy_quantile=0.2,
        log_ratio_sq_coef=1e-3,
    )
    assert from_dict(AlgorithmConfig, dataclasses.asdict(config)) == config
    assert from_dict(AlgorithmConfig, {"clip_cov_bounds": [0.5, 2.0]}).clip_cov_bounds == (0.5, 2.0)
    assert config.needs_rollout_logprobs and not AlgorithmConfig().needs_rollout_logprobs
    assert AlgorithmConfig(is_cap=2.0).needs_rollout_logprobs
