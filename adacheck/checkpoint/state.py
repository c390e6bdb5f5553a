"""What an integration hands a save: this rank's :class:`LocalState`, the :class:`LocalShard` boxes
of logical tensors it holds, and :class:`DeferredSource` for tensors read only when written.

The shards of one rank are cut into row chunks (:func:`split_chunks`) and described by their
:class:`~adacheck.types.ShardMeta` (:func:`shard_meta`: identity and hash) before the exchange;
objects (JSON-able trees with tensors) become shards of their own (:func:`object_shards`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from ..format import jsontree
from ..format.boxes import row_chunks
from ..errors import FormatError
from ..format.hashing import bound_digest, box_identity
from ..types import Box, ShardMeta, dtype_name


class DeferredSource:
    """Tensors read only when their bytes are needed, for saves that must not hold a whole
    state (offline conversions).  ``load(key)`` returns the full tensor ``key``; the most
    recent one is kept, so the pieces of one tensor (see split_chunks) cost one read."""

    def __init__(self, load: Callable[[str], torch.Tensor]):
        self._load = load
        self._last: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)
        self.reads = 0

    def get(self, key: str) -> torch.Tensor:
        if self._last[0] != key:
            self._last = (None, None)          # drop the previous tensor before reading the next
            self._last = (key, self._load(key))
            self.reads += 1
        return self._last[1]

    def tensor(self, key: str, shape, dtype: torch.dtype) -> "Deferred":
        return Deferred(self, key, tuple(shape), dtype, None)

    def release(self) -> None:
        self._last = (None, None)


@dataclass(frozen=True)
class Deferred:
    """Shape and dtype of a tensor whose bytes a DeferredSource reads on demand (a row range
    ``rows`` of it, after split_chunks).  A save hashes it, then reads it again to write it."""
    source: DeferredSource
    key: str
    shape: tuple
    dtype: torch.dtype
    rows: Optional[Tuple[int, int]]

    def narrow(self, dim: int, start: int, length: int) -> "Deferred":
        if dim != 0:
            raise ValueError("a deferred tensor is cut along its first axis only")
        base = self.rows[0] if self.rows else 0
        return Deferred(self.source, self.key, (length,) + self.shape[1:], self.dtype, (base + start, length))

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def materialize(self) -> torch.Tensor:
        t = self.source.get(self.key)
        if self.rows is not None:
            t = t.narrow(0, *self.rows)
        if t.dtype != self.dtype or tuple(t.shape) != self.shape:
            raise FormatError(f"{self.key}: read {t.dtype}{list(t.shape)}, expected {self.dtype}{list(self.shape)}")
        return t.detach().to("cpu").contiguous()


def bytes_of(t) -> torch.Tensor:
    return t.materialize() if isinstance(t, Deferred) else t


@dataclass
class LocalShard:
    """A box of a logical tensor held by this rank (what an integration reports, one per box).

    Attributes:
        name: the layout-free name (``model/...``, ``master/...``, ``optim/<state>/...``), the
            same on every rank and in every parallel layout.
        kind: one of :data:`adacheck.types.KINDS` ("model", "master", "optim", "buffer",
            "object", "rng").
        shape: the whole logical tensor's shape.
        box: the region of it this rank holds.
        tensor: the box's elements, of shape ``box.lengths`` (a torch tensor, or a
            :class:`Deferred` one that is read when hashed and again when written).
        derive: the name of a tensor this one may be a cast of (a bf16 weight of its fp32
            master): not stored, but rebuilt from that one on load, when every holder proved
            the cast and no replica diverged.
        derive_ok: this rank proved the cast on the part of the source it can see.
        replicated: declared: other holders of the same box hold the same bytes (a replica
            whose hash differs is warned about, and every variant kept).
    """

    name: str
    kind: str
    shape: tuple
    box: Box
    tensor: torch.Tensor
    derive: Optional[str] = None
    derive_ok: bool = False
    replicated: bool = True


@dataclass
class LocalState:
    """All this rank holds for one save: its ``shards``, the job's ``objects`` (JSON-able trees
    with tensors; rank 0's copy is saved), its own ``rank_objects`` (e.g. RNG states), its
    ``layout`` and the ``framework`` description (kept in the manifest), and the training ``step``."""
    shards: List[LocalShard]
    objects: dict = field(default_factory=dict)       # global state; rank 0's copy is saved
    rank_objects: dict = field(default_factory=dict)  # this rank's own state (e.g. RNG)
    layout: dict = field(default_factory=dict)        # this rank's framework layout
    framework: dict = field(default_factory=dict)
    step: Optional[int] = None


def shard_meta(s: LocalShard) -> ShardMeta:
    if tuple(s.tensor.shape) != tuple(s.box.lengths):
        raise FormatError(f"{s.name}: tensor of shape {tuple(s.tensor.shape)} given for box {s.box}")
    dtype = dtype_name(s.tensor.dtype)
    digest = bound_digest(box_identity(s.name, dtype, s.shape, s.box.offsets, s.box.lengths), bytes_of(s.tensor))
    return ShardMeta(name=s.name, kind=s.kind, dtype=dtype, shape=tuple(s.shape), box=s.box, hash=digest,
                     derive=s.derive, derive_ok=s.derive_ok, replicated=s.replicated)


def split_chunks(s: LocalShard, limit: int) -> List[LocalShard]:
    """``s`` cut along the first axis of its box into pieces of at most ``limit`` bytes (at
    least one row each).  Deterministic in (box, shape, dtype), so every holder of a box and
    the next checkpoint cut it the same way and equal pieces are found by their hashes."""
    t = s.tensor
    boxes = row_chunks(s.box, t.element_size(), limit)
    if len(boxes) == 1:
        return [s]
    return [LocalShard(s.name, s.kind, s.shape, box, t.narrow(0, box.offsets[0] - s.box.offsets[0], box.lengths[0]),
                       derive=s.derive, derive_ok=s.derive_ok, replicated=s.replicated) for box in boxes]


def object_shards(tree, prefix: str, replicated: bool):
    enc, tensors = jsontree.encode(tree, prefix)
    shards = []
    for name, t in tensors:
        t = t.detach()
        shards.append(LocalShard(name, "object", tuple(t.shape), Box.full(t.shape), t,
                                 replicated=replicated))
    return enc, shards
