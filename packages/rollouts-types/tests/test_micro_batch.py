"""MicroBatch: frozen, shape-checked against input_ids for any array type with a `.shape`, and
changed only through replace/map (the package is stdlib-only, so a tiny array stands in here)."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollouts.types import MicroBatch


@dataclasses.dataclass(frozen=True)
class Arr:
    """An array stand-in: a shape and a tag to tell arrays apart."""

    shape: tuple[int, ...]
    tag: str = ""


def _mb(b, t, **kw):
    fields = {k: Arr((b, t), k) for k in ("input_ids", "position_ids", "segment_ids", "attention_mask", "loss_mask")}
    return MicroBatch(sample_indices=Arr((b,)), **fields, **kw)


@given(b=st.integers(1, 4), t=st.integers(1, 9), name=st.sampled_from(["advantages", "old_logprobs", "loss_mask"]))
def test_a_per_token_array_of_another_shape_is_refused_naming_it(b, t, name):
    assert _mb(b, t).input_ids.shape == (b, t)
    with pytest.raises(ValueError, match=name):
        _mb(b, t).replace(**{name: Arr((b, t + 1))})


@given(b=st.integers(1, 4), t=st.integers(1, 9))
def test_extras_are_checked_too_and_may_not_shadow_a_field(b, t):
    mb = _mb(b, t).replace(values=Arr((b, t), "v"))
    assert mb.extras["values"].tag == "v" and mb.get("values") is mb.extras["values"]
    assert set(mb.token_arrays()) == {
        "input_ids", "position_ids", "segment_ids", "attention_mask", "loss_mask", "values"
    }  # fmt: skip
    with pytest.raises(ValueError, match="values"):
        mb.replace(values=Arr((b + 1, t)))
    with pytest.raises(ValueError, match="loss_mask"):
        _mb(b, t, extras={"loss_mask": Arr((b, t))})


def test_frozen_and_input_ids_must_be_two_dimensional():
    mb = _mb(2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mb.loss_mask = Arr((2, 3))  # type: ignore[misc]
    with pytest.raises(TypeError):
        mb.extras["x"] = Arr((2, 3))  # type: ignore[index]
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        _mb(2, 3).replace(input_ids=Arr((6,)))
    assert not mb.packed and mb.replace(cu_seqlens=Arr((3,))).packed


@given(b=st.integers(1, 3), t=st.integers(1, 5), with_extra=st.booleans())
def test_map_converts_every_present_array_and_keeps_absent_ones_absent(b, t, with_extra):
    mb = _mb(b, t, advantages=Arr((b, t), "adv"))
    if with_extra:
        mb = mb.replace(returns=Arr((b, t), "ret"))
    seen = []
    out = mb.map(lambda name, a: (seen.append(name), Arr(a.shape, a.tag + "!"))[1])
    assert out.advantages.tag == "adv!" and out.rollout_logprobs is None and out.cu_seqlens is None
    assert sorted(seen) == sorted([*mb.token_arrays(), "sample_indices"])
    assert (out.get("returns") is not None) == with_extra
