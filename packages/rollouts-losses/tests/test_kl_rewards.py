"""KL estimators, importance weights and reward functions."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.losses import (
    clip_rewards,
    combine_rewards,
    format_reward,
    importance_weights,
    kl_penalty,
    math_answer_reward,
    normalize_rewards,
    overlong_penalty,
    overlong_reward,
    score_math_answer,
)
from rollouts.types import Sample

_logp = st.floats(-60.0, 0.0, allow_nan=False, width=32)


def test_kl_kinds_match_formulas():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    d = logp - ref
    torch.testing.assert_close(kl_penalty(logp, ref, kind="k1"), d)
    torch.testing.assert_close(kl_penalty(logp, ref, kind="abs"), d.abs())
    torch.testing.assert_close(kl_penalty(logp, ref, kind="k2"), 0.5 * d**2)
    k3 = torch.exp(-d) + d - 1
    torch.testing.assert_close(kl_penalty(logp, ref, kind="k3"), k3)
    torch.testing.assert_close(kl_penalty(logp, ref, kind="low_var_kl"), k3)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, kind="k4")


@settings(max_examples=50, deadline=None)
@given(logp=_logp, ref=_logp)
def test_k3_is_non_negative_and_bounded(logp, ref):
    value = kl_penalty(torch.tensor([[logp]]), torch.tensor([[ref]]), kind="k3").item()
    assert 0.0 <= value <= 10.0


def test_importance_weights_token_and_sequence():
    old = torch.tensor([[0.0, -1.0, -1.0, -2.0]], dtype=torch.float64)
    rollout = torch.tensor([[0.0, -2.0, -1.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    w, metrics = importance_weights(old, rollout, mask, cap=2.0)
    raw = torch.exp(old - rollout)
    torch.testing.assert_close(w, torch.where(mask > 0, raw.clamp(max=2.0), 0.0))
    assert float(metrics["is_capped_frac"]) == pytest.approx(1 / 3)
    w, _ = importance_weights(old, rollout, mask, cap=2.0, mode="mask")
    torch.testing.assert_close(w, torch.where((mask > 0) & (raw <= 2.0), raw, 0.0))
    # sequence level on a packed row of two sequences: product of token ratios per sequence
    seg = torch.tensor([[0, 0, 1, 1]])
    w, _ = importance_weights(old, rollout, mask, cap=10.0, level="sequence", segment_ids_B_T=seg)
    s0, s1 = raw[0, 1].item(), (raw[0, 2] * raw[0, 3]).item()
    torch.testing.assert_close(w, torch.tensor([[0.0, s0, s1, s1]], dtype=torch.float64))
    with pytest.raises(ValueError, match="cap"):
        importance_weights(old, rollout, mask, cap=0.5)


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        # the answer forms a hand-written grader misses and math-verify accepts
        ("-\\frac{3}{4}", "-0.75", 1.0),
        ("\\dfrac12", "0.5", 1.0),
        ("x=2", "2", 1.0),
        ("$50\\%$", "50\\%", 1.0),
        ("\\pi/2", "\\frac{\\pi}{2}", 1.0),
        ("The final answer is 7.", "7", 1.0),
        ("The final answer is 8.", "7", 0.0),
        ("so the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("The answer is: $-3/4$", "-0.75", 1.0),
        ("we get 3 apples and then 7", "7", 1.0),
        ("we get 3 apples and then 7", "3", 0.0),
        ("no numbers here", "1", 0.0),
        ("\\boxed{50\\%}", "0.5", 1.0),
        ("So we get 12, which is the final result", "12", 1.0),
        ("There are 1,000, apples", "1000", 1.0),
        ("in all 1,234,567.5; done", "1234567.5", 1.0),
    ],
)
def test_score_math_answer(response, answer, score):
    assert score_math_answer(response, answer) == score


@settings(max_examples=60, deadline=None)
@given(
    value=st.integers(-(10**9), 10**9),
    grouped=st.booleans(),
    after=st.sampled_from(["", ".", ",", ";", "!", ", so", " apples"]),
)
def test_the_last_number_is_read_whole_whatever_punctuation_follows(value, grouped, after):
    written = f"{value:,}" if grouped else str(value)
    assert score_math_answer(f"first 7, then {written}{after}", str(value)) == 1.0
    assert score_math_answer(f"first 7, then {written}{after}", str(value + 1)) == 0.0


def test_an_unparseable_reference_answer_is_an_error_naming_it():
    with pytest.raises(ValueError, match="reference answer '' cannot be parsed"):
        score_math_answer("7", "")


def test_reward_fns_on_samples():
    sample = Sample(
        prompt="q",
        response="<think>hm</think> \\boxed{7}",
        tokens=(1, 2, 3, 4, 5),
        num_prompt_tokens=1,
        loss_mask=(0, 1, 1, 1, 1),
        metadata={"answer": "7"},
    )
    assert math_answer_reward(sample) == 1.0
    with pytest.raises(ValueError, match="solution"):
        math_answer_reward(sample, answer_key="solution")
    fmt = format_reward(r"<think>.*</think>.*")
    assert fmt(sample) == 1.0
    assert format_reward(r"^\\boxed", full_match=True)(sample) == 0.0
    with pytest.raises(ValueError, match="regular expression"):
        format_reward("(")
    combined = combine_rewards(
        [math_answer_reward, fmt, overlong_reward(max_length=4, buffer_length=2)], [1.0, 0.5, 1.0]
    )
    assert combined(sample) == pytest.approx(1.0 + 0.5 + overlong_penalty(4, max_length=4, buffer_length=2))
    with pytest.raises(ValueError):
        combine_rewards([fmt], [1.0, 2.0])


def test_overlong_penalty_is_dapos_ramp():
    kw = {"max_length": 100, "buffer_length": 20, "factor": 1.0}
    assert overlong_penalty(80, **kw) == 0.0
    assert overlong_penalty(90, **kw) == pytest.approx(-0.5)
    assert overlong_penalty(100, **kw) == pytest.approx(-1.0)
    assert overlong_penalty(101, **kw) == -1.0
    with pytest.raises(ValueError):
        overlong_penalty(1, max_length=10, buffer_length=11)


def test_normalize_and_clip_rewards():
    r = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(normalize_rewards(r), (r - 2.0) / (1.0 + 1e-6))
    assert torch.equal(normalize_rewards(torch.tensor([5.0])), torch.zeros(1))
    assert torch.equal(clip_rewards(r, min_reward=1.5, max_reward=2.5), torch.tensor([1.5, 2.0, 2.5]))
    with pytest.raises(ValueError):
        clip_rewards(r, min_reward=2.0, max_reward=1.0)
