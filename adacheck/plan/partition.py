"""The partitioned save exchange (``exchange: "partitioned"``): what a rank sends, receives and
plans follows its own boxes, not the size of the job.

The ring and all-gather exchanges give every rank every rank's (box, hash) list, and every rank
plans the whole job.  Here each tensor has an owner (:func:`adacheck.plan.planner.owner_of`, a stable
hash of its name) and each set of holders has one too:

1. **route** (one all-to-all): each rank sends each owner its shards of the tensors that owner
   decides (structure and hash), with the source shard of a derived tensor it also holds.  A
   structure unchanged since this job's last save goes as its digest (the steady state sends
   hashes only); a receiver that lacks it asks, and it is sent again (two more all-to-alls, only
   then: one reduction tells every rank whether anyone asked).
2. **decide**: each owner decides its tensors (:func:`adacheck.plan.planner.decide`): deduplication,
   divergence warnings, derivations, tiling, references to the previous checkpoint.  Which of
   its files are worth referencing is summed per file by the file's owner (a round of two
   all-to-alls per file found too thin, usually none).
3. **place**: each box to write goes to the owner of its holder set (a set of one: the holder
   itself).  The sets are placed by increasing size, each greedily from its members' bytes so
   far (:func:`adacheck.plan.planner.place_by_group`, which gives the same writers from a global
   view); three all-to-alls per distinct set size, none when no owner's boxes to write changed
   since the last save (the last placement is reused).
4. **assign**: each writer learns the boxes it writes, each tensor owner its boxes' files; each
   owner writes its part of the manifest's tensor table (format 6, :mod:`adacheck.format.manifest`) and
   rank 0 gathers the warnings and counts, and commits the manifest.
5. **tell the holders** (one all-to-all): each owner sends each rank that held boxes of its
   tensors where they are stored; each rank writes them in its rank file, from which a load in
   the same layout reads everything it needs of the manifest.

The outcome equals the ring's in what is stored (the same boxes deduplicated, derived and
referenced, the same warnings); the writers may differ (placed per holder set).  Each owner reads
only its tensors' entries of the checkpoint it references (of a manifest in parts saved by as
many ranks: its own part).
"""
from __future__ import annotations

import bisect
import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

from . import planner
from ..format.manifest import JOB_OBJECTS, tensor_meta, tensors_json
from ..errors import FormatError
from .exchange import Comm, agree
from .planner import Decisions, PlanCache, PreviousIndex
from ..types import Box, ShardMeta, TensorEntry, meta_of_row, meta_row


@dataclass
class PartitionCache:
    """What a job's partitioned exchange keeps between saves (per world size): the structure last
    sent to each owner and received from each rank, as (digest, rows); and the last placement,
    with the digest of what it placed (this owner's boxes to write, the copies and the nodes)."""
    sent: Dict[int, str] = field(default_factory=dict)
    received: Dict[int, Tuple[str, dict]] = field(default_factory=dict)
    placed: Optional[Tuple[str, "Placed"]] = None


class _Faults:
    """The first error of this rank's local steps between collectives: the rank goes on with the
    collectives (with nothing to add) and raises it at the end, so no rank waits for it forever
    (:func:`adacheck.plan.exchange.agree` then raises it on every rank)."""

    def __init__(self):
        self.error: Optional[BaseException] = None

    def run(self, fn, default=None):
        if self.error is None:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - raised by ``check`` after the collectives
                self.error = e
        return default

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _load(blob: bytes):
    return json.loads(bytes(blob).decode("utf-8"))


@dataclass
class Routed:
    """What this rank received as an owner: name -> [(rank, shard)] in rank order, the source
    shards of its derived tensors, and the bytes it sent and received."""
    by_name: Dict[str, List[Tuple[int, ShardMeta]]]
    sources: Dict[str, ShardMeta]
    sent_bytes: int
    received_bytes: int
    rounds: int
    digest_only: int
    senders: int


def route(comm: Comm, metas: List[ShardMeta], cache: PartitionCache) -> Routed:
    """Step 1: this rank's shards to their owners; what it owns from every rank."""
    n, faults = comm.world_size, _Faults()
    structures: Dict[int, dict] = {}

    def encode():
        blocks = [None] * n
        for owner, (mine, sources) in planner.route_rank(metas, n).items():
            st = {"metas": [meta_row(m) for m in mine], "sources": [meta_row(s) for s in sources.values()]}
            digest = hashlib.blake2b(_json(st), digest_size=16).hexdigest()
            structures[owner] = st
            blocks[owner] = _json({"digest": digest, "hashes": [m.hash for m in mine],
                                   "structure": None if cache.sent.get(owner) == digest else st})
            cache.sent[owner] = digest
        for owner in set(cache.sent) - set(structures):
            del cache.sent[owner]       # nothing for it this time: its receiver forgets us too
        return blocks

    blocks = faults.run(encode, [None] * n)
    got = comm.all_to_all_bytes(blocks)
    sent, received, rounds = sum(len(b or b"") for b in blocks), sum(len(b) for b in got), 1
    decoded = faults.run(lambda: {src: _load(b) for src, b in enumerate(got) if b}, {})
    missing = faults.run(lambda: [src for src, d in decoded.items() if d["structure"] is None
                                  and cache.received.get(src, ("",))[0] != d["digest"]], [])
    digest_only = faults.run(lambda: sum(1 for d in decoded.values() if d["structure"] is None) - len(missing), 0)
    if comm.any(bool(missing)):       # a cache lost on one side: the structures are sent again
        asked = comm.all_to_all_bytes([b"?" if src in missing else None for src in range(n)])
        again = [_json(structures.get(dst)) if a else None for dst, a in enumerate(asked)]
        resent = comm.all_to_all_bytes(again)
        for src in missing:
            decoded[src]["structure"] = faults.run(lambda: _load(resent[src]))
        sent += sum(len(b or b"") for b in again)
        received += sum(len(b) for b in resent)
        rounds += 2
    faults.check()
    by_name: Dict[str, List[Tuple[int, ShardMeta]]] = defaultdict(list)
    sources: Dict[str, ShardMeta] = {}
    for src in sorted(decoded):
        d = decoded[src]
        st = d["structure"] if d["structure"] is not None else cache.received[src][1]
        if not isinstance(st, dict) or len(st["metas"]) != len(d["hashes"]):
            raise FormatError(f"rank {src} sent {len(d['hashes'])} hashes for a structure of another length")
        cache.received[src] = (d["digest"], st)
        for row, h in zip(st["metas"], d["hashes"]):
            m = meta_of_row(row, h)
            by_name[m.name].append((src, m))
        for row in st["sources"]:
            s = meta_of_row(row, "")
            sources.setdefault(s.name, s)
    for src in set(cache.received) - set(decoded):
        del cache.received[src]       # it sent nothing this time
    return Routed(by_name, sources, sent, received, rounds, digest_only, len(decoded))


def usable_previous(comm: Comm, routed: Routed, previous: Optional[PreviousIndex],
                    file_sizes: Optional[Dict[str, int]]) -> Tuple[Optional[PreviousIndex], int]:
    """Step 2's references: the boxes of ``previous`` this owner's tensors may reference, without
    those of files too thin to keep (:func:`adacheck.plan.planner.thin_files`, summed over all owners by
    each file's owner, as the whole plan does), and the all-to-all rounds it took."""
    if previous is None:        # the same on every rank: no checkpoint to reference
        return previous, 0
    usable = planner.usable_previous(routed.by_name, previous)
    if file_sizes is None:      # likewise
        return usable, 0
    n, rounds, faults = comm.world_size, 0, _Faults()
    while True:
        def parts():
            out: List[Dict[str, int]] = [dict() for _ in range(n)]
            for ref, k in planner.file_reads(usable).items():     # with the file's size, known here
                out[planner.owner_of(ref, n)][ref] = [k, file_sizes.get(ref, 0)]
            return [_json(p) if p else None for p in out]

        got = comm.all_to_all_bytes(faults.run(parts, [None] * n))
        asked: Dict[int, List[str]] = {}

        def thin():
            read: Dict[str, int] = defaultdict(int)
            sizes: Dict[str, int] = {}
            for src, b in enumerate(got):
                if b:
                    mine = _load(b)
                    asked[src] = list(mine)
                    for ref, (k, size) in mine.items():
                        read[ref] += k
                        sizes[ref] = size
            return planner.thin_files(read, sizes)

        found = faults.run(thin, set())
        told = comm.all_to_all_bytes([_json([r for r in asked[dst] if r in found]) if dst in asked else None
                                      for dst in range(n)])
        rounds += 2
        drop = set()
        for b in told:
            if b:
                drop.update(faults.run(lambda: _load(b), ()))
        usable = planner.without_files(usable, drop)
        if not comm.any(bool(found)):
            faults.check()
            return usable, rounds


def set_owner(holders: Tuple[int, ...], n: int) -> int:
    """The rank that places the boxes held by ``holders``: the holder itself when there is one."""
    return holders[0] if len(holders) == 1 else planner.owner_of("holders:" + ",".join(map(str, holders)), n)


@dataclass
class Placed:
    """Step 3-4 on this rank: what it writes [(name, box, key)], key -> writers of the boxes of
    the tensors it owns, its bytes to write, and the all-to-all rounds it took."""
    writes: List[Tuple[str, Box, str]]
    writer_of: Dict[str, List[int]]
    nbytes: int
    rounds: int


def place(comm: Comm, decided: Decisions, copies: int, nodes: Optional[List[str]],
          cache: Optional[PartitionCache] = None) -> Placed:
    """Steps 3 and 4: the boxes ``decided`` leaves to write, placed by the owners of their holder
    sets (see the module docstring); ``nodes``: every rank's node (needed with copies > 1).  With
    ``cache``: when no owner's boxes to write changed since the last save (one reduction says so),
    the last placement is reused (the steady state of a job whose boxes and holders stay)."""
    if cache is not None:
        digest = hashlib.blake2b(_json([sorted([n_, k, list(h)] for n_, k, h in decided.items), copies, nodes]),
                                 digest_size=16).hexdigest()
        last = cache.placed
        cache.placed = None      # set again once placed: a failure leaves nothing to reuse
        if not comm.any(last is None or last[0] != digest):
            cache.placed = last
            return Placed(last[1].writes, last[1].writer_of, last[1].nbytes, 0)
        placed = place(comm, decided, copies, nodes)
        cache.placed = (digest, placed)
        return placed
    n, faults = comm.world_size, _Faults()
    sets: Dict[Tuple[int, ...], list] = defaultdict(list)       # the holder sets this rank places

    def route_items():
        where = {sb.key: (e.name, sb.box) for e in decided.tensors.values() if e.derived is None
                 for sb in e.boxes if not sb.file}
        out: List[list] = [[] for _ in range(n)]
        for nbytes, key, holders in decided.items:
            name, box = where[key]
            out[set_owner(holders, n)].append([nbytes, key, list(holders), name, list(box.offsets),
                                               list(box.lengths)])
        return [_json(o) if o else None for o in out]

    got = comm.all_to_all_bytes(faults.run(route_items, [None] * n))

    def received():
        for src, b in enumerate(got):
            for nbytes, key, holders, name, offsets, lengths in (_load(b) if b else ()):
                sets[tuple(holders)].append((nbytes, key, name, Box(tuple(offsets), tuple(lengths)), src))

    faults.run(received)
    chosen_nodes = planner.rank_nodes(n, copies, nodes)
    total, rounds, done = 0, 1, 0
    writes: List[Tuple[str, Box, str]] = []
    writer_of: Dict[str, List[int]] = {}
    while True:
        pending = sorted({len(h) for h in sets if len(h) > done})
        size = -comm.max_each([-(pending[0] if pending else n + 1)])[0]
        if size > n:
            break
        now = sorted(h for h in sets if len(h) == size)
        # the members' bytes so far (requests, then answers), then the writers chosen
        members = {m for h in now for m in h}
        asks = comm.all_to_all_bytes([b"?" if r in members else None for r in range(n)])
        answers = comm.all_to_all_bytes([_json(total) if a else None for a in asks])

        def choose():
            held = {r: _load(b) for r, b in enumerate(answers) if b}
            tell: List[list] = [[] for _ in range(n)]
            for holders in now:
                items = sets[holders]
                placed = planner.place_set([(i[0], i[1]) for i in items], holders, copies, chosen_nodes, held)
                for nbytes, key, name, box, owner in items:
                    for w in placed[key]:
                        tell[w].append(["w", name, list(box.offsets), list(box.lengths), key, nbytes])
                    tell[owner].append(["o", key, placed[key]])
            return [_json(t) if t else None for t in tell]

        told = comm.all_to_all_bytes(faults.run(choose, [None] * n))

        def learn():
            nonlocal total
            for b in told:
                for row in (_load(b) if b else ()):
                    if row[0] == "w":
                        writes.append((row[1], Box(tuple(row[2]), tuple(row[3])), row[4]))
                        total += row[5]
                    else:
                        writer_of[row[1]] = row[2]

        faults.run(learn)
        rounds += 3
        done = size
    faults.check()
    writes.sort(key=lambda w: (w[0], w[1].offsets, w[2]))
    return Placed(writes, writer_of, total, rounds)


@dataclass
class Gathered:
    """Step 4's end, on rank 0: the warnings, the plan's counts, the number of tensors, what the
    manifest's index says of each tensor but a rank's own objects (:func:`manifest.tensor_meta`),
    the references to earlier checkpoints ("<tag>/<file>") and the ranks that write a file."""
    warnings: List[str]
    stats: dict
    tensors: int
    meta: Dict[str, list]
    referenced: List[str]
    writers: List[int]


def gather(comm: Comm, tensors: Dict[str, TensorEntry], decided: Decisions, referenced: int,
           placed: Placed) -> Optional[Gathered]:
    """What rank 0 needs of every owner for the manifest (not the entries: each owner writes its
    part of the table itself); None elsewhere.  Sent to rank 0 alone in an all-to-all, each owner's
    as long as it is (a gather of objects pads every rank's to the longest, and all-gathers the
    sizes first)."""
    mine = (list(decided.warnings), decided.held, decided.logical, referenced,
            sum(e.nbytes for e in tensors.values() if e.derived is not None), placed.nbytes, bool(placed.writes),
            len(tensors), tensor_meta(tensors),
            sorted({sb.file for e in tensors.values() if e.derived is None for sb in e.boxes if "/" in sb.file}))
    got = comm.all_to_all_bytes([_json(mine) if dst == 0 else None for dst in range(comm.world_size)])
    if comm.rank != 0:
        return None
    parts = [_load(b) for b in got]
    per_rank = [p[5] for p in parts]
    stats = {"held_bytes": sum(p[1] for p in parts), "logical_bytes": sum(p[2] for p in parts),
             "stored_bytes": sum(per_rank), "derived_bytes": sum(p[4] for p in parts),
             "referenced_bytes": sum(p[3] for p in parts), "per_rank_bytes": per_rank}
    return Gathered(sorted(w for p in parts for w in p[0]), stats, sum(p[7] for p in parts),
                    dict(sorted(kv for p in parts for kv in p[8].items())), sorted({r for p in parts for r in p[9]}),
                    [r for r, p in enumerate(parts) if p[6]])


class _Meets:
    """Whether a box meets one of ``boxes``, in time that grows with the boxes near it along the
    first dimension (a rank can hold thousands of row chunks of one tensor: a check against each
    of them, for each of thousands of stored boxes, took seconds)."""

    def __init__(self, boxes: List[Box]):
        self.boxes = sorted(boxes, key=lambda b: b.offsets[:1])
        self.starts = [b.offsets[0] if b.ndim else 0 for b in self.boxes]
        self.reach, top = [], None          # the largest end along dim 0 of the boxes up to each one
        for b in self.boxes:
            end = b.offsets[0] + b.lengths[0] if b.ndim else 1
            top = end if top is None else max(top, end)
            self.reach.append(top)

    def __call__(self, box: Box) -> bool:
        if not box.ndim:
            return any(box.intersect(x) is not None for x in self.boxes)
        lo, hi = box.offsets[0], box.offsets[0] + box.lengths[0]
        i = bisect.bisect_left(self.starts, hi) - 1       # the last box that starts before this one ends
        while i >= 0 and self.reach[i] > lo:
            if self.boxes[i].intersect(box) is not None:
                return True
            i -= 1
        return False


def cut_to(e: TensorEntry, boxes: List[Box], rank: int) -> TensorEntry:
    """Entry ``e`` with only the stored (or derived) boxes that meet one of ``boxes`` (those
    ``rank`` held), each stored copy's holders cut down to ``rank`` itself where it held its bytes."""
    meets = _Meets(boxes)
    if e.derived is not None:
        return replace(e, derived=replace(e.derived, boxes=tuple((b, h) for b, h in e.derived.boxes if meets(b))))
    return replace(e, boxes=tuple(replace(sb, holders=(rank,) if rank in sb.holders else ())
                                  for sb in e.boxes if meets(sb.box)))


def tell_holders(comm: Comm, tensors: Dict[str, TensorEntry],
                 by_name: Dict[str, List[Tuple[int, ShardMeta]]]) -> dict:
    """Step 5: each rank's held entries (its rank file's tensor table, as JSON): from each owner,
    its tensors cut down to the boxes that rank sent it; and the job's objects (rank 0's, which
    every rank loads) whole to every rank."""
    n, faults = comm.world_size, _Faults()

    def encode():
        boxes: List[Dict[str, List[Box]]] = [{} for _ in range(n)]
        for name, held in by_name.items():
            for rank, shard in held:
                boxes[rank].setdefault(name, []).append(shard.box)
            if name.startswith(JOB_OBJECTS):
                for rank in range(n):
                    boxes[rank].setdefault(name, [Box.full(tensors[name].shape)])
        return [_json(tensors_json({name: cut_to(tensors[name], bs, rank) for name, bs in mine.items()}))
                if mine else None for rank, mine in enumerate(boxes)]

    got = comm.all_to_all_bytes(faults.run(encode, [None] * n))
    held = faults.run(lambda: {name: e for b in got if b for name, e in _load(b).items()}, {})
    faults.check()
    return held


def plan(comm: Comm, metas: List[ShardMeta], generation: int,
         previous_of: Callable[[List[str]], Tuple[Optional[PreviousIndex], Optional[Dict[str, int]]]],
         copies: int, nodes: Optional[List[str]], cache: PartitionCache, plan_cache: PlanCache, what: str):
    """Steps 1-5 (see the module docstring): (what this rank writes, the entries of the tensors it
    owns with their files, rank 0's Gathered or None, the exchange's stats, this rank's held
    entries as JSON).  ``previous_of(names)``:
    the boxes of the checkpoint to reference for those tensors, and its files' sizes (each owner
    reads only its tensors' entries).  ``what`` names the save in errors; a failure on any rank is
    raised on every rank."""
    routed = agree(comm, f"{what} (partitioned exchange)", lambda: route(comm, metas, cache))
    previous, file_sizes = agree(comm, f"{what} (previous checkpoint)", lambda: previous_of(sorted(routed.by_name)))
    usable, pin_rounds = usable_previous(comm, routed, previous, file_sizes)
    decided = agree(comm, f"{what} (plan)", lambda: planner.decide(
        routed.by_name, usable, copies, plan_cache, source_of=routed.sources.get))
    placed = place(comm, decided, copies, nodes, cache)
    tensors, _, _, referenced = planner.assign_files(decided.tensors, placed.writer_of, generation)
    gathered = gather(comm, tensors, decided, referenced, placed)
    held = tell_holders(comm, tensors, routed.by_name)
    stats = {"how": "partitioned", "bytes_received": routed.received_bytes, "bytes_sent": routed.sent_bytes,
             "owned_tensors": len(routed.by_name), "senders": routed.senders,
             "rounds": {"route": routed.rounds, "references": pin_rounds, "place": placed.rounds},
             "placement_reused": placed.rounds == 0,
             "ranks_sent_digest_only": routed.digest_only}
    return placed, tensors, gathered, stats, held
