"""Pure box arithmetic: flat (ZeRO) ranges <-> N-d boxes, tiling checks, copies."""
from __future__ import annotations

import math
from typing import Iterable, List, Tuple

import torch

from ..errors import FormatError
from ..types import Box


def flat_range_to_boxes(shape, start: int, stop: int) -> List[Box]:
    """Boxes whose row-major concatenation is elements ``[start, stop)`` of a tensor.

    Each returned box is contiguous in row-major order and they come in flat order, so
    ``torch.cat([t[b.slices()].reshape(-1) for b in boxes]) == t.reshape(-1)[start:stop]``.
    At most ``2 * ndim - 1`` boxes are returned.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if not (0 <= start <= stop <= total):
        raise FormatError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    zeros = (0,) * len(rest)

    def rows(a: int, b: int) -> List[Box]:
        return [Box((a,) + zeros, (b - a,) + rest)] if b > a else []

    def partial(row: int, lo: int, hi: int) -> List[Box]:
        return [Box((row,) + s.offsets, (1,) + s.lengths) for s in flat_range_to_boxes(rest, lo, hi)]

    first, last = start // inner, (stop - 1) // inner
    if first == last:
        lo, hi = start - first * inner, stop - first * inner
        if lo == 0 and hi == inner:
            return rows(first, first + 1)
        return partial(first, lo, hi)
    out: List[Box] = []
    if start % inner:
        out += partial(first, start % inner, inner)
        first += 1
    if stop % inner:
        out += rows(first, last)
        out += partial(last, 0, stop % inner)
    else:
        out += rows(first, last + 1)
    return out


def row_chunks(box: Box, itemsize: int, limit: int) -> List[Box]:
    """``box`` cut along its first axis into boxes of at most ``limit`` bytes (at least one row
    each); ``[box]`` when it fits, has no axis or one row, or ``limit`` <= 0."""
    nbytes = box.numel * itemsize
    if limit <= 0 or nbytes <= limit or not box.lengths or box.lengths[0] <= 1:
        return [box]
    rows = box.lengths[0]
    per = max(1, limit // max(1, nbytes // rows))
    return [Box((box.offsets[0] + a,) + tuple(box.offsets[1:]), (min(per, rows - a),) + tuple(box.lengths[1:]))
            for a in range(0, rows, per)]


def flat_pieces(region: Box, start: int, stop: int) -> List[Tuple[Box, slice]]:
    """Elements ``[start, stop)`` of the box ``region`` of a tensor, flattened on its own (e.g.
    one rank's slice of a logical tensor): for each piece, its box in the tensor's coordinates
    and its range in the flat run."""
    out, pos = [], 0
    for b in flat_range_to_boxes(region.lengths, start, stop):
        out.append((b.shifted(region.offsets), slice(pos, pos + b.numel)))
        pos += b.numel
    return out


def flat_views(region: Box, start: int, flat: torch.Tensor) -> List[Tuple[Box, torch.Tensor]]:
    """A 1-D run of elements ``[start, start + len(flat))`` of the box ``region`` of a tensor, cut
    into (its box in the tensor's coordinates, a view of ``flat`` in that box's shape) pieces."""
    return [(b, flat[run].view(b.lengths)) for b, run in flat_pieces(region, start, start + flat.numel())]


def _check_disjoint(name: str, regions: List[Box]) -> None:
    """Raise if two boxes overlap: a sweep along the axis where the boxes' offsets differ most,
    comparing each box only with those still open there (about n log n for the layouts
    frameworks make: row, column and flat-range partitions), not every pair."""
    if len(regions) < 2:
        return
    nd = len(regions[0].offsets)
    if nd == 0:
        raise FormatError(f"{name}: stored boxes {regions[0]} and {regions[1]} overlap")
    axis = max(range(nd), key=lambda d: (len({b.offsets[d] for b in regions}), -d))
    open_: List[Box] = []
    for b in sorted(regions, key=lambda b: b.offsets[axis]):
        start = b.offsets[axis]
        open_ = [a for a in open_ if a.offsets[axis] + a.lengths[axis] > start]
        for a in open_:
            if a.intersect(b) is not None:
                raise FormatError(f"{name}: stored boxes {a} and {b} overlap")
        open_.append(b)


def check_tiling(name: str, shape, boxes: Iterable[Box], whole: bool = True) -> None:
    """Raise unless the distinct ``boxes`` exactly tile ``shape`` (cover it, no overlap);
    ``whole=False``: unless they lie inside it without overlap (a part of a tiling)."""
    shape = tuple(shape)
    regions = sorted(set(boxes))
    for b in regions:
        if not b.fits(shape):
            raise FormatError(f"{name}: stored box {b} lies outside the tensor shape {shape}")
    covered = sum(b.numel for b in regions)
    _check_disjoint(name, regions)
    if whole and covered != math.prod(shape):
        raise FormatError(
            f"{name}: stored boxes cover {covered} of {math.prod(shape)} elements of shape {shape}; "
            "the checkpoint is incomplete or its manifest was edited")


def copy_intersection(dst: torch.Tensor, dst_box: Box, src: torch.Tensor, src_box: Box) -> int:
    """Copy the overlap of two boxes from ``src`` (holding src_box) into ``dst`` (holding dst_box).

    Returns the number of elements copied (0 if the boxes do not meet).
    """
    inter = dst_box.intersect(src_box)
    if inter is None:
        return 0
    dst[inter.slices(dst_box)] = src[inter.slices(src_box)]
    return inter.numel
