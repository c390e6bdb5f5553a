import itertools
import math

import pytest
import torch

from adacheck.format.boxes import check_tiling, copy_intersection, flat_range_to_boxes
from adacheck.errors import FormatError
from adacheck.types import Box

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (4, 0)])
def test_flat_ranges_decompose_exactly(shape):
    n = math.prod(shape)
    t = torch.arange(max(n, 1))[:n].reshape(shape)
    for start, stop in itertools.combinations_with_replacement(range(n + 1), 2):
        boxes = flat_range_to_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        got = torch.cat([t[b.slices()].reshape(-1) for b in boxes]) if boxes else t.reshape(-1)[:0]
        assert torch.equal(got, t.reshape(-1)[start:stop])
        check_tiling("x", (stop - start,), [Box((0,), (stop - start,))])


def test_flat_range_bounds_are_checked():
    with pytest.raises(FormatError, match="outside"):
        flat_range_to_boxes((2, 3), 4, 7)


def test_tiling_detects_gaps_and_overlaps():
    check_tiling("w", (4, 4), [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))])
    with pytest.raises(FormatError, match="overlap"):
        check_tiling("w", (4, 4), [Box((0, 0), (3, 4)), Box((2, 0), (2, 4))])
    with pytest.raises(FormatError, match="cover 8 of 16"):
        check_tiling("w", (4, 4), [Box((0, 0), (2, 4))])
    with pytest.raises(FormatError, match="outside"):
        check_tiling("w", (4, 4), [Box((0, 0), (5, 4))])


def test_tiling_check_agrees_with_every_pair_on_many_layouts():
    """The sweep finds exactly the overlaps a comparison of every pair finds: row, column and
    flat-range partitions of 64 ranks, with and without one box moved onto its neighbour."""
    rng = torch.Generator().manual_seed(0)
    shape = (64, 96)
    layouts = {"rows": [Box((r, 0), (1, 96)) for r in range(64)],
               "cols": [Box((0, c * 3), (64, 3)) for c in range(32)],
               "flat": [b for r in range(64) for b in flat_range_to_boxes(shape, r * 96, (r + 1) * 96)]}
    cuts = sorted(set(torch.randint(1, 64 * 96, (40,), generator=rng).tolist()))
    layouts["ragged"] = [b for lo, hi in zip([0] + cuts, cuts + [64 * 96]) for b in flat_range_to_boxes(shape, lo, hi)]
    for name, boxes in layouts.items():
        check_tiling(name, shape, boxes)
        for i in (1, len(boxes) // 2, len(boxes) - 1):
            moved = list(boxes)
            b = moved[i]
            d = next(d for d in range(2) if b.lengths[d] < shape[d])   # grow it onto a neighbour
            off, ln = list(b.offsets), list(b.lengths)
            if off[d] + ln[d] < shape[d]:
                ln[d] += 1
            else:
                off[d], ln[d] = off[d] - 1, ln[d] + 1
            moved[i] = Box(tuple(off), tuple(ln))
            uniq = sorted(set(moved))
            assert any(a.intersect(c) is not None for j, a in enumerate(uniq) for c in uniq[j + 1:])
            with pytest.raises(FormatError, match="overlap"):
                check_tiling(name, shape, moved)


def test_box_validation():
    with pytest.raises(FormatError):
        Box((0, -1), (1, 1))
    with pytest.raises(FormatError):
        Box((0,), (1, 1))
    assert Box((1, 2), (3, 4)).intersect(Box((2, 0), (5, 3))) == Box((2, 2), (2, 1))
    assert Box((0,), (2,)).intersect(Box((2,), (2,))) is None


def test_copy_intersection_reshards():
    full = torch.arange(24.).reshape(4, 6)
    dst_box = Box((1, 2), (2, 3))
    dst = torch.zeros(2, 3)
    for src_box in [Box((0, 0), (2, 6)), Box((2, 0), (2, 6))]:
        copy_intersection(dst, dst_box, full[src_box.slices()], src_box)
    assert torch.equal(dst, full[dst_box.slices()])
