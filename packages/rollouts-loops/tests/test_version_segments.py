"""Version segments across an episode's turns: runs merged as they are appended, and cut to a prefix."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.loops.agents.episode import cut_segments
from rollouts.loops.rollouts.continued import extend_segments, oldest_of

runs = st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 5)), max_size=8)


def expand(segments):
    return [v for v, n in segments for _ in range(n)]


@settings(max_examples=200, deadline=None)
@given(first=runs, second=runs)
def test_extending_segments_appends_their_versions_in_merged_runs(first, second):
    start = extend_segments([], first)
    out = extend_segments(start, second)
    assert expand(out) == expand(first) + expand(second)  # the versions, token by token
    assert all(n > 0 for _, n in out)  # no empty run
    assert all(a[0] != b[0] for a, b in zip(out, out[1:], strict=False))  # neighbours merged
    assert oldest_of([v for v, _ in out]) == min((v for v in expand(out) if v is not None), default=None)


@settings(max_examples=200, deadline=None)
@given(segments=runs, length=st.integers(0, 40))
def test_cutting_segments_keeps_the_versions_of_the_prefix(segments, length):
    segments = [(v, n) for v, n in segments if n > 0]
    cut = cut_segments(segments, length)
    assert expand(cut) == expand(segments)[:length] and all(n > 0 for _, n in cut)
