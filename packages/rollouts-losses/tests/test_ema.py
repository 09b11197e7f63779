"""The float32-accumulated EMA of bf16 parameters tracks a float64 EMA; an in-place bf16 EMA does not."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.losses import ema_accumulators, ema_update_

DECAY = 0.99


def _policy_walk(seed, steps, size=4096, step_std=3e-4):
    """bf16 weights of about 0.05 and a bf16 policy taking `steps` small steps from them."""
    g = torch.Generator().manual_seed(seed)
    start = (0.05 * torch.randn(size, generator=g)).bfloat16()
    policy, out = start, []
    for _ in range(steps):
        policy = (policy.float() + step_std * torch.randn(size, generator=g)).bfloat16()  # an optimizer step in bf16
        out.append(policy)
    return start, out


def _movement(ours, exact, start):
    return float((ours.double() - start.double()).norm() / (exact - start.double()).norm())


@pytest.mark.parametrize("seed", [0, 1])
def test_a_bf16_average_tracks_the_float64_average(seed):
    start, policies = _policy_walk(seed, 300)
    params = {"w": start.clone()}
    accumulators = ema_accumulators(params)
    in_place, exact = start.clone(), start.double()
    for policy in policies:
        ema_update_(params, accumulators, {"w": policy}, decay=DECAY)
        in_place.lerp_(policy, 1.0 - DECAY)  # a bf16 average updated in place
        exact = exact * DECAY + policy.double() * (1.0 - DECAY)
    w = params["w"]
    assert w.dtype == torch.bfloat16 and accumulators["w"].dtype == torch.float32
    assert torch.equal(w, accumulators["w"].bfloat16())
    # within bf16's rounding of the exact average (half a unit: 2^-9 of the value, at most)
    assert bool(((w.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-12).all())
    assert _movement(w, exact, start) == pytest.approx(1.0, abs=0.01)
    assert _movement(in_place, exact, start) < 0.7  # what the average in bf16 keeps


@settings(max_examples=20, deadline=None)
@given(
    values=st.lists(st.floats(-4.0, 4.0, width=32), min_size=1, max_size=8),
    decay=st.floats(0.5, 0.999),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_wide_parameters_are_their_own_accumulators(values, decay, dtype):
    params = {"w": torch.zeros(len(values), dtype=dtype)}
    accumulators = ema_accumulators(params)
    assert accumulators["w"] is params["w"]
    ema_update_(params, accumulators, {"w": torch.tensor(values, dtype=dtype)}, decay=decay)
    torch.testing.assert_close(params["w"], torch.tensor(values, dtype=dtype) * (1.0 - decay))


def test_gradients_and_mismatched_names_are_refused_or_untouched():
    w = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    accumulators = ema_accumulators({"w": w})
    assert not accumulators["w"].requires_grad
    ema_update_({"w": w}, accumulators, {"w": torch.zeros(3, requires_grad=True)}, decay=0.5)
    assert w.tolist() == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="decay must be in"):
        ema_update_({"w": w}, accumulators, {"w": w}, decay=1.0)
    with pytest.raises(ValueError, match=r"differ: \['v', 'w'\]"):
        ema_update_({"w": w}, accumulators, {"v": w}, decay=0.5)
