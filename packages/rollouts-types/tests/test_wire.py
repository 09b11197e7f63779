"""A RolloutBatch through bytes and back is the same batch; damaged bytes are refused by name."""

import json
from collections.abc import Mapping

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


def _rechecked(sample):
    """The sample rebuilt through Sample's checks (what a trusted decode must already satisfy)."""
    return Sample(**{name: getattr(sample, name) for name in Sample.__dataclass_fields__})


@settings(max_examples=30, deadline=None)
@given(batch_samples=st.lists(samples(), min_size=1, max_size=6))
def test_decoded_samples_pass_the_checks_they_skipped(batch_samples):
    for s in batch_from_bytes(batch_to_bytes(RolloutBatch(samples=tuple(batch_samples)))).samples:
        assert _rechecked(s) == s
        assert type(s.status) is Status and isinstance(s.metadata, Mapping)


def _header(data):
    size = int.from_bytes(data[4:12], "little")
    return json.loads(data[12 : 12 + size]), data[12 + size :]


def _with_header(data, header, body):
    head = json.dumps(header).encode()
    return data[:4] + len(head).to_bytes(8, "little") + head + body


def test_shared_prompts_and_metadata_travel_once():
    group = [
        Sample(
            prompt="2+2=",
            response=r,
            tokens=[1, 2, 3],
            num_prompt_tokens=1,
            loss_mask=[0, 1, 1],
            metadata={"answer": "4"},
        )
        for r in ("4", "5", "44", "é")
    ]
    other = Sample(prompt=({"role": "user", "content": "hi"},), metadata={"answer": "4"})
    batch = RolloutBatch(samples=(*group, other))
    data = batch_to_bytes(batch)
    header, _ = _header(data)
    assert sorted(header["values"]) == sorted(['"2+2="', '{"answer":"4"}', '[{"role":"user","content":"hi"}]'])
    got = batch_from_bytes(data)
    assert got == batch
    assert got.samples[0].metadata is got.samples[4].metadata  # one frozen mapping for equal metadata


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("reward", "high", "column reward: 'high' is not a finite number or null"),
        ("group_index", -1, "column group_index: -1 is not a non-negative int or null"),
        ("status", "done", "column status: 'done' is not a status"),
        ("num_prompt_tokens", True, "column num_prompt_tokens: True is not a non-negative int"),
        ("mask_runs", [[0, True, 1.0]], r"column mask_runs: \[\[0, True, 1.0\]\] is not a list of"),
        ("prompt", 7, "column prompt: index 7 past the"),
    ],
)
def test_a_bad_column_value_is_refused_by_name(column, value, message):
    batch = RolloutBatch(samples=(Sample(tokens=[1, 2], num_prompt_tokens=1, loss_mask=[0.0, 1.0], reward=1.0),))
    header, body = _header(batch_to_bytes(batch))
    header["columns"][column][0] = value
    with pytest.raises(ValueError, match=message):
        batch_from_bytes(_with_header(batch_to_bytes(batch), header, body))


def test_inconsistent_counts_and_values_are_refused():
    batch = RolloutBatch(
        samples=(Sample(tokens=[1, 2], num_prompt_tokens=1, loss_mask=[0, 1], response="ab", metadata={"a": 1}),)
    )
    data = batch_to_bytes(batch)
    header, body = _header(data)
    header["columns"]["num_prompt_tokens"][0] = 3
    with pytest.raises(ValueError, match="num_prompt_tokens 3 > its 2 tokens"):
        batch_from_bytes(_with_header(data, header, body))
    header, body = _header(data)
    header["columns"]["response_chars"][0] = 1
    with pytest.raises(ValueError, match="after its last sample"):
        batch_from_bytes(_with_header(data, header, body))
    header, body = _header(data)
    header["values"][header["columns"]["metadata"][0]] = "[1]"
    with pytest.raises(ValueError, match="metadata must be an object"):
        batch_from_bytes(_with_header(data, header, body))
    header, body = _header(data)
    header["columns"]["mask_runs"][0] = [[1, 3, 1.0]]
    with pytest.raises(ValueError, match="length"):
        batch_from_bytes(_with_header(data, header, body))
    header, body = _header(data)
    del header["columns"]["index"]
    with pytest.raises(ValueError, match="columns must be an object with"):
        batch_from_bytes(_with_header(data, header, body))
