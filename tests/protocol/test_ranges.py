"""RangeSet agrees with a plain set of integers under any sequence of adds and subtracts."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from protocol.ranges import RangeSet

spans = st.tuples(st.integers(0, 200), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1]))
ops = st.lists(st.tuples(st.booleans(), spans), max_size=40)


def as_set(ranges: RangeSet) -> set[int]:
    return {i for start, stop in ranges for i in range(start, stop)}


@given(ops)
def test_rangeset_matches_a_set_model(operations: list[tuple[bool, tuple[int, int]]]) -> None:
    ranges, model = RangeSet(), set()
    for is_add, (start, stop) in operations:
        if is_add:
            new = ranges.add(start, stop)
            assert new == len(set(range(start, stop)) - model)
            model |= set(range(start, stop))
        else:
            ranges.subtract(start, stop)
            model -= set(range(start, stop))
        assert as_set(ranges) == model
        pairs = list(ranges)
        # Disjoint, sorted, never adjacent (adjacent ranges merge).
        assert all(a[1] < b[0] for a, b in itertools.pairwise(pairs))
        assert all(start < stop for start, stop in pairs)
        for probe in range(0, 245, 7):
            assert (probe in ranges) == (probe in model)
        if pairs:
            lo, hi = pairs[0]
            assert ranges.covers(lo, hi) and not ranges.covers(lo, hi + 1)


def test_descending_and_drop_lowest_keep_the_highest_ranges() -> None:
    ranges = RangeSet([(0, 2), (5, 6), (9, 12)])
    assert ranges.descending() == [(9, 12), (5, 6), (0, 2)]
    ranges.drop_lowest(2)
    assert list(ranges) == [(5, 6), (9, 12)]
    assert ranges.shift() == (5, 6)
    assert ranges.bounds() == (9, 12)
