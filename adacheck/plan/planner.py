"""Pure save planning: what every rank holds -> what each rank writes.

Contract (a pure function of its inputs; every rank computes the same plan):
- shards with the same name and box are one *region*; holders whose bytes hash the same
  share one stored copy; replicas declared identical that hash differently are kept
  as separate variants and reported in ``warnings``;
- a tensor whose shards all carry a proven cast derivation (and whose replicas agree) is
  not stored: the manifest records the derivation instead;
- each distinct box is written by ``copies`` of its holders (default 1), chosen greedily
  by bytes (largest first, to the least-loaded holder, ties to the lowest rank); further
  copies go to the least-loaded holders on nodes that hold no copy yet, then (when the
  holders span fewer nodes) to other holders; never more copies than holders;
- the distinct regions of every stored tensor must tile it, else a FormatError naming
  the tensor; ranks that disagree on a tensor's kind, dtype or shape are a StateError;
- with ``previous`` (the index of an earlier committed checkpoint), a copy whose name,
  box, dtype and hash equal a box stored there is referenced (file ``<tag>/<file>``,
  relative to the save directory), not written again; but only from a file whose referenced
  bytes are at least ``MIN_PINNED_SHARE`` of its size, or leave less than ``MAX_PINNED_WASTE``
  bytes of it unread (``file_sizes``): a reference keeps its whole file on disk past
  retention, so a few small unchanged boxes (RNG states, scalars) in a large file are written
  again instead, and a directory with ``keep_last: K`` holds at most about K checkpoints' bytes
  (a file pinned by references holds at most 1 / MIN_PINNED_SHARE times, or MAX_PINNED_WASTE
  more than, what they read of it).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..format.boxes import check_tiling
from ..gcpause import paused
from ..errors import StateError
from ..format.hashing import owner_of
from ..format.manifest import file_name
from ..types import Box, Derivation, ShardMeta, StoredBox, TensorEntry, itemsize


@dataclass(frozen=True)
class WritePlan:
    tensors: Dict[str, TensorEntry]           # the manifest's tensor table
    writes: Dict[int, Tuple[Tuple[str, Box, str], ...]]   # rank -> (name, box, key)
    files: Dict[str, dict]                    # file -> {"writer": rank, "nbytes": payload}
    warnings: Tuple[str, ...]
    stats: dict
    held: Optional[dict] = None               # partitioned: this rank's rank file (its held entries, JSON)


PreviousIndex = Dict[Tuple[str, Box], Tuple[str, str, List[Tuple[str, str]]]]
# (name, box) -> (hash, dtype, [(file ref, key) per stored copy])


def previous_index(tag: str, manifest, exists=lambda ref: True, saving: str = "", names=None) -> PreviousIndex:
    """What a later save may reference of committed checkpoint ``tag``: every box stored in
    one variant, with each copy's file as seen from the save directory (``<tag>/<file>``;
    a box that checkpoint itself referenced keeps pointing at where its bytes are).
    ``exists(ref)`` filters out files that are gone; files of the tag being ``saving`` (an
    earlier generation of a re-saved tag) are never referenced: it is rewritten instead.
    ``names``: only these tensors (a manifest in parts reads only the parts that list them)."""
    out: PreviousIndex = {}
    entries = (manifest.tensors.items() if names is None
               else ((n, manifest.tensors[n]) for n in names if n in manifest.tensors))
    for name, e in entries:
        by_box: Dict[Box, list] = defaultdict(list)
        for sb in e.boxes:
            by_box[sb.box].append(sb)
        for box, sbs in by_box.items():
            if len({sb.hash for sb in sbs}) != 1:
                continue   # diverged variants: always written again
            refs = [(sb.file if "/" in sb.file else f"{tag}/{sb.file}", sb.key) for sb in sbs]
            refs = [r for r in refs if exists(r[0]) and not (saving and r[0].startswith(saving + "/"))]
            if refs:
                out[(name, box)] = (sbs[0].hash, e.dtype, refs)
    return out


def place(items, n_ranks: int, copies: int = 1, nodes: Sequence[str] | None = None):
    """Writers for each item: ``items`` = [(nbytes, sort key, holders)] -> ([writers], loads).

    Pure and deterministic: same inputs, same answer.  Largest items first; each copy to the
    least-loaded eligible holder (ties: lowest rank), preferring nodes without a copy.
    """
    nodes = rank_nodes(n_ranks, copies, nodes)
    load: Dict[int, int] = defaultdict(int)
    out = {}
    for nbytes, key, holders in sorted(items, key=lambda t: (-t[0], t[1])):
        out[key] = _choose(nbytes, holders, copies, nodes, load)
    return out, load


def rank_nodes(n_ranks: int, copies: int, nodes) -> List[str]:
    """Each rank's node (default: a node per rank), once ``copies`` is known to be valid."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    return list(nodes) if nodes is not None else [str(r) for r in range(n_ranks)]


def _choose(nbytes: int, holders, copies: int, nodes, load) -> List[int]:
    """The writers of one item: each copy to the least-loaded holder (ties: lowest rank), on a
    node without a copy yet where there is one; ``load`` is updated."""
    chosen: List[int] = []
    for _ in range(min(copies, len(holders))):
        used = {nodes[w] for w in chosen}
        free = [h for h in holders if h not in chosen]
        fresh = [h for h in free if nodes[h] not in used]
        w = min(fresh or free, key=lambda r: (load[r], r))
        chosen.append(w)
        load[w] += nbytes
    return chosen


def place_by_group(items, n_ranks: int, copies: int = 1, nodes: Sequence[str] | None = None):
    """Like ``place``, but each set of holders is placed apart, as its owner does in a partitioned
    save (:mod:`adacheck.plan.partition`) without a global view: items held by one rank only are that
    rank's (its *pinned* bytes); the sets of holders are placed by increasing size (a data-parallel
    group before the tensor x data-parallel group that contains it), each set greedily (largest
    first) among its members, from the bytes its members held once the smaller sets were placed
    (sets of one size are placed at once, from the same bytes).  Returns ([writers] per key,
    bytes per rank).  Its balance against ``place``'s is measured by scripts/simulate_scale.py."""
    nodes = rank_nodes(n_ranks, copies, nodes)
    groups: Dict[tuple, list] = defaultdict(list)
    for nbytes, key, holders in items:
        groups[tuple(holders)].append((nbytes, key))
    total: Dict[int, int] = defaultdict(int)
    out = {}
    for size in sorted({len(h) for h in groups}):
        before = dict(total)
        for holders in sorted(h for h in groups if len(h) == size):
            nbytes = dict((k, n) for n, k in groups[holders])
            for key, writers in place_set(groups[holders], holders, copies, nodes, before).items():
                out[key] = writers
                for w in writers:
                    total[w] += nbytes[key]
    return out, total


def place_set(items, holders, copies: int, nodes, held: Dict[int, int]) -> Dict[str, List[int]]:
    """The writers of the items [(nbytes, key)] of one set of ``holders``, placed greedily (largest
    first, ties by key) from the bytes its members held before (``held``, not changed)."""
    load: Dict[int, int] = defaultdict(int, {h: held.get(h, 0) for h in holders})
    return {key: _choose(nbytes, holders, copies, nodes, load)
            for nbytes, key in sorted(items, key=lambda t: (-t[0], t[1]))}


class PlanCache:
    """What a job's planner keeps from one checkpoint to the next (a training job saves the same
    structure every time):

    - ``placed``: the last placement, which depends on sizes, keys and holders only, not on the
      hashes, so a job whose boxes and replicas did not change gets the same assignment;
    - ``tiled``: name -> (shape, boxes) already proven to tile, so the tiling check (the
      planner's costliest part) runs once per structure."""

    def __init__(self):
        self.placed: list = []
        self.tiled: Dict[str, tuple] = {}

    def place(self, items, n_ranks: int, copies: int, nodes):
        args = (items, n_ranks, copies, tuple(nodes) if nodes is not None else None)
        if self.placed and self.placed[0] == args:
            return self.placed[1]
        out = place(items, n_ranks, copies, nodes)
        self.placed[:] = [args, out]
        return out


MIN_PINNED_SHARE = 0.5
MAX_PINNED_WASTE = 1 << 20


def plan_save(per_rank: Sequence[Sequence[ShardMeta]], generation: int = 0,
              previous: PreviousIndex | None = None, copies: int = 1,
              nodes: Sequence[str] | None = None, cache: Optional[PlanCache] = None,
              file_sizes: Optional[Dict[str, int]] = None) -> WritePlan:
    """The plan (see the module docstring); ``cache``: the job's PlanCache (default: none kept);
    ``file_sizes``: bytes of each file ``previous`` refers to (default: references are not limited)."""
    with paused():
        if previous and file_sizes is not None:
            previous = _worth_pinning(per_rank, previous, file_sizes)
        return _plan(per_rank, generation, previous, copies, nodes, cache if cache is not None else PlanCache())


def _worth_pinning(per_rank, previous: PreviousIndex, file_sizes: Dict[str, int]) -> PreviousIndex:
    """``previous`` without the boxes of files that the new checkpoint would read too little of
    (see ``thin_files``; until no such file is left: a box written again reads less of its other
    copies' files)."""
    usable = usable_previous(group_by_tensor(per_rank), previous)
    while True:
        thin = thin_files(file_reads(usable), file_sizes)
        if not thin:
            return usable
        usable = without_files(usable, thin)


def usable_previous(by_name: Dict[str, List[Tuple[int, ShardMeta]]], previous: PreviousIndex) -> PreviousIndex:
    """The boxes of ``previous`` (of the tensors in ``by_name``) that every holder of the box
    holds now unchanged, in the same dtype."""
    out: PreviousIndex = {}
    for name, held in by_name.items():
        digests: Dict[Box, set] = defaultdict(set)
        for _, s in held:
            digests[s.box].add(s.hash)
        dtype = held[0][1].dtype
        for box, found in digests.items():
            v = previous.get((name, box))
            if v is not None and found == {v[0]} and dtype == v[1]:
                out[(name, box)] = v
    return out


def file_reads(usable: PreviousIndex) -> Dict[str, int]:
    """Bytes the new checkpoint would read of each file of ``usable``."""
    read: Dict[str, int] = defaultdict(int)
    for (name, box), (_, dtype, refs) in usable.items():
        for ref in {r for r, _ in refs}:
            read[ref] += box.numel * itemsize(dtype)
    return read


def thin_files(read: Dict[str, int], file_sizes: Dict[str, int]) -> set:
    """Files read less than MIN_PINNED_SHARE of, leaving more than MAX_PINNED_WASTE bytes unread."""
    return {ref for ref, n in read.items() if n < MIN_PINNED_SHARE * file_sizes.get(ref, 0)
            and file_sizes.get(ref, 0) - n > MAX_PINNED_WASTE}


def without_files(usable: PreviousIndex, files: set) -> PreviousIndex:
    return {k: v for k, v in usable.items() if not any(r in files for r, _ in v[2])}


def group_by_tensor(per_rank: Sequence[Sequence[ShardMeta]]) -> Dict[str, List[Tuple[int, ShardMeta]]]:
    """Every rank's shards, by tensor name: name -> [(rank, shard)] in rank order."""
    by_name: Dict[str, List[Tuple[int, ShardMeta]]] = defaultdict(list)
    for rank, shards in enumerate(per_rank):
        for s in shards:
            by_name[s.name].append((rank, s))
    return by_name


def route(per_rank: Sequence[Sequence[ShardMeta]], n_owners: int):
    """What each owner (``owner_of``) receives when the decisions are partitioned by tensor: per
    owner, (name -> [(rank, shard)] of the tensors it owns, name -> the source shard of a derived
    tensor it owns, as attached by the lowest rank that sends both).  ``decide`` on each owner's
    part, with ``source_of=sources.get``, gives the whole plan's decisions for those tensors."""
    routed = [(defaultdict(list), {}) for _ in range(n_owners)]
    for rank, shards in enumerate(per_rank):
        for owner, (mine, sources) in route_rank(shards, n_owners).items():
            by_name, got = routed[owner]
            for s in mine:
                by_name[s.name].append((rank, s))
            for name, s in sources.items():
                got.setdefault(name, s)
    return routed


def route_rank(shards: Sequence[ShardMeta], n_owners: int) -> Dict[int, Tuple[List[ShardMeta], Dict[str, ShardMeta]]]:
    """What one rank sends each owner: owner -> (its shards of the tensors the owner decides, the
    source shard of each derived one of them that this rank also holds)."""
    own = {s.name: s for s in shards}
    out: Dict[int, Tuple[List[ShardMeta], Dict[str, ShardMeta]]] = {}
    for s in shards:
        mine, sources = out.setdefault(owner_of(s.name, n_owners), ([], {}))
        mine.append(s)
        if s.derive is not None and s.derive in own:
            sources.setdefault(s.derive, own[s.derive])
    return out


@dataclass
class Decisions:
    """What the planner decides per tensor, before any writer is chosen: each tensor's entry
    (stored boxes with no file yet, except those referenced from ``previous``), the boxes to
    place among their holders, the warnings, and the bytes held and logical."""
    tensors: Dict[str, TensorEntry]
    items: List[Tuple[int, str, Tuple[int, ...]]]      # nbytes, key, holders
    warnings: List[str]
    logical: int
    held: int


def decide(by_name: Dict[str, List[Tuple[int, ShardMeta]]], previous: PreviousIndex | None, copies: int,
           cache: PlanCache, source_of=None) -> Decisions:
    """The per-tensor decisions of the plan (see the module docstring) for the tensors of
    ``by_name``.  Each tensor is decided from its own holders' shards alone, and a derived
    tensor also from its source's first shard (``source_of(name)``, None when no rank holds it;
    default: looked up in ``by_name``), so the tensors may be decided apart (by their owners,
    ``owner_of``) with the same outcome."""
    if source_of is None:
        def source_of(src):
            return by_name[src][0][1] if src in by_name else None
    warnings: List[str] = []
    tensors: Dict[str, TensorEntry] = {}
    items = []   # nbytes, key, holders
    logical = held = 0
    for name in sorted(by_name):
        held_by = sorted(by_name[name], key=lambda t: t[0])
        first = held_by[0][1]
        for rank, s in held_by:
            if (s.kind, s.dtype, s.shape) != (first.kind, first.dtype, first.shape):
                raise StateError(
                    f"{name}: rank {held_by[0][0]} holds {first.kind}/{first.dtype}{list(first.shape)} "
                    f"but rank {rank} holds {s.kind}/{s.dtype}{list(s.shape)}; the ranks disagree "
                    "on the model, so no consistent checkpoint can be written")
        regions: Dict[Box, Dict[str, List[int]]] = defaultdict(lambda: defaultdict(list))
        for rank, s in held_by:
            regions[s.box][s.hash].append(rank)
            held += s.nbytes
        structure = (first.shape, frozenset(regions))
        if cache.tiled.get(name) != structure:   # checked once per structure, not at every checkpoint
            check_tiling(name, first.shape, regions.keys())
            cache.tiled[name] = structure
        logical += sum(b.numel for b in regions) * itemsize(first.dtype)
        diverged = []
        for box, variants in regions.items():
            if len(variants) > 1:
                ranks = [sorted(r) for r in variants.values()]
                diverged.append(f"{name} box {box.key()}: holders {ranks} hold different bytes")
        if diverged and first.replicated:
            warnings.extend(f"declared replicas diverged: {d}; every variant is kept" for d in diverged)
        derivable = (first.derive is not None and not diverged
                     and all(s.derive_ok and s.derive == first.derive for _, s in held_by))
        if derivable:
            src = source_of(first.derive)
            derivable = src is not None and src.shape == first.shape and src.derive is None
        if derivable:   # not diverged: one digest per box
            tensors[name] = TensorEntry(name, first.kind, first.dtype, first.shape, derived=Derivation(
                first.derive, boxes=tuple((box, next(iter(regions[box]))) for box in sorted(regions))))
            continue
        stored = []
        for box in sorted(regions):
            variants = regions[box]
            old = (previous or {}).get((name, box))
            for vi, digest in enumerate(sorted(variants, key=lambda h: min(variants[h]))):
                holders = tuple(sorted(variants[digest]))
                if (old is not None and len(variants) == 1 and old[:2] == (digest, first.dtype)
                        and len(old[2]) >= min(copies, len(holders))):   # unchanged, enough copies
                    stored.extend(StoredBox(box, ref, key, digest, holders) for ref, key in old[2])
                    continue
                key = f"{name}@{box.key()}" + (f"#v{vi}" if len(variants) > 1 else "")
                items.append((box.numel * itemsize(first.dtype), key, holders))
                stored.append(StoredBox(box, "", key, digest, holders))
        tensors[name] = TensorEntry(name, first.kind, first.dtype, first.shape, boxes=tuple(stored))
    return Decisions(tensors, items, warnings, logical, held)


def _plan(per_rank, generation, previous, copies, nodes, cache: PlanCache) -> WritePlan:
    d = decide(group_by_tensor(per_rank), previous, copies, cache)
    # Balanced, deterministic assignment (of what is not referenced from ``previous``).
    writer_of, load = cache.place(d.items, len(per_rank), copies, nodes)
    tensors, writes, files, referenced = assign_files(d.tensors, writer_of, generation)
    stats = {"held_bytes": d.held, "logical_bytes": d.logical,
             "stored_bytes": sum(f["nbytes"] for f in files.values()),
             "derived_bytes": sum(e.nbytes for e in tensors.values() if e.derived is not None),
             "referenced_bytes": referenced,
             "per_rank_bytes": [load.get(r, 0) for r in range(len(per_rank))]}
    return WritePlan(tensors=tensors, writes={r: tuple(v) for r, v in writes.items()},
                     files=files, warnings=tuple(d.warnings), stats=stats)


def assign_files(tensors: Dict[str, TensorEntry], writer_of: Dict[str, List[int]], generation: int):
    """The decided entries with each box to write in its writers' files (``writer_of``: key ->
    writers): (entries, rank -> [(name, box, key)] it writes, file -> {"writer", "nbytes"}, bytes
    referenced from an earlier checkpoint)."""
    out: Dict[str, TensorEntry] = {}
    writes: Dict[int, List[Tuple[str, Box, str]]] = defaultdict(list)
    files: Dict[str, dict] = {}
    referenced = 0
    for name, e in tensors.items():
        if e.derived is not None:
            out[name] = e
            continue
        new_boxes = []
        for sb in e.boxes:
            if sb.file:   # referenced from the previous checkpoint
                new_boxes.append(sb)
                referenced += sb.box.numel * itemsize(e.dtype)
                continue
            for w in writer_of[sb.key]:   # one stored copy per writer
                fname = file_name(w, generation)
                files.setdefault(fname, {"writer": w, "nbytes": 0})
                files[fname]["nbytes"] += sb.box.numel * itemsize(e.dtype)
                writes[w].append((name, sb.box, sb.key))
                new_boxes.append(StoredBox(sb.box, fname, sb.key, sb.hash, sb.holders))
        out[name] = TensorEntry(e.name, e.kind, e.dtype, e.shape, boxes=tuple(new_boxes))
    return out, writes, files, referenced
