"""A RolloutBatch through bytes and back is the same batch; damaged bytes are refused by name."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.types import RolloutBatch, Sample, Status
from rollouts.types.wire import batch_from_bytes, batch_to_bytes


@st.composite
def samples(draw):
    n = draw(st.integers(0, 30))
    prompt = draw(st.integers(0, n))
    return Sample(
        prompt=draw(st.text(max_size=8) | st.just([{"role": "user", "content": "hé"}])),
        response=draw(st.text(max_size=20)),
        tokens=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        num_prompt_tokens=prompt,
        loss_mask=draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n)),
        rollout_logprobs=draw(st.none() | st.lists(st.floats(-50, 0), min_size=n - prompt, max_size=n - prompt)),
        reward=draw(st.none() | st.floats(-5, 5)),
        advantage=draw(st.none() | st.floats(-5, 5)),
        group_index=draw(st.none() | st.integers(0, 9)),
        weight_version=draw(st.none() | st.integers(0, 9)),
        metadata={"answer": draw(st.integers()), "trace": [1, {"a": "b"}]},
        status=draw(st.sampled_from(list(Status))),
    )


@settings(max_examples=60, deadline=None)
@given(batch_samples=st.lists(samples(), max_size=6), step=st.integers(0, 99))
def test_a_batch_round_trips_through_bytes(batch_samples, step):
    batch = RolloutBatch(
        samples=tuple(batch_samples),
        step=step,
        num_filtered=2,
        filter_reasons={"zero_std": 2},
        metadata={"errors": ["EngineError: boom"], "generate_s": 0.5},
    )
    assert batch_from_bytes(batch_to_bytes(batch)) == batch


@given(batch_samples=st.lists(samples(), min_size=1, max_size=3), cut=st.integers(1, 64))
def test_damaged_bytes_are_refused(batch_samples, cut):
    data = batch_to_bytes(RolloutBatch(samples=tuple(batch_samples)))
    with pytest.raises(ValueError, match="not a rollouts batch"):
        batch_from_bytes(b"XXXX" + data[4:])
    if any(len(s.tokens) or s.response for s in batch_samples):
        with pytest.raises(ValueError, match="cut short"):
            batch_from_bytes(data[: max(12, len(data) - cut)])
    with pytest.raises(ValueError, match="after its last sample"):
        batch_from_bytes(data + b"\0")
