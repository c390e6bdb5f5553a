"""The shards of a save as the core handles them, and :class:`DeferredSource` for tensors read
only when written (what an integration hands a save is in :mod:`adacheck.integration`).

The shards of one rank are cut into row chunks (:func:`split_chunks`) and described by their
:class:`~adacheck.types.ShardMeta` (:func:`shard_meta`: identity and hash) before the exchange;
objects (JSON-able trees with tensors) become shards of their own (:func:`object_shards`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..format import jsontree
from ..format.boxes import row_chunks
from ..errors import FormatError
from ..format.hashing import bound_digest, box_identity, hash_threads, in_background
from ..integration import LocalShard
from ..types import Box, Kind, ShardMeta, dtype_name


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


def shard_meta(s: LocalShard) -> ShardMeta:
    if tuple(s.tensor.shape) != tuple(s.box.lengths):
        raise FormatError(f"{s.name}: tensor of shape {tuple(s.tensor.shape)} given for box {s.box}")
    dtype = dtype_name(s.tensor.dtype)
    digest = bound_digest(box_identity(s.name, dtype, s.shape, s.box.offsets, s.box.lengths), bytes_of(s.tensor))
    return ShardMeta(name=s.name, kind=s.kind.value, dtype=dtype, shape=tuple(s.shape), box=s.box, hash=digest,
                     derive=s.derive, derive_ok=s.derive_ok, replicated=s.replicated)


def shard_metas(shards: List[LocalShard]) -> List[ShardMeta]:
    """:func:`shard_meta` of each shard, in order; CPU tensors hashed on the hashing threads in
    :func:`~adacheck.format.hashing.hash_threads` runs of about equal bytes (one task per run, not
    per shard: a state of many small tensors pays no hand-off per tensor)."""
    threads = hash_threads()
    if threads == 1 or not all(isinstance(s.tensor, torch.Tensor) and s.tensor.device.type == "cpu"
                                    for s in shards):
        return [shard_meta(s) for s in shards]
    total = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
    runs: List[List[LocalShard]] = [[]]
    done = 0
    for s in shards:
        if done >= total * len(runs) / threads and runs[-1]:
            runs.append([])
        runs[-1].append(s)
        done += s.tensor.numel() * s.tensor.element_size()
    tasks = [in_background(lambda run: [shard_meta(s) for s in run], run) for run in runs]
    return [m for t in tasks for m in t.result()]


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
        shards.append(LocalShard(name, Kind.OBJECT, tuple(t.shape), Box.full(t.shape), t,
                                 replicated=replicated))
    return enc, shards
