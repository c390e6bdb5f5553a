"""Collective save and load of one checkpoint, independent of any framework.

An integration describes what its rank holds as a ``LocalState`` (shards of logical
tensors plus JSON-able objects); ``save`` turns the states of all ranks into one
committed checkpoint, ``load`` opens one and hands a ``CheckpointReader`` to the
integration, which asks for exactly the boxes its current layout needs.

Steps of a save (each an ``agree`` step, so a failure anywhere is raised everywhere), methods
of :class:`Checkpointer`: ``snapshot`` (collect this rank's part; an asynchronous save copies
it into reusable host buffers and returns here) -> ``prepare`` (hash) -> ``exchange`` ->
``plan`` -> ``write`` (this rank's file, committed) -> ``commit`` (the manifest, once every
file is confirmed) -> ``publish`` (``latest``, retention, garbage).  Nothing already committed
is touched before the new manifest is durable.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..storage import commit

from ..format import jsontree

from . import lifecycle, writer_process

from ..plan import partition
from ..format.boxes import copy_intersection, flat_range_to_boxes, row_chunks
from ..errors import (AdaCheckError, ConfigError, CorruptCheckpointWarning, FormatError, IntegrityError,
                     LeaseError, NotFoundError, SaveWarning, StateError)
from ..plan.exchange import Comm, agree, background_comm, exchange_for
from ..storage.lease import DEFAULT_TTL_S, Holding, Leases
from ..storage.lease import check as check_lease
from ..tiers.memory import DeltaSpread, MemoryTier, newest_committed, own_files, spares_of
from ..format.hashing import bound_digest, box_identity, hash_tensor
from ..format.compression import ENCODING_KEY, Encoder, decode
from ..format.compression import check as check_compression
from ..format.manifest import (BOUND_SINCE, COMPRESSED_SINCE, FORMAT_VERSION, MANIFEST_NAME, PAGED_SINCE, PartedTensors,
                       JOB_OBJECTS, RANK_OBJECT, dumps, meta_entry, meta_name, part_name, rank_file_name,
                       ranked_tables, split_file)
from ..plan.planner import PlanCache, WritePlan, file_name, gc_paused, plan_save, previous_index
from ..format.safetensors_file import SafetensorsFile
from ..types import Box, Manifest, ShardMeta, TensorEntry, dtype_name, meta_of_row, meta_row, torch_dtype
from .staging import Staging
from ..storage.backends import LOCAL, Storage, is_url, open_storage, storage_path, url_protocol
from ..format.writer import write_safetensors_to

log = logging.getLogger("adacheck")


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


def _bytes_of(t) -> torch.Tensor:
    return t.materialize() if isinstance(t, Deferred) else t


@dataclass
class LocalShard:
    """A box of a logical tensor held by this rank; ``tensor`` has shape ``box.lengths`` (a
    torch tensor, or a Deferred one that is read when hashed and again when written)."""

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
    shards: List[LocalShard]
    objects: dict = field(default_factory=dict)       # global state; rank 0's copy is saved
    rank_objects: dict = field(default_factory=dict)  # this rank's own state (e.g. RNG)
    layout: dict = field(default_factory=dict)        # this rank's framework layout
    framework: dict = field(default_factory=dict)
    step: Optional[int] = None


class LegacyFormatWarning(UserWarning):
    """A checkpoint of an older format was opened: it loads, with less protection."""


def _meta(s: LocalShard) -> ShardMeta:
    if tuple(s.tensor.shape) != tuple(s.box.lengths):
        raise FormatError(f"{s.name}: tensor of shape {tuple(s.tensor.shape)} given for box {s.box}")
    dtype = dtype_name(s.tensor.dtype)
    digest = bound_digest(box_identity(s.name, dtype, s.shape, s.box.offsets, s.box.lengths), _bytes_of(s.tensor))
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


def _object_shards(tree, prefix: str, replicated: bool):
    enc, tensors = jsontree.encode(tree, prefix)
    shards = []
    for name, t in tensors:
        t = t.detach()
        shards.append(LocalShard(name, "object", tuple(t.shape), Box.full(t.shape), t,
                                 replicated=replicated))
    return enc, shards


def ranges(ranks: List[int]) -> List[List[int]]:
    """Sorted ranks as [first, end) ranges: [0, 1, 2, 5] -> [[0, 3], [5, 6]]."""
    out: List[List[int]] = []
    for r in ranks:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def host_tensors(shards: Dict[Tuple[str, Box], LocalShard], writes) -> Dict[str, object]:
    """The boxes this rank writes (key -> contiguous CPU tensor, or a Deferred one).

    Device tensors are copied to the host; contiguous CPU tensors are written in place: a
    synchronous save holds training until it is written, an asynchronous one wrote host copies
    (:class:`~adacheck.checkpoint.staging.Staging`).  Deferred tensors are read when the writer reaches them.
    """
    staged = {}
    for name, box, key in writes:
        t = shards[(name, box)].tensor
        staged[key] = t if isinstance(t, Deferred) else t.detach().to("cpu").contiguous()
    return staged


def persist(ckpt_dir: str, fname: str, staged: Dict[str, object], metadata: dict,
            fsync: bool = True, store: Storage = LOCAL) -> Tuple[int, Optional[str]]:
    """Write one shard file and commit it (durable under its final name, or nothing left).
    Returns its size and the storage's tag of its content as the storage shows it once
    committed (:meth:`Storage.file_state`), for the commit to confirm."""
    path = store.join(ckpt_dir, fname)
    fw = store.open_writer(path, fsync=fsync)
    try:
        write_safetensors_to(fw, [(k, t.dtype, tuple(t.shape)) for k, t in staged.items()],
                             lambda k: _bytes_of(staged[k]), metadata)
        size = fw.commit()
        state = store.file_state(path)
        if state is None or state[0] != size:
            raise IntegrityError(f"{path}: {size} bytes were written and committed, but the storage then shows "
                                 + ("no such file" if state is None else f"{state[0]} bytes")
                                 + f" ({store.describe()}); the checkpoint is not published")
        return state
    except BaseException:
        fw.abort()      # (after the commit it leaves the file to the save's cleanup)
        raise


_STATIC = ("layout", "framework", "node")   # parts of a rank's save payload that stay the same


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")


def structure_of(payload: dict) -> Tuple[dict, str]:
    """A rank's save payload without its hashes (what does not change from one save to the next
    while the layout stays), and its digest."""
    structure = {"metas": [meta_row(m) for m in payload["metas"]],
                 **{k: payload[k] for k in _STATIC}}
    return structure, hashlib.blake2b(_json(structure), digest_size=16).hexdigest()


def exchange_blob(payload: dict, digest: str, structure: Optional[dict]) -> bytes:
    """The bytes a rank sends in the exchange: its hashes and the rest of its payload, with its
    structure, or (None) only the structure's digest."""
    d = {k: v for k, v in payload.items() if k != "metas" and k not in _STATIC}
    d.update(digest=digest, hashes=[m.hash for m in payload["metas"]], structure=structure)
    return _json(d)


def _exchange(comm: Comm, payload: dict, how: str, sent: Dict[int, Dict[int, Tuple[str, list]]]):
    """Every rank's payload on every rank (compact JSON, never pickle), and the bytes received.
    ``sent``: what every rank of a world of N sent last time (N -> {rank: (digest, structure)}).

    A rank's shard list is split into its *structure* (names, kinds, dtypes, shapes, boxes,
    declarations; with its layout, framework and node, which do not change either) and its
    hashes.  Where every rank holds the same cache of the structures sent last time (checked
    with one small all-gather of digests), a rank whose structure did not change sends its
    digest instead of the structure."""
    structure, digest = structure_of(payload)
    cache = sent.setdefault(comm.world_size, {})
    view = hashlib.blake2b(_json([cache.get(r, ("",))[0] for r in range(comm.world_size)]),
                           digest_size=16).hexdigest() if len(cache) == comm.world_size else None
    views = comm.all_gather_object((digest, view))
    shared = views[0][1] is not None and all(v[1] == views[0][1] for v in views)
    compact = [shared and cache[r][0] == views[r][0] for r in range(comm.world_size)]
    blobs = comm.all_gather_bytes(exchange_blob(payload, digest, None if compact[comm.rank] else structure), how)
    gathered = []
    for r, blob in enumerate(blobs):
        g = json.loads(blob.decode("utf-8"))
        st = g.pop("structure")
        st = cache[r][1] if st is None else st
        if len(st["metas"]) != len(g["hashes"]):
            raise FormatError(f"rank {r} sent {len(g['hashes'])} hashes for {len(st['metas'])} shards")
        cache[r] = (g["digest"], st)
        g.update({k: st[k] for k in _STATIC})
        g["metas"] = [meta_of_row(m, h) for m, h in zip(st["metas"], g.pop("hashes"))]
        gathered.append(g)
    return gathered, comm.bytes_received([len(b) for b in blobs], how), sum(compact)


def node_id() -> str:
    """Which machine this rank runs on, for placing copies: $ADACHECK_NODE if set (e.g. when
    containers share a hostname), else the host name."""
    return os.environ.get("ADACHECK_NODE") or socket.gethostname()


@dataclass
class Caches:
    """What a job keeps from one checkpoint to the next, in this process:

    - ``exchanged``: the structures every rank sent last time (a rank whose boxes did not change
      then sends a digest and its hashes: see ``_exchange``); ``partitioned``: the same for the
      partitioned exchange (:mod:`adacheck.plan.partition`), per owner;
    - ``plan``: the planner's (the last placement, the structures proven to tile);
    - ``trusted``: per save directory, the checkpoint this job last loaded (every box verified by
      some rank) or committed there.  A new save references boxes of that one only: not of
      whatever 'latest' names, which may be damaged (a reference records the hash of the new
      bytes, not of the bytes on disk) or written by another job since;
    - ``nodes``: every rank's node, per world size (the partitioned exchange's copies)."""
    exchanged: Dict[int, Dict[int, Tuple[str, list]]] = field(default_factory=dict)
    partitioned: Dict[int, partition.PartitionCache] = field(default_factory=dict)   # world size -> its cache
    plan: PlanCache = field(default_factory=PlanCache)
    trusted: Dict[str, str] = field(default_factory=dict)
    nodes: Dict[int, List[str]] = field(default_factory=dict)


# The caches of the module-level save() and load(): one job per process unless an integration
# keeps a Checkpointer (with caches of its own) per job.
DEFAULT_CACHES = Caches()


class _Process:
    """What the process's own Checkpointer is kept on (:meth:`Checkpointer.kept_on` without an owner)."""


_PROCESS = _Process()


@dataclass(frozen=True)
class Options:
    """How a job saves and loads (AdaCheckConfig's keys, see adacheck.config): ``keep_last``
    newest checkpoints (None: all), ``fsync``, ``reference_previous`` unchanged boxes, ``copies``
    of each distinct box (on distinct nodes), the ``exchange`` ("auto", "ring", "allgather" or
    "partitioned": :func:`adacheck.plan.exchange.exchange_for`), boxes
    larger than ``chunk_bytes`` stored as row chunks, ``verify`` hashes on load, ``on_corrupt``
    ("raise" or "fallback"), ``storage_options`` for the fsspec filesystem of a URL (see
    :meth:`Checkpointer.locate`), ``on_error``: an asynchronous save that fails in the background
    is a warning ("warn") or raises at the next poll, save, load or exit ("raise"); ``compression``
    None or "zstd" (:mod:`adacheck.format.compression`); ``writer``: where an asynchronous save's persist
    runs, a "thread" of the training process or a "process" of its own
    (:mod:`adacheck.checkpoint.writer_process`)."""
    keep_last: Optional[int] = None
    fsync: bool = True
    reference_previous: bool = True
    copies: int = 1
    exchange: str = "auto"
    chunk_bytes: int = 64 << 20
    verify: bool = True
    on_corrupt: str = "raise"
    storage_options: Optional[dict] = None
    on_error: str = "warn"
    compression: Optional[str] = None
    writer: str = "process"
    tiers: Optional[object] = None      # adacheck.config.TiersConfig with memory on (adacheck.tiers), or None
    derive: bool = True                 # store a tensor that is a cast of another as that derivation
    spread: Optional[object] = None     # a memory-tier save across nodes (adacheck.tiers.NodeSpread), or None
    lease_ttl_s: float = DEFAULT_TTL_S  # the save directory's lease expires this long after its last renewal
    takeover: bool = False              # take the save directory's lease from the job that holds it

    @classmethod
    def from_config(cls, config) -> "Options":
        return cls(keep_last=config.keep_last or None, fsync=config.fsync,
                   reference_previous=config.reference_previous, copies=config.redundancy_factor,
                   exchange=config.exchange, chunk_bytes=config.hash_chunk_bytes, verify=config.verify_on_load,
                   on_corrupt=config.on_corrupt, storage_options=dict(config.storage_options) or None,
                   on_error=config.on_error, compression=config.compression, writer=config.async_writer,
                   tiers=config.tiers if config.tiers.memory else None, lease_ttl_s=float(config.lease_ttl_s),
                   takeover=config.takeover)


@dataclass
class Snapshot:
    """Step 0 of a save, on this rank: what the integration's ``collect()`` returned, chunked, its
    objects encoded.  An asynchronous save's tensors are host copies taken at the call; ``ready``
    waits until their device-to-host copies have landed (None: nothing to wait for)."""
    save_dir: str
    tag: str
    ckpt_dir: str
    store: Storage
    shards: Dict[Tuple[str, Box], LocalShard]
    objects: Optional[dict]
    rank_objects: dict
    layout: dict
    framework: dict
    step: Optional[int]
    started: float
    ready: Optional[Callable[[], None]] = None
    given_dir: str = ""     # save_dir as the caller named it (a URL for remote storage)
    min_generation: int = 0     # the save's file generation is at least this (the memory tier: past the
    # generations of the same tag in the checkpoint directory, where its files are copied)
    lease: Optional[Holding] = None     # the save directory's lease this job holds (rank 0; adacheck.storage.lease)


UNKNOWN = object()


def shown_dir(snap: Snapshot) -> str:
    """The checkpoint's directory as the caller would name it (a URL for remote storage)."""
    return f"{snap.given_dir.rstrip('/')}/{snap.tag}" if snap.given_dir else snap.ckpt_dir


class PendingSave:
    """An asynchronous save whose persist runs in the background (:meth:`Checkpointer.save_async`)."""

    def __init__(self, snap: Snapshot, update_latest: bool):
        self.tag, self.ckpt_dir, self.save_dir, self.store = snap.tag, snap.ckpt_dir, snap.save_dir, snap.store
        self.update_latest = update_latest
        self.manifest: Optional[Manifest] = None
        self.error: Optional[BaseException] = None
        self.started = time.perf_counter()
        self.finished: Optional[float] = None
        self.thread: Optional[threading.Thread] = None
        self.trusted: Optional[Dict[str, str]] = None
        self.manifest_before = None     # (what identified a manifest already there, or UNKNOWN)
        self.rank = 0                   # this rank's number in the save's group
        self.stall = 0.0                # seconds the save call held the caller
        self.shown_dir = self.ckpt_dir  # the checkpoint's directory as the caller names it

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def manifest_stamp(self) -> Optional[tuple]:
        """What tells the manifest at ``ckpt_dir`` from another written in its place: its
        modification time, size and content tag (S3's times are whole seconds, its ETag a hash
        of the bytes); None when there is none."""
        path = self.store.join(self.ckpt_dir, MANIFEST_NAME)
        state = self.store.file_state(path)
        return None if state is None else (self.store.mtime(path), *state)

    def committed_all_the_same(self) -> Optional[Manifest]:
        """After a failure: the manifest this save committed before it failed (in publishing
        ``latest`` or retention, or its writer process died before it replied), else None."""
        if self.manifest_before is UNKNOWN:
            return None
        try:
            now = self.manifest_stamp()
            if now is None or now == self.manifest_before:
                return None
            return commit.read_manifest(self.ckpt_dir, self.store)
        except (AdaCheckError, OSError):
            return None


@dataclass
class Prepared:
    """Step 1 of a save, on this rank: what it holds, chunked and hashed (``shards``), and what it
    sends the others (``payload``: its (box, hash) list, objects, layout, node; rank 0 adds the
    generation and the checkpoint new boxes may reference)."""
    save_dir: str
    tag: str
    ckpt_dir: str
    shards: Dict[Tuple[str, Box], LocalShard]
    payload: dict
    started: float
    store: Storage = LOCAL     # where save_dir lives (Checkpointer.locate)
    lease: Optional[Holding] = None     # (Snapshot.lease): checked before the manifest and 'latest'


@dataclass
class Exchanged:
    """Step 2: every rank's payload on every rank, and what the exchange cost.  With the
    partitioned exchange (:mod:`adacheck.plan.partition`) the (box, hash) lists go to their owners in
    the plan step instead, and no rank gathers the others' payloads: ``gathered`` holds this
    rank's, without ``metas`` (with rank 0's step and framework; rank 0's objects are the job's),
    and each rank keeps its own objects and layout in its rank file; ``nodes``: every rank's node
    where the plan needs it (copies > 1)."""
    gathered: List[dict]
    generation: int
    previous: Optional[str]
    stats: dict
    partitioned: bool = False
    nodes: Optional[List[str]] = None
    index: Optional[dict] = None        # partitioned, on rank 0: the manifest's index (its parts' hashes at the commit)


@dataclass
class Written:
    """Step 4: the size of every rank's file (0: it wrote none) and the storage's tag of its content
    (None: none), both per rank (partitioned: empty; ``total``: the sum of the sizes), and this
    rank's file name, size and tag."""
    sizes: List[int]
    tags: List[Optional[str]]
    my_file: Optional[str]
    my_size: int = 0
    my_tag: Optional[str] = None
    total: int = 0


def human(n: float) -> str:
    """A byte count as people read it (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def save_report(manifest: Manifest, ckpt_dir: str, stall: float, seconds: float, asynchronous: bool) -> dict:
    """What one committed save cost, as ``Checkpointer.last_save`` and the log line give it:
    ``stored_bytes`` written by this save (boxes unchanged since the checkpoint it references
    are not), ``logical_bytes`` of the state it holds, ``held_bytes`` over all ranks' copies,
    ``stall_s`` the caller waited, ``commit_s`` from the save call to its commit."""
    st = manifest.stats
    return {"tag": manifest.tag, "step": manifest.step, "dir": ckpt_dir, "async": asynchronous,
            "stored_bytes": int(st.get("file_bytes", 0)), "logical_bytes": int(st.get("logical_bytes", 0)),
            "held_bytes": int(st.get("held_bytes", 0)), "stall_s": round(stall, 4), "commit_s": round(seconds, 4)}


def describe_save(r: dict) -> str:
    """``save_report`` as one log line."""
    return (f"AdaCheck: saved {r['tag']} (step {r['step']}) to {r['dir']}: {human(r['stored_bytes'])} "
            f"written for {human(r['logical_bytes'])} of state ({human(r['held_bytes'])} held by all "
            f"ranks), training stalled {r['stall_s']:.2f}s, committed "
            f"{'in the background ' if r['async'] else ''}{r['commit_s']:.2f}s after the save call")


class Checkpointer:
    """The checkpoints of one job: where they live (``store``), how they are saved and loaded
    (``options``), and what the job keeps between them (``caches``).

    A save is six collective steps, each a method with a typed result: :meth:`prepare` (collect
    and hash this rank's part), :meth:`exchange` (every rank's (box, hash) list to every rank),
    :meth:`plan` (pure: who writes what, what is referenced or derived), :meth:`write` (this
    rank's file, committed), :meth:`commit` (the manifest, last, by rank 0) and :meth:`publish`
    (``latest``, retention, garbage).  Each runs under ``agree``: a failure on any rank is raised
    on every rank, and the new files are removed."""

    def __init__(self, store: Storage = LOCAL, options: Optional[Options] = None, caches: Optional[Caches] = None):
        self.store = store
        self.options = options if options is not None else Options()
        self.caches = caches if caches is not None else Caches()
        self._stores: Dict[str, Storage] = {}
        self.staging = Staging()             # the async saves' host copies, reused
        self.pending: Optional[PendingSave] = None
        self.last_committed: Optional[Manifest] = None   # of the last save that committed (reported)
        self._background: Optional[Comm] = None
        self.writer: Optional["writer_process.WriterProcess"] = None
        self._no_writer: Optional[str] = None    # why this job cannot have writer processes
        self.tiered: Optional[MemoryTier] = None   # the memory tier (options.tiers), made at its first use
        self.last_load: Optional[Tuple[Storage, str]] = None   # (storage, directory) the last load read from
        self.last_tier: Optional[str] = None      # and, with tiers, which one: "memory" or "durable"
        self.last_read: Optional[Dict[str, int]] = None   # manifest parts, rank files and data the last load read
        self.last_save: Optional[dict] = None    # save_report of the last save that committed (reported)
        self.on_saved: Optional[Callable[[dict], None]] = None   # called with it on every rank
        self.explains = True     # a README in the directories it saves to (not in the memory tier's)
        self.leases = Leases()   # the save directories' leases this job holds (rank 0)
        self.takes_leases = True     # (not the memory tier's own: its directories are the job's)

    def has_checkpoint(self, load_dir: str, comm: Optional[Comm] = None) -> bool:
        """Whether a load of ``load_dir`` without a tag finds something: a ``latest`` or a complete
        checkpoint there, or (with the memory tier) one of this job's in memory, on any node (with
        the memory tier and ``comm``: collective, the same answer on every rank)."""
        store, where = self.locate(load_dir)
        if commit.has_checkpoint(where, store):
            found = True
        elif self.options.tiers is None:
            return False
        else:
            found = newest_committed(self.memory_tier().location(store, where), LOCAL) is not None
        if self.options.tiers is None or comm is None:
            return found
        return comm.any(found)

    def _save_tiered(self, comm: Comm, save_dir: str, tag: str, collect, update_latest: bool, asynchronous: bool,
                     persist: Optional[bool] = None, recorder=None):
        lifecycle.keep(self, strong=True)    # (at exit: the newest memory checkpoint persisted, also when
        # the caller let this job go: the memory tier's promise)
        store, path = self.locate(save_dir)
        if recorder is not None:
            recorder.flush()
        manifest = self.memory_tier().save(comm, store, path, tag, collect, update_latest, asynchronous=asynchronous,
                                           persist=persist, online=recorder is not None)
        if recorder is not None:
            _start_chain(recorder, *self.chain_location(save_dir), manifest)
        return manifest

    def chain_location(self, save_dir: str) -> Tuple[Storage, str]:
        """Where online deltas of the bases saved to ``save_dir`` go: with the memory tier, its
        copies in memory (each chain in its base's directory there), else ``save_dir`` itself."""
        store, path = self.locate(save_dir)
        if self.options.tiers is not None:
            return LOCAL, self.memory_tier().location(store, path)
        return store, path

    def recording(self, comm: Comm, save_dir: str) -> "Recording":
        """Where and how an online recorder of the bases saved to ``save_dir`` records (see
        :class:`Recording`).  Collective with the memory tier: every rank calls it where it makes
        its recorder."""
        store, where = self.chain_location(save_dir)
        if self.options.tiers is None:
            return Recording(store, where)
        nodes = comm.all_gather_object(node_id())
        spread = DeltaSpread(comm, nodes, self.options.tiers.peer) if len(set(nodes)) > 1 else None
        return Recording(store, where, spread, bridge=True, spares=spares_of(where))

    def memory_tier(self) -> MemoryTier:
        """This job's memory tier (:mod:`adacheck.tiers`): its copies are checkpoints of their own
        (no fsync, no references between them), written by a Checkpointer with its own caches."""
        if self.tiered is None:
            o = self.options
            memory = Checkpointer(LOCAL, Options(keep_last=None, fsync=False, reference_previous=False, copies=1,
                                                 exchange=o.exchange, chunk_bytes=o.chunk_bytes, verify=o.verify,
                                                 on_corrupt=o.on_corrupt, on_error=o.on_error, writer=o.writer))
            memory.on_saved, memory.explains, memory.takes_leases = self._saved_to_memory, False, False
            self.tiered = MemoryTier(o.tiers, memory, confirm_files, node_id, fsync=o.fsync, keep_last=o.keep_last,
                                     on_error=o.on_error)
            self.tiered.fence = self.fence_durable
        return self.tiered

    def _saved_to_memory(self, report: dict) -> None:
        """A save into the memory tier committed (its checkpointer logged it): this job's last save."""
        self.last_save = report
        if self.on_saved is not None:
            self.on_saved(report)

    def where(self, path: str) -> Tuple[Storage, str]:
        """:meth:`locate` for a URL; a plain path is on this checkpointer's ``store`` whatever the options."""
        return self.locate(path) if is_url(str(path)) else (self.store, str(path))

    def locate(self, path: str) -> Tuple[Storage, str]:
        """The storage ``path`` lives on and the path as it names it: a URL (``s3://bucket/prefix``,
        ``file:///dir``, any fsspec protocol) opens that filesystem with ``options.storage_options``
        (once per protocol); a plain path is on this checkpointer's ``store``."""
        path = str(path)
        if not is_url(path):
            if self.options.storage_options:
                raise ConfigError(f"storage_options were given, but the checkpoint path {path!r} is local; they "
                                  "apply to fsspec URLs (s3://bucket/prefix, ...) only: pass the URL or remove them")
            return self.store, path
        protocol = url_protocol(path)
        if protocol not in self._stores:     # (one storage per protocol: its read blocks are kept)
            self._stores[protocol] = open_storage(path, self.options.storage_options or None)[0]
        return self._stores[protocol], storage_path(path)

    def check_writable(self, comm: Comm, save_dir: str) -> None:
        """Collectively, at start-up: every rank creates ``save_dir``, writes a small file into it
        through its storage and removes it again, so that a directory the job cannot write is
        found before training, not at the first save.  A ConfigError on every rank names each
        rank that could not, and why; nothing else in ``save_dir`` is touched."""
        store, path = self.locate(save_dir)
        probe = store.join(path, f".adacheck-probe-{node_id()}-{os.getpid()}")

        def run():
            try:
                store.make_dirs(path)
                store.write_atomic(probe, b"AdaCheck checks that this directory is writable\n", fsync=False)
                store.remove(probe)
            except Exception as e:  # noqa: BLE001 - whatever the backend raises says why
                raise ConfigError(f"the checkpoint directory {save_dir} is not writable from {node_id()}: "
                                  f"{type(e).__name__}: {e}. Give adacheck.save_dir a directory this job "
                                  "can create and write (or fix its permissions / credentials)") from e
        agree(comm, f"the write check of {save_dir}", run)

    # ------------------------------------------------------------------ references
    def previous(self, save_dir: str, tag: str, store: Storage) -> Optional[str]:
        """The committed checkpoint a new save may reference (see Caches.trusted), or None."""
        prev = self.caches.trusted.get(store.canonical(save_dir))
        if prev is None or prev == tag or not commit.has_manifest(store.join(save_dir, prev), store):
            return None
        return prev

    def trust(self, ckpt_dir: str, store: Storage) -> None:
        """``ckpt_dir`` was just committed or loaded (verified) by this job."""
        self.caches.trusted[store.canonical(store.parent(ckpt_dir))] = store.basename(ckpt_dir)

    # ------------------------------------------------------------------ save
    def hold(self, comm: Comm, save_dir: str) -> Optional[Holding]:
        """Collectively, at every save: rank 0 takes or renews this job's lease of ``save_dir``
        (:mod:`adacheck.storage.lease`; returned there, None on the other ranks).  Another job's live lease
        (without ``takeover``), or this job's lease taken over by another job, is a LeaseError on
        every rank, before anything is written.  With the memory tier, a directory that cannot be
        reached does not stop the save (a warning; the lease is taken at a later save)."""
        if not self.takes_leases:
            return None
        store, path = self.locate(save_dir)
        lifecycle.keep(self.leases)     # (removed at exit; a job dropped before: its leases expire)

        def run():
            if comm.rank != 0:
                return None
            try:
                return self.leases.take(store, path, self.options.lease_ttl_s, self.options.takeover)
            except LeaseError:
                raise
            except Exception as e:  # noqa: BLE001 - the storage's own error says why
                if self.options.tiers is None:
                    raise
                # (the memory tier saves whatever the checkpoint directory does; its copies there say so)
                log.warning("AdaCheck: the lease of %s could not be taken (%s: %s); the save goes to the memory "
                            "tier, and its copy to %s is not fenced until a later save takes the lease",
                            save_dir, type(e).__name__, e, save_dir)
                return None
        return agree(comm, f"AdaCheck save into {save_dir} (its lease)", run)

    def fence_durable(self, store: Storage, save_dir: str, doing: str) -> None:
        """The memory tier's copy into ``save_dir`` (rank 0): the lease this job holds there is still
        its own (:meth:`fence`)."""
        key = store.canonical(save_dir)
        if key in self.leases.lost:
            raise LeaseError(self.leases.lost[key])
        held = self.leases.held.get(key)
        self.fence(held[1] if held is not None else None, store, doing)

    def fence(self, holding: Optional[Holding], store: Storage, doing: str) -> None:
        """Before a manifest or ``latest`` is written (rank 0): the lease is still ``holding``'s."""
        if holding is not None:
            try:
                check_lease(store, holding, doing)
            except LeaseError as e:
                self.leases.lose(store.canonical(holding.save_dir), str(e))
                raise

    def save(self, comm: Comm, save_dir: str, tag: str, collect: Callable[[], LocalState],
             update_latest: bool = True, recorder=None, persist: Optional[bool] = None,
             min_generation: int = 0) -> Manifest:
        """Collectively write checkpoint ``tag`` under ``save_dir``; returns its manifest (its
        ``stats`` also hold, in memory only, the exchange's cost and each step's seconds).
        ``recorder``: the job's :class:`~adacheck.online.OnlineRecorder`, if it records: its
        chain is made complete up to this step first, and a checkpoint committed into its
        directory is the base the deltas of the next steps belong to.  ``persist`` (with the
        memory tier): copy this one to ``save_dir`` now (True), never (False: a non-persistent
        checkpoint), or every ``persist_interval``-th (None).  ``min_generation``: the lowest
        generation its files may have (rank 0's counts)."""
        lifecycle.register()
        started = time.perf_counter()
        holding = self.hold(comm, save_dir)
        if self.options.tiers is not None:      # (the memory tier's checkpointer reports it)
            manifest = self._save_tiered(comm, save_dir, tag, collect, update_latest, asynchronous=False,
                                         persist=persist, recorder=recorder)
        else:
            _refuse_non_persistent(persist)
            self.finish()
            if recorder is not None:
                recorder.flush()
            snap = replace(self.snapshot(comm, save_dir, tag, collect), min_generation=min_generation, lease=holding)
            manifest = self.persist(comm, snap, update_latest)
            if recorder is not None:
                _start_chain(recorder, snap.store, snap.save_dir, manifest)
            seconds = time.perf_counter() - started
            self._saved(comm.rank, save_report(manifest, shown_dir(snap), seconds, seconds, False))
        if manifest is not None:
            self.last_committed = manifest
        return manifest

    def save_async(self, comm: Comm, save_dir: str, tag: str, collect: Callable[[], LocalState],
                   update_latest: bool = True, persist: Optional[bool] = None,
                   min_generation: int = 0) -> PendingSave:
        """Collectively snapshot this rank's state into reusable host buffers and return: hashing,
        the exchange, planning, writing and the commit (manifest, then ``latest``) run in the
        background, on a gloo group of their own: in a thread of this process, or in this rank's
        writer process (``options.writer``).  At most one save is in flight: this waits for the
        previous one first (and says so).  :meth:`poll` reports a finished one, :meth:`finish`
        waits for it; both raise or warn about a failure (``options.on_error``)."""
        holding = self.hold(comm, save_dir)
        if self.options.tiers is not None:      # (the memory save is asynchronous; durable copies run behind)
            return self._save_tiered(comm, save_dir, tag, collect, update_latest, asynchronous=True, persist=persist)
        _refuse_non_persistent(persist)
        called = time.perf_counter()
        lifecycle.keep(self)       # finished at exit, before the interpreter tears down
        self.finish(waiting_for=tag)
        if self.options.writer == "process" and self._no_writer is None:
            self.writer, self._no_writer = writer_process.start(comm, self.writer)
            if self._no_writer is not None:
                log.warning("AdaCheck: asynchronous saves persist in a thread: %s", self._no_writer)
        in_process = self.options.writer == "process" and self.writer is not None
        if in_process and not self.staging.shared:
            self.staging.release()
            self.staging = Staging(shared=True)
        if not in_process and self._background is None:
            self._background = background_comm(comm)
        snap = replace(self.snapshot(comm, save_dir, tag, collect, staging=self.staging), min_generation=min_generation,
                       lease=holding)
        pending = PendingSave(snap, update_latest)
        pending.rank, pending.shown_dir = comm.rank, shown_dir(snap)
        background, writer, staging, options = self._background, self.writer, self.staging, self.options
        trusted = dict(self.caches.trusted)

        def run():
            try:
                pending.manifest_before = pending.manifest_stamp()
            except Exception:  # noqa: BLE001 - then a failure is not told apart from a commit (said as before)
                pending.manifest_before = UNKNOWN
            try:
                if not in_process:
                    pending.manifest = self.persist(background, snap, update_latest)
                    return
                if snap.ready is not None:
                    snap.ready()        # the device-to-host copies have landed
                pending.manifest, pending.trusted = writer.persist(snap, staging, update_latest, options, trusted)
            except BaseException as e:  # noqa: BLE001 - reported by poll / finish on the caller's thread
                pending.error = e
            finally:
                pending.finished = time.perf_counter()

        pending.thread = threading.Thread(target=run, name=f"adacheck-persist-{tag}", daemon=True)
        self.pending = pending
        pending.thread.start()
        pending.stall = time.perf_counter() - called
        return pending

    def poll(self) -> Optional[Manifest]:
        """Cheap, at every training step: report the in-flight save if it has finished (its
        manifest; None while it runs or when none is in flight)."""
        if self.tiered is not None and self.tiered.memory.pending is not None and self.tiered.memory.pending.done():
            self.tiered.memory.finish()       # (an asynchronous memory save that ended: reported now)
        if self.pending is None or not self.pending.done():
            return None
        return self.finish()

    def finish(self, waiting_for: Optional[str] = None) -> Optional[Manifest]:
        """Wait for the in-flight asynchronous save and report it: its manifest, or (it failed)
        a warning and None, or the error with ``on_error="raise"``.  ``waiting_for``: the tag
        of a new save that has to wait (logged with how long)."""
        if self.tiered is not None:
            self.tiered.finish()
        pending = self.pending
        if pending is None:
            return None
        t0 = time.perf_counter()
        pending.thread.join()
        self.pending = None
        waited = time.perf_counter() - t0
        if waiting_for is not None and waited > 0.001:
            log.warning("AdaCheck: the save of %s waited %.2fs for the previous asynchronous save (%s) to "
                        "commit; saving less often avoids the wait", waiting_for, waited, pending.tag)
        if pending.error is not None:
            return self._failed(pending)
        seconds = pending.finished - pending.started
        pending.manifest.stats["seconds"]["background"] = seconds
        self._saved(pending.rank, save_report(pending.manifest, pending.shown_dir, pending.stall,
                                              seconds + pending.stall, True))
        if pending.trusted is not None:      # (the writer process's references, now this job's)
            self.caches.trusted.update(pending.trusted)
        self.last_committed = pending.manifest
        return pending.manifest

    def _saved(self, rank: int, report: dict) -> None:
        """A save committed: kept as ``last_save``, logged by rank 0, given to ``on_saved``."""
        self.last_save = report
        if rank == 0:
            log.info(describe_save(report))
        if self.on_saved is not None:
            self.on_saved(report)

    def _failed(self, pending: PendingSave) -> Optional[Manifest]:
        """An asynchronous save that failed: said as it is on storage.  Failed before its commit:
        the previous checkpoint is the newest.  After it (its manifest is there): it counts as
        committed when ``latest`` names it too, else it loads by its tag only.  A save refused because
        another job took the directory over committed nothing (a manifest there now is the other
        job's, perhaps of the same tag)."""
        error = pending.error
        manifest = None if isinstance(error, LeaseError) else pending.committed_all_the_same()
        if manifest is None:
            if self.options.on_error == "raise":
                raise error
            warnings.warn(f"AdaCheck: the asynchronous save of {pending.ckpt_dir} failed; training goes on "
                          f"from the previous checkpoint (on_error: warn):\n{error}", SaveWarning, stacklevel=4)
            return None
        latest = commit.latest_or_none(pending.save_dir, pending.store) if pending.update_latest else pending.tag
        said = (f"AdaCheck: checkpoint {pending.tag!r} was committed (its manifest is in {pending.ckpt_dir}), but "
                f"its asynchronous save failed after the commit:\n{error}\n")
        if latest == pending.tag:
            warnings.warn(said + ("'latest' names it" if pending.update_latest else "it was saved without updating "
                                  "'latest'") + ", and it loads as any committed checkpoint; training goes on",
                          SaveWarning, stacklevel=4)
            self.last_committed = manifest
            return manifest
        said += (f"'latest' names {repr(latest) if latest else 'no intact checkpoint'}, not this one: load "
                 f"{pending.tag!r} by its tag, or write {pending.tag} into "
                 f"{pending.store.join(pending.save_dir, commit.LATEST)}")
        if self.options.on_error == "raise":
            error.args = (said,)
            raise error
        warnings.warn(said + " (on_error: warn; training goes on)", SaveWarning, stacklevel=4)
        return None

    KEPT = "adacheck_checkpointer"      # the attribute of the object a job's Checkpointer is kept on

    @classmethod
    def kept_on(cls, owner, options: Options) -> "Checkpointer":
        """The Checkpointer kept on ``owner`` (an object that lives as long as the job), made the first
        time and given ``options`` after; without an owner, the process's own (its caches
        DEFAULT_CACHES): one job, so that a memory tier's saves count towards one persist_interval
        and its newest is the one persisted at exit."""
        owner = owner if owner is not None else _PROCESS
        job = cls.kept(owner)
        if job is None:
            job = cls(options=options, caches=DEFAULT_CACHES if owner is _PROCESS else None)
            setattr(owner, cls.KEPT, job)
        job.configure(options)
        return job

    @classmethod
    def kept(cls, owner) -> "Optional[Checkpointer]":
        """The Checkpointer :meth:`kept_on` keeps on ``owner`` (None: none yet)."""
        return getattr(owner, cls.KEPT, None)

    def configure(self, options: Options) -> None:
        """Other options from the next save or load on (the one in flight finishes first)."""
        if options != self.options:
            self.finish()
            if self.tiered is not None and options.tiers != self.options.tiers:
                self.tiered.close()         # (its newest checkpoint persisted, its memory freed)
                self.tiered = None
            self.options, self._stores = options, {}

    def close(self) -> None:
        """At exit (lifecycle): the in-flight save commits; a failure is logged; the writer
        process stops."""
        try:
            self.finish()
        except Exception as e:  # noqa: BLE001 - the interpreter is exiting
            log.warning("AdaCheck: the asynchronous save did not commit: %s", e)
        if self.tiered is not None:
            self.tiered.close()
        if self.writer is not None:
            self.writer.stop()
            self.writer = None

    def persist(self, comm: Comm, snap: Snapshot, update_latest: bool = True) -> Manifest:
        """Steps 1-6 of a save from its snapshot: hash, exchange, plan, write, commit, publish."""
        try:
            prepared = self.prepare(comm, snap)
            t_hashed = time.perf_counter()
            exchanged = self.exchange(comm, prepared)
            t_prepare = time.perf_counter()
            plan = self.plan(comm, prepared, exchanged)
            written = self.write(comm, prepared, plan)
            t_write = time.perf_counter()
            manifest = self.commit(comm, prepared, exchanged, plan, written)
        except AdaCheckError as e:
            e.args = (f"{e}\nCheckpoint {snap.tag!r} was not published: 'latest' and the checkpoints saved "
                      f"before in {snap.save_dir} are as they were.",)
            raise
        self.publish(comm, prepared, update_latest)
        t_end = time.perf_counter()
        manifest.stats["exchange"] = exchanged.stats
        manifest.stats["seconds"] = {"hash": t_hashed - prepared.started, "prepare": t_prepare - prepared.started,
                                     "write": t_write - t_prepare, "commit": t_end - t_write,
                                     "total": t_end - prepared.started}
        return manifest

    def snapshot(self, comm: Comm, save_dir: str, tag: str, collect: Callable[[], LocalState],
                 staging: Optional[Staging] = None) -> Snapshot:
        """Step 0: this rank's part (the integration's ``collect()``), chunked, objects encoded;
        with ``staging`` its tensors copied into host buffers (the async save's snapshot)."""
        started = time.perf_counter()
        given_dir = str(save_dir)
        store, save_dir = self.locate(save_dir)
        ckpt_dir = store.join(save_dir, tag)

        def run():
            commit.check_tag(tag)
            state = collect()
            shards = [c for s in state.shards for c in split_chunks(s, self.options.chunk_bytes)]
            objects = None
            if comm.rank == 0:
                objects, extra = _object_shards(state.objects, JOB_OBJECTS.rstrip("/"), replicated=False)
                shards += extra
            rank_objects, extra = _object_shards(state.rank_objects, f"rank{comm.rank}", replicated=False)
            shards += extra
            ready = None
            if staging is not None:
                shards, ready = staging.stage(shards)
            by_key = {(s.name, s.box): s for s in shards}
            if len(by_key) != len(shards):
                raise FormatError("the integration reported the same (tensor, box) twice on one rank")
            return Snapshot(save_dir, tag, ckpt_dir, store, by_key, objects, rank_objects, state.layout,
                            state.framework, state.step, started, ready, given_dir)

        return agree(comm, f"AdaCheck save of {ckpt_dir} (snapshot)", run)

    def prepare(self, comm: Comm, snap: Snapshot) -> Prepared:
        """Step 1: the snapshot's boxes hashed with their identity; rank 0 readies the directory."""
        opts, store, save_dir, ckpt_dir, tag = self.options, snap.store, snap.save_dir, snap.ckpt_dir, snap.tag

        def run():
            generation = previous = None
            if comm.rank == 0:
                stale = store.abort_uploads(save_dir, commit.SAVED_FILE)   # (no rank of the job writes here now)
                if stale:
                    log.warning("AdaCheck: aborted %d unfinished uploads under %s left by an interrupted save",
                                stale, save_dir)
                store.make_dirs(ckpt_dir)
                generation = max(commit.generation_of(ckpt_dir, store), snap.min_generation)
                previous = self.previous(save_dir, tag, store) if opts.reference_previous else None
            elif opts.spread is not None:
                store.make_dirs(ckpt_dir)       # (each node's own directory)
            if snap.ready is not None:
                snap.ready()
            metas = [_meta(s) for s in snap.shards.values()]
            if not opts.derive:
                metas = [replace(m, derive=None, derive_ok=False) if m.derive is not None else m for m in metas]
            return {"metas": metas, "objects": snap.objects,
                    "rank_objects": snap.rank_objects, "layout": snap.layout, "generation": generation,
                    "previous": previous, "step": snap.step, "node": node_id(), "framework": snap.framework}

        payload = agree(comm, f"AdaCheck save of {ckpt_dir} (prepare)", run)
        return Prepared(save_dir, tag, ckpt_dir, snap.shards, payload, snap.started, store, snap.lease)

    def exchange(self, comm: Comm, prepared: Prepared) -> Exchanged:
        """Step 2: every rank's payload on every rank (partitioned: see :class:`Exchanged`)."""
        t0 = time.perf_counter()
        how = exchange_for(self.options.exchange, comm.world_size)
        if how == "partitioned":
            p = prepared.payload
            head = comm.broadcast_object({k: p[k] for k in ("generation", "previous", "step", "framework")})
            mine = dict({k: v for k, v in p.items() if k != "metas"}, step=head["step"], framework=head["framework"])
            nodes = self._nodes(comm, p["node"]) if self.options.copies > 1 else None
            return Exchanged([mine], head["generation"], head["previous"],
                             {"how": "partitioned", "seconds": time.perf_counter() - t0}, partitioned=True, nodes=nodes)
        with gc_paused():
            gathered, received, compact = _exchange(comm, prepared.payload, how,
                                                    self.caches.exchanged)
        stats = {"how": how, "seconds": time.perf_counter() - t0, "bytes_received": received,
                 "ranks_sent_digest_only": compact}
        return Exchanged(gathered, gathered[0]["generation"], gathered[0]["previous"], stats)

    def _nodes(self, comm: Comm, mine: str) -> List[str]:
        """Every rank's node (the partitioned exchange's placement of copies on distinct nodes),
        gathered at the job's first such save and then kept: one reduction checks that no rank's
        node changed (or lost the list with its caches)."""
        known = self.caches.nodes.get(comm.world_size)
        if comm.any(known is None or known[comm.rank] != mine):
            known = self.caches.nodes[comm.world_size] = comm.all_gather_object(mine)
        return known

    def plan(self, comm: Comm, prepared: Prepared, exchanged: Exchanged) -> WritePlan:
        """Step 3 (pure, the same on every rank once the checkpoint to reference is indexed)."""
        store, save_dir, prev_tag = prepared.store, prepared.save_dir, exchanged.previous

        def index_previous(names=None):
            if prev_tag is None:
                return None, None
            m = commit.read_manifest(store.join(save_dir, prev_tag), store)
            sizes = {}   # each referenced file's bytes, None when it is gone (one stat per file)

            def size(ref):
                if ref not in sizes:
                    sizes[ref] = store.size_if_file(store.join(save_dir, ref))
                return sizes[ref]

            index = previous_index(prev_tag, m, lambda ref: size(ref) is not None, saving=prepared.tag, names=names)
            return index, {ref: n for ref, n in sizes.items() if n is not None}

        if exchanged.partitioned:
            return self._plan_partitioned(comm, prepared, exchanged, index_previous)
        previous, sizes = agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (previous checkpoint {prev_tag})",
                                index_previous)
        plan = plan_save([g["metas"] for g in exchanged.gathered], exchanged.generation, previous, file_sizes=sizes,
                         copies=self.options.copies, nodes=[g["node"] for g in exchanged.gathered],
                         cache=self.caches.plan)
        if comm.rank == 0:
            for w in plan.warnings:
                warnings.warn(f"AdaCheck: {w}", SaveWarning, stacklevel=3)
        return plan

    def _plan_partitioned(self, comm: Comm, prepared: Prepared, exchanged: Exchanged, previous_of) -> WritePlan:
        """Step 3 with the partitioned exchange: this rank's writes and file, the entries of the
        tensors it owns (the part of the manifest it writes at the commit); on rank 0 also the
        warnings (warned there), the counts and the manifest's index."""
        t0, gen = time.perf_counter(), exchanged.generation
        placed, own, got, stats, held = partition.plan(
            comm, prepared.payload["metas"], gen, previous_of, self.options.copies, exchanged.nodes,
            self.caches.partitioned.setdefault(comm.world_size, partition.PartitionCache()), self.caches.plan,
            f"AdaCheck save of {prepared.ckpt_dir}")
        exchanged.stats.update(stats, seconds=exchanged.stats["seconds"] + time.perf_counter() - t0)
        writes = {comm.rank: tuple(placed.writes)} if placed.writes else {}
        files = {file_name(comm.rank, gen): {"writer": comm.rank, "nbytes": placed.nbytes}} if writes else {}
        if got is None:
            return WritePlan(tensors=own, writes=writes, files=files, warnings=(), stats={}, held=held)
        for w in got.warnings:
            warnings.warn(f"AdaCheck: {w}", SaveWarning, stacklevel=4)
        exchanged.index = {"generation": gen, "parts": comm.world_size, "ranks": comm.world_size,
                           "tensors": got.tensors, "meta": got.meta, "referenced": got.referenced,
                           "writers": ranges(got.writers)}      # (meta: written to its file, then its hash)
        return WritePlan(tensors=own, writes=writes, files=files, warnings=tuple(got.warnings), stats=got.stats,
                         held=held)

    def _remove_mine(self, prepared: Prepared, *mine: Optional[str]) -> None:
        """This rank's files of a save that failed (its shard file, its part of the manifest)."""
        store = prepared.store
        for name in mine:
            if name is not None:
                for p in (store.join(prepared.ckpt_dir, name), store.join(prepared.ckpt_dir, name) + commit.TMP_SUFFIX):
                    store.remove(p)

    def write(self, comm: Comm, prepared: Prepared, plan: WritePlan) -> Written:
        """Step 4: the boxes this rank writes, in one file, committed (or nothing left of it)."""
        mine = plan.writes.get(comm.rank, ())
        my_file = next((f for f, info in plan.files.items() if info["writer"] == comm.rank), None) if mine else None

        def run():
            if not mine:
                return 0, None
            staged = host_tensors(prepared.shards, mine)
            metadata = {"format": "pt", "adacheck_tag": prepared.tag}
            encoding = check_compression(self.options.compression)
            if encoding is not None:
                staged = Encoder(encoding).encode_all({k: _bytes_of(t) for k, t in staged.items()})
                metadata[ENCODING_KEY] = encoding
            return persist(prepared.ckpt_dir, my_file, staged, metadata, self.options.fsync, prepared.store)

        size, tag = agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (write)", run,
                          on_failure=lambda: self._remove_mine(prepared, my_file))
        if exchange_for(self.options.exchange, comm.world_size) == "partitioned":      # (each in its rank file; their sum)
            return Written([], [], my_file, size, tag, comm.sum_each([size])[0])
        every = comm.all_gather_object((size, tag))
        return Written([k for k, _ in every], [t for _, t in every], my_file, size, tag, sum(k for k, _ in every))

    def commit(self, comm: Comm, prepared: Prepared, exchanged: Exchanged, plan: WritePlan,
               written: Written) -> Manifest:
        """Step 5: the manifest, written by rank 0 once every rank's file is committed."""
        gathered, copies = exchanged.gathered, self.options.copies
        files = {f: dict(info, nbytes=written.sizes[info["writer"]] if written.sizes else written.my_size)
                 for f, info in plan.files.items()}
        stats = dict(plan.stats, file_bytes=written.total)
        version = COMPRESSED_SINCE if self.options.compression else FORMAT_VERSION
        tensors, index, ranks, store, mine = plan.tensors, None, None, prepared.store, ()
        rank_objects, layout = tuple(g["rank_objects"] for g in gathered), {"ranks": [g["layout"] for g in gathered]}
        topology = dict({"world_size": comm.world_size},
                        **({"copies": copies, "nodes": [g["node"] for g in gathered]} if copies > 1 else {}))
        if exchanged.partitioned:       # each rank's part of the tensor table, and its rank file
            version, gen, ckpt_dir = PAGED_SINCE, exchanged.generation, prepared.ckpt_dir
            mine = (part_name(gen, comm.rank), rank_file_name(gen, comm.rank), meta_name(gen) if comm.rank == 0 else None)
            topology.pop("nodes", None)      # (each rank's is in its rank file, as are its bytes written)
            stats.pop("per_rank_bytes", None)
            p = prepared.payload
            tables = {"layout": p["layout"], "objects": p["rank_objects"],
                      "files": {written.my_file: {"writer": comm.rank, "nbytes": written.my_size}}
                      if written.my_file else {}, **({"node": p["node"]} if copies > 1 else {})}
            # each rank confirms the next rank's file (no rank stats them all; a save directory that
            # is not shared between nodes fails where the job crosses a node; a memory-tier save
            # across nodes: the next rank on the node, whose directory is the node's own)
            n, spread = comm.world_size, self.options.spread
            confirmer = (comm.rank - 1) % n if spread is None else spread.before(comm.rank)
            told = comm.all_to_all_bytes([json.dumps([written.my_file, written.my_size, written.my_tag]).encode()
                                          if written.my_file and dst == confirmer else None
                                          for dst in range(n)])
            nxt = [(json.loads(b), src) for src, b in enumerate(told) if b]

            def write_part():
                confirm_files(store, prepared.ckpt_dir,
                              {f: {"writer": src, "nbytes": k, "tag": t} for (f, k, t), src in nxt})
                commit.write_rank_file(ckpt_dir, gen, comm.rank, prepared.tag, plan.held or {}, tables,
                                       self.options.fsync, store)
                commit.write_part(ckpt_dir, gen, comm.rank, prepared.tag, plan.tensors, self.options.fsync, store)
                if comm.rank == 0:      # (what the index says of the tensors, bound by its hash)
                    return commit.write_meta(ckpt_dir, gen, prepared.tag, exchanged.index["meta"], self.options.fsync,
                                             store)

            meta = agree(comm, f"AdaCheck save of {ckpt_dir} (manifest parts)", write_part,
                         on_failure=lambda: self._remove_mine(prepared, written.my_file, *mine))
            if spread is not None:      # (its peer copies: each rank's files, to its partner on the next node)
                agree(comm, f"AdaCheck save of {ckpt_dir} (copies to other nodes)",
                      lambda: spread.move_own(comm, ckpt_dir, prepared.tag, lambda r: own_files(gen, r)),
                      on_failure=lambda: self._remove_mine(prepared, written.my_file, *mine))
            if comm.rank == 0:      # (its tables as a reader sees them: each rank's read from its rank file if asked)
                index, where = dict(exchanged.index, meta=meta), store.join(ckpt_dir, MANIFEST_NAME)
                tensors, ranks, files, rank_objects, layout = ranked_tables(
                    index, prepared.tag, version, commit.PartFiles(store, ckpt_dir), where)
        manifest = Manifest(
            format_version=version, tag=prepared.tag, step=gathered[0]["step"],
            framework=dict(gathered[0]["framework"], generation=exchanged.generation),
            topology=topology, tensors=tensors, objects=gathered[0]["objects"], rank_objects=rank_objects,
            layout=layout, files=files, stats=stats, index=index, ranks=ranks)

        here, spread, leads, root = files, self.options.spread, self._leads(comm), None
        if spread is not None and exchanged.partitioned:       # (every node's leader writes rank 0's manifest)
            raw = agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (manifest)",
                        lambda: dumps(manifest).encode("utf-8") if comm.rank == 0 else None)
            got = comm.all_to_all_bytes([raw if raw is not None and dst != 0 and spread.leads(dst) else None
                                         for dst in range(comm.world_size)])
            root = raw if comm.rank == 0 else got[0] if leads else None
        elif spread is not None:      # (a memory-tier save across nodes: each node's directory is its own)
            here = agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (copies to other nodes)",
                         lambda: spread.move(comm, prepared.ckpt_dir, files),
                         on_failure=lambda: self._remove_mine(prepared, written.my_file))

        def run():
            if leads:
                self.fence(prepared.lease, prepared.store, f"writing the manifest of {prepared.tag!r}")
                if not exchanged.partitioned:       # (partitioned: confirmed by the ranks, above)
                    confirm_files(prepared.store, prepared.ckpt_dir,
                                  here if spread is not None else    # (other nodes' copies: their sizes)
                                  {f: dict(info, tag=written.tags[info["writer"]]) for f, info in files.items()})
                if root is not None:
                    commit.write_manifest_bytes(prepared.ckpt_dir, root, prepared.store)
                else:
                    commit.write_manifest(prepared.ckpt_dir, manifest, prepared.store)

        parts = mine if exchanged.partitioned else ()
        agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (commit)", run,
              on_failure=lambda: self._remove_mine(prepared, written.my_file, *parts))
        return manifest

    def _leads(self, comm: Comm) -> bool:
        """Whether this rank writes the manifest, ``latest`` and retention: rank 0, or in a memory-tier
        save across nodes the lowest rank of each node (each node's directory is its own)."""
        return comm.rank == 0 if self.options.spread is None else self.options.spread.leads(comm.rank)

    def publish(self, comm: Comm, prepared: Prepared, update_latest: bool = True) -> None:
        """Step 6: ``latest`` (after the manifest), retention and garbage collection, by rank 0."""
        store, save_dir, keep_last = prepared.store, prepared.save_dir, self.options.keep_last

        leads = self._leads(comm)

        def run():
            if leads:
                self.fence(prepared.lease, store, f"publishing {prepared.tag!r} ('latest')")
                if update_latest:
                    commit.write_latest(save_dir, prepared.tag, store)
                if self.explains:
                    commit.leave_readme(save_dir, store)
                if keep_last:
                    latest = commit.read_latest(save_dir, store)
                    commit.apply_retention(save_dir, keep_last, protect=(prepared.tag,) + ((latest,) if latest else ()),
                                           store=store)
                # (a file written since this manifest may be another save's in flight: kept)
                commit.collect_garbage(save_dir, store=store,
                                       keep_after=store.mtime(store.join(prepared.ckpt_dir, MANIFEST_NAME)))

        agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (publish)", run)
        self.trust(prepared.ckpt_dir, store)

    # ------------------------------------------------------------------ load
    def load(self, comm: Comm, load_dir: str, tag: Optional[str], read: Callable[["CheckpointReader"], object],
             apply: Callable[[object], object],
             how_to_load: Callable[[str, Manifest], str] = lambda tag, manifest: f"tag={tag!r}",
             undo: Optional[Callable[[], None]] = None, reads_objects_of: Sequence[int] = ()):
        """Collectively open a checkpoint, stage this rank's part (``read``), then ``apply`` it.

        ``read`` must not change training state: only once every rank has staged its part
        without error does any rank call ``apply``.  Where staging must touch it (megatron-core
        builds optimizer state to load into), ``undo`` takes that back on every rank when the
        staging fails on any.  When the checkpoint turns out damaged while it is opened or
        staged (a FormatError or IntegrityError on any rank, a ``latest`` that names nothing),
        nothing has been applied: the error names the newest intact checkpoint (every box
        verified, the ranks sharing the work) and how to load it (``how_to_load(tag, manifest)``:
        the integration's call or flag); with ``on_corrupt="fallback"`` and no explicit ``tag``,
        that checkpoint is loaded instead, with a warning on every rank.  ``reads_objects_of``: the
        saving ranks whose objects ``read`` looks up besides this rank's own (megatron-core's
        ShardedObjects whose main replica another rank saved); from the memory tier across nodes
        each node is sent them first.  Returns (the checkpoint directory, its manifest, what
        ``apply`` returned).
        """
        lifecycle.register()
        lifecycle.finish_saves(block=True)     # asynchronous saves in flight (any job's here) commit first
        opts = self.options
        store, load_dir = self.locate(load_dir)
        t0, tier, chosen = time.perf_counter(), None, tag
        if opts.tiers is not None:
            given = (store, load_dir)
            store, load_dir, tier, chosen = self.memory_tier().choose(comm, store, load_dir, tag,
                                                                      reads_objects_of=reads_objects_of)
        self.last_load, self.last_tier = (store, load_dir), tier
        try:
            if tier != "memory":
                ckpt_dir, manifest, staged, reader = _stage(comm, load_dir, chosen, read, opts.verify, undo, store)
            else:
                try:     # (a node's memory holds a copy of what its ranks held when saved, preferred)
                    ckpt_dir, manifest, staged, reader = _stage(comm, load_dir, chosen, read, opts.verify, undo, store,
                                                        prefer_present=True)
                except AdaCheckError as e:
                    if not self.memory_tier().across:
                        raise
                    # another layout than the holders of the saved regions tell: every node gets a copy of
                    # every region, and the ranks stage again (nothing was applied)
                    log.warning("AdaCheck: staging from the memory tier failed (%s); every node gathers the whole "
                                "checkpoint and tries again", str(e).splitlines()[0])
                    store, load_dir, tier, chosen = self.memory_tier().choose(comm, *given, chosen, everything=True)
                    self.last_load, self.last_tier = (store, load_dir), tier
                    ckpt_dir, manifest, staged, reader = _stage(comm, load_dir, chosen, read, opts.verify, undo, store,
                                                        prefer_present=True)
        except (FormatError, NotFoundError) as e:
            if isinstance(e, NotFoundError) and (tag is not None or not commit.has_latest(load_dir, store)):
                raise      # nothing there to load (a tag that does not exist, an empty directory): not damage
            failed = tag if tag is not None else commit.latest_or_none(load_dir, store)
            intact = find_intact(comm, load_dir, exclude=(failed,), store=store)
            if opts.on_corrupt != "fallback" or tag is not None or intact is None:
                e.args = (f"{e}\n{_advice(load_dir, failed, intact, how_to_load, explicit=tag is not None)}",)
                raise
            warnings.warn(f"AdaCheck: the checkpoint {failed or 'that latest names'} in {load_dir} is damaged "
                          f"({str(e).splitlines()[-1].strip()}); loading {intact[0]} (step {intact[1].step}), the "
                          "newest intact checkpoint, instead (on_corrupt: fallback)", CorruptCheckpointWarning,
                          stacklevel=3)
            ckpt_dir, manifest, staged, reader = _stage(comm, load_dir, intact[0], read, opts.verify, undo, store)
        result = agree(comm, f"AdaCheck load of {ckpt_dir} (apply)", lambda: apply(staged))
        # what this rank read of the manifest besides manifest.json (a manifest in parts)
        parted = isinstance(manifest.tensors, PartedTensors)
        self.last_read = {"parts": manifest.tensors.bytes_read if parted else 0,
                          "meta": manifest.tensors.meta_bytes_read if parted else 0,
                          "rank_files": manifest.ranks.bytes_read if manifest.ranks is not None else 0,
                          "data": reader.bytes_read}       # (tensor bytes read from shard files)
        if opts.verify:
            self.trust(ckpt_dir, store)
        if tier is not None:
            log.info("AdaCheck: rank %d loaded %s (step %s) from the %s tier in %.2fs", comm.rank, manifest.tag,
                     manifest.step, tier, time.perf_counter() - t0)
        return ckpt_dir, manifest, result


@dataclass(frozen=True)
class Recording:
    """How an online recorder records (:meth:`Checkpointer.recording`): into ``where`` on
    ``store`` (with the memory tier, the memory copies of the bases); ``spread``: each node keeps
    its ranks' chains (the memory tier across nodes, :class:`~adacheck.tiers.DeltaSpread`);
    ``bridge``: a step that takes a base is also recorded as the last delta of the chain before
    it, so that the chain of a base persisted to durable storage goes on through the bases kept
    in memory only (the memory tier: durable storage then reaches every step it received);
    ``spares``: the directory of the memory tier's spare delta files, which steps are written
    over (:func:`~adacheck.tiers.spares_of`)."""
    store: Storage
    where: str
    spread: Optional[DeltaSpread] = None
    bridge: bool = False
    spares: Optional[str] = None


def _start_chain(recorder, store: Storage, save_dir: str, manifest: Manifest) -> None:
    """A base just committed into the directory ``recorder`` records to: the deltas of the next
    steps belong to it."""
    if store.canonical(save_dir) == store.canonical(recorder.save_dir):
        recorder.start_chain(manifest.tag, int(manifest.step), int(manifest.stats.get("file_bytes", 0)),
                             manifest.stats["seconds"]["total"], generation=manifest.framework.get("generation"))


def _refuse_non_persistent(persist: Optional[bool]) -> None:
    """A save that asks never to be persisted (``persist=False``) without the memory tier."""
    if persist is False:
        raise ConfigError("a non-persistent checkpoint goes to the memory tier, which is off: turn on "
                          "adacheck.tiers.memory (Megatron: --adacheck-tiers-memory)")


def save(comm: Comm, save_dir: str, tag: str, collect: Callable[[], LocalState],
         keep_last: Optional[int] = None, fsync: bool = True, update_latest: bool = True,
         reference_previous: bool = True, copies: int = 1, exchange: str = "auto",
         chunk_bytes: int = 64 << 20, store: Storage = LOCAL) -> Manifest:
    """:meth:`Checkpointer.save` of this process's default job (DEFAULT_CACHES) with these options."""
    options = Options(keep_last=keep_last, fsync=fsync, reference_previous=reference_previous, copies=copies,
                      exchange=exchange, chunk_bytes=chunk_bytes)
    return Checkpointer(store, options, DEFAULT_CACHES).save(comm, save_dir, tag, collect, update_latest)


def confirm_files(store: Storage, ckpt_dir: str, files: Dict[str, dict]) -> None:
    """Before the manifest names them: every file of the new checkpoint is on the storage with the
    size its writer committed (an object store's upload completed, a shared filesystem's rename
    visible here) and, where the storage tags content (an object store's ETag), the tag its writer
    saw once its upload completed: the object is the one that rank wrote, not one written again
    under its name since.  Their contents are checked by hash whenever they are read."""
    for fname, info in sorted(files.items()):
        path = store.join(ckpt_dir, fname)
        state = store.file_state(path)
        if state is None:
            raise IntegrityError(f"{path} was committed by rank {info['writer']} but is not on the storage; "
                                 "the checkpoint is not published")
        size, tag = state
        if size != info["nbytes"]:
            raise IntegrityError(f"{path} holds {size} bytes on the storage, but rank {info['writer']} wrote "
                                 f"{info['nbytes']}; the checkpoint is not published")
        if info.get("tag") is not None and tag != info["tag"]:
            raise IntegrityError(
                f"{path} on the storage is not the object rank {info['writer']} wrote: its content tag was "
                f"{info['tag']} when that rank's upload completed and is {tag} now, so something wrote it again "
                "since (another job saving the same tag into this directory?); the checkpoint is not published")


def resolve(load_dir: str, tag: Optional[str] = None, store: Storage = LOCAL) -> str:
    """The checkpoint directory to load: ``tag`` if given, else the one ``latest`` names."""
    if tag is None:
        if commit.has_manifest(load_dir, store):
            return load_dir   # pointed straight at a checkpoint directory
        if not store.is_dir(load_dir):
            raise NotFoundError(f"no AdaCheck checkpoint to load in {load_dir}: there is no such directory")
        tag = commit.read_latest(load_dir, store)
        if tag is None:
            present = _committed_tags(load_dir, store)
            raise NotFoundError(
                f"no AdaCheck checkpoint to load in {load_dir}: there is no 'latest' file"
                + (f"; complete checkpoints present: {present} (pass one as tag)" if present else ""))
        return store.join(load_dir, commit.check_tag(tag))
    d = store.join(load_dir, commit.check_tag(str(tag)))
    if not store.is_dir(d):
        present = _committed_tags(load_dir, store)
        raise NotFoundError(f"there is no checkpoint {tag!r} in {load_dir}"
                            + (f"; complete checkpoints present: {present}" if present else
                               " (and no complete checkpoint at all)"))
    return d


def _committed_tags(load_dir: str, store: Storage = LOCAL) -> List[str]:
    """Tags of the complete checkpoints in ``load_dir``, newest first (by step, then manifest time)."""
    found = []
    for t, m, _ in commit.list_checkpoints(load_dir, store):
        if m is not None:
            mtime = store.mtime(store.join(load_dir, t, commit.MANIFEST_NAME))
            found.append((m.step if m.step is not None else -1, mtime, t))
    return [t for _, _, t in sorted(found, reverse=True)]


def verify_part(reader: "CheckpointReader", part: int = 0, parts: int = 1,
                progress: Optional[Callable[[int], None]] = None) -> int:
    """Read and verify every stored box of the checkpoint's files that fall to ``part`` of
    ``parts`` (files in sorted order, every ``parts``-th), so ``parts`` ranks check a whole
    checkpoint once between them.  Raises on the first damage; returns the bytes checked.
    ``progress(bytes)``: the bytes checked so far, after each box."""
    by_file: Dict[str, list] = {}
    for name, e in reader.manifest.tensors.items():
        for sb in e.boxes:
            by_file.setdefault(sb.file, []).append((name, sb))
    checked = 0
    for i, fname in enumerate(sorted(by_file)):
        if i % parts != part:
            continue
        for name, sb in by_file[fname]:
            t = reader.stored(name, sb)
            checked += t.numel() * t.element_size()
            if progress is not None:
                progress(checked)
        reader.drop_cache()
    if reader.verify:     # derived tensors: each recorded box derived and checked (spread likewise)
        derived = [(name, e, b, h) for name, e in sorted(reader.manifest.tensors.items()) if e.derived is not None
                   for b, h in e.derived.boxes]
        for i, (name, e, b, h) in enumerate(derived):
            if i % parts == part:
                checked += reader.derived_box(name, e, b, h).numel() * torch.empty((), dtype=torch_dtype(e.dtype)).element_size()
                reader.drop_cache()
    return checked


def find_intact(comm: Comm, load_dir: str, exclude=(), store: Storage = LOCAL) -> Optional[Tuple[str, Manifest]]:
    """The newest complete checkpoint of ``load_dir`` (not one in ``exclude``) whose every stored
    box verifies, checked by all ranks together (collective; every rank gets the same answer)."""
    candidates = comm.broadcast_object([t for t in _committed_tags(load_dir, store) if t not in exclude]
                                       if comm.rank == 0 else None)
    for t in candidates:
        d = store.join(load_dir, t)

        def check(d=d):
            manifest = commit.read_manifest(d, store)
            verify_part(CheckpointReader(d, manifest, verify=True, cache_bytes=0, store=store), comm.rank,
                        comm.world_size)
            return manifest
        try:
            return t, agree(comm, f"AdaCheck: verifying {d}", check)
        except AdaCheckError:
            continue
    return None


class RankObjectLookup(Mapping):
    """Values the saving ranks kept in their own objects, by key, read when first asked for
    (``pick(rank objects, where) -> {key: value}``, decoded by the reader): a key is looked for in
    the objects of the saving ranks ``candidates``, in order, and only then in every saving rank's."""

    def __init__(self, reader: "CheckpointReader", candidates: Tuple[int, ...],
                 pick: Callable[[dict, str], dict]):
        self.reader, self.pick, self.found, self.added = reader, pick, {}, set()
        self.ranks = len(reader.manifest.rank_objects)
        self.candidates = [r for r in dict.fromkeys(candidates) if 0 <= r < self.ranks]

    def _add(self, rank: int) -> None:
        if rank not in self.added:
            saved = self.pick(self.reader.manifest.rank_objects[rank], f"rank {rank}'s objects of {self.reader.dir}")
            self.found.update(self.reader.decode(saved))
            self.added.add(rank)

    def _look(self, key) -> bool:
        for rank in [*self.candidates, *range(self.ranks)]:
            if key in self.found:
                return True
            self._add(rank)
        return key in self.found

    def __getitem__(self, key: str):
        if not self._look(key):
            raise KeyError(key)
        return self.found[key]

    def __contains__(self, key) -> bool:
        return self._look(key)

    def __iter__(self):
        for rank in range(self.ranks):
            self._add(rank)
        return iter(self.found)

    def __len__(self) -> int:
        return len(list(iter(self)))


class CheckpointReader:
    """Reads boxes of logical tensors from a committed checkpoint, verifying hashes.

    ``read(name, box)`` assembles the box from whatever stored boxes intersect it, so
    the reader serves any target layout.  Derived tensors are rebuilt from their source.
    Stored boxes are read whole, verified once, and kept in a bounded LRU cache.  With
    ``prefer_rank`` and a manifest with rank files (a partitioned save), a box that rank held
    is found in its rank file, without reading the part of the manifest that lists its tensor.
    """

    def __init__(self, ckpt_dir: str, manifest: Optional[Manifest] = None, verify: bool = True,
                 prefer_rank: Optional[int] = None, cache_bytes: int = 1 << 30, store: Storage = LOCAL,
                 prefer_present: bool = False):
        self.dir, self.store = ckpt_dir, store
        self.manifest = manifest if manifest is not None else commit.read_manifest(ckpt_dir, store)
        self.verify = verify
        self.bound = self.manifest.format_version >= BOUND_SINCE
        if not self.bound:
            warnings.warn(f"AdaCheck: {ckpt_dir} was written in format {self.manifest.format_version}, whose "
                          "hashes cover each box's bytes but not what the box claims to be (tensor, offsets, "
                          "dtype) and whose manifest has no checksum: an edited manifest could load wrong "
                          "data unnoticed. Save it again with this version to bind them.",
                          LegacyFormatWarning, stacklevel=2)
        self.prefer_rank = prefer_rank
        # (a memory-tier checkpoint across nodes: a node's directory holds some copies of each region)
        self._present: Optional[Dict[str, bool]] = {} if prefer_present else None
        self._files: Dict[str, SafetensorsFile] = {}
        # (file, key, tensor, box) -> verified bytes: one entry serves only the identity it was verified for
        self._cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self._cache_bytes, self._cache_limit = 0, cache_bytes
        self.bytes_read = 0
        self._scratch_buf = torch.empty(0, dtype=torch.uint8)
        self._held: Optional[Dict[str, TensorEntry]] = None

    def framework(self, name: str, label: str, hint: str) -> dict:
        """The manifest's framework record, when ``name`` saved the checkpoint (a StateError that
        names the saving one, ``label`` and ``hint`` else)."""
        saved_by = self.manifest.framework.get("name")
        if saved_by != name:
            raise StateError(f"{self.dir} was saved by {saved_by!r}, not {label}; {hint}")
        return self.manifest.framework

    def held(self) -> Dict[str, TensorEntry]:
        """The entries of the boxes ``prefer_rank`` held when the checkpoint was saved, cut down
        to them (its rank file, read once); empty without one."""
        if self._held is None:
            ranks, rank = self.manifest.ranks, self.prefer_rank
            self._held = ranks.get(rank).tensors if ranks is not None and rank is not None and rank < ranks.count else {}
        return self._held

    def _entry_for(self, name: str, box: Optional[Box]):
        """The entry to read ``box`` (default: all) of ``name`` from: the held one when its boxes
        cover ``box``, else the whole tensor's, or (a manifest in parts) its boxes that meet ``box``
        (format 6 reads only the pages of its part that list them)."""
        e = self.held().get(name)
        if e is not None:
            want = box if box is not None else Box.full(e.shape)
            regions = {b for b, _ in e.derived.boxes} if e.derived is not None else {sb.box for sb in e.boxes}
            if want.fits(e.shape) and sum(x.numel for x in (want.intersect(b) for b in regions)
                                          if x is not None) == want.numel:
                return e
        if box is not None and isinstance(self.manifest.tensors, PartedTensors):
            try:
                return self.manifest.tensors.region(name, box)
            except KeyError:
                pass        # (its part does not list it: reported as the whole read reports it)
        return self.entry(name, whole=True)

    def has(self, name: str) -> bool:
        if name in self.held():
            return True
        meta = self._meta()
        if meta is not None and not RANK_OBJECT.match(name):    # (format 5: every other tensor is listed there)
            return name in meta
        return name in self.manifest.tensors

    def is_cast_of(self, name: str, source: str, dtype: torch.dtype) -> bool:
        """``name`` is stored as the proven cast of ``source`` to ``dtype`` (a derivation): a framework
        that casts ``source`` once it is loaded gives back every saved bit of ``name``, so a load
        that leaves it to the framework need not read it."""
        if not self.has(name):
            return False
        e = self.entry(name)
        return e.derived is not None and e.derived.source == source and e.dtype == dtype_name(dtype)

    def names(self) -> List[str]:
        """The names of the checkpoint's tensors, each rank's own objects left out (format 5: from its
        index, no part read)."""
        meta = self._meta()
        if meta is not None:
            return sorted(meta)
        return sorted(n for n in self.manifest.tensors if not RANK_OBJECT.match(n))

    def _meta(self) -> Optional[Dict[str, list]]:
        """Format 5: what the meta file says of each tensor (kind, dtype, shape, derivation)."""
        tensors = self.manifest.tensors
        return tensors.meta() if isinstance(tensors, PartedTensors) else None

    def drop_cache(self) -> None:
        """Forget the verified boxes kept so far (their memory goes)."""
        self._cache.clear()
        self._cache_bytes = 0

    def entry(self, name: str, whole: bool = False):
        """Tensor ``name``'s entry: its kind, dtype, shape and derivation; its boxes are the whole
        tensor's with ``whole``, else perhaps only those ``prefer_rank`` held."""
        if not whole and name in self.held():
            return self._held[name]
        meta = self._meta() if not whole else None
        if meta is not None and name in meta:
            return meta_entry(name, meta[name])
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise StateError(f"{self.dir}: the checkpoint has no tensor {name!r}; is it a checkpoint of "
                             "this model?") from None

    def path_of(self, fname: str) -> str:
        """Where a manifest file entry lives: here, or in an earlier sibling checkpoint."""
        tag, name = split_file(fname)
        if tag is None:
            return self.store.join(self.dir, name)
        return self.store.join(self.store.parent(self.dir), tag, name)

    def _file(self, fname: str) -> SafetensorsFile:
        if fname not in self._files:
            self._files[fname] = SafetensorsFile(self.path_of(fname), self.store)
        return self._files[fname]

    def stored(self, name: str, sb, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stored box ``sb`` of ``name``, verified; read straight into ``out`` when given
        (contiguous, the stored dtype and shape), else kept in the cache."""
        ck = (sb.file, sb.key, name, sb.box)
        if ck in self._cache:
            self._cache.move_to_end(ck)
            return self._cache[ck] if out is None else out.copy_(self._cache[ck])
        e = self.entry(name)
        f = self._file(sb.file)
        if sb.key not in f.entries:
            raise FormatError(f"{f.path}: lacks tensor {sb.key!r} that the manifest places there")
        dname, shape, _, _ = f.entries[sb.key]
        encoding = f.metadata.get(ENCODING_KEY)
        if encoding is not None:      # (compressed: the file holds the box's encoded bytes)
            if dname != "uint8" or len(shape) != 1:
                raise FormatError(f"{f.path}: {sb.key!r} is {dname}{list(shape)} in a file of encoded boxes")
            raw = f.read(sb.key)
            self.bytes_read += raw.numel()
            t = decode(encoding, raw, torch_dtype(e.dtype), tuple(sb.box.lengths), f"{f.path}: {sb.key!r}")
            if out is not None:
                t = out.copy_(t)
        else:
            if dname != e.dtype or shape != tuple(sb.box.lengths):
                raise FormatError(f"{f.path}: {sb.key!r} is {dname}{list(shape)} in the file but the "
                                  f"manifest says {e.dtype}{list(sb.box.lengths)}")
            t = f.read(sb.key, out)
            self.bytes_read += t.numel() * t.element_size()
        if self.verify:
            got = (bound_digest(box_identity(name, e.dtype, e.shape, sb.box.offsets, sb.box.lengths), t)
                   if self.bound else hash_tensor(t))
            if got != sb.hash:
                raise IntegrityError(f"{name} (box {sb.box.key()}) in {f.path}: stored bytes hash to "
                                     f"{got} but the manifest recorded {sb.hash}"
                                     + (" for this tensor, box and dtype" if self.bound else "")
                                     + "; the file is corrupt (bit flip or partial write)"
                                     + (" or the manifest was edited" if self.bound else "")
                                     + ". Restore it or load an older checkpoint.")
        if out is not None:
            return t
        nbytes = t.numel() * t.element_size()
        self._cache[ck] = t
        self._cache_bytes += nbytes
        while self._cache_bytes > self._cache_limit and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.numel() * old.element_size()
        return t

    def derived_box(self, name: str, e, dbox: Box, digest: str) -> torch.Tensor:
        """Box ``dbox`` of the derived tensor ``name``: its source's elements cast as saved, checked
        against the digest its holders recorded (kept in the cache)."""
        ck = ("derived", name, dbox)
        if ck in self._cache:
            self._cache.move_to_end(ck)
            return self._cache[ck]
        t = self.read(e.derived.source, dbox).to(torch_dtype(e.dtype))
        got = bound_digest(box_identity(name, e.dtype, e.shape, dbox.offsets, dbox.lengths), t)
        if got != digest:
            raise IntegrityError(f"{name} (box {dbox.key()}), derived from {e.derived.source}: the derived bytes hash "
                                 f"to {got} but its holders recorded {digest} when they saved it; the manifest was "
                                 "edited (its derivation or source) or the source is not what was saved")
        self._cache[ck] = t
        self._cache_bytes += t.numel() * t.element_size()
        while self._cache_bytes > self._cache_limit and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.numel() * old.element_size()
        return t

    def _scratch(self, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer for ``box`` of ``dtype`` (fresh memory costs page faults per read)."""
        nbytes = box.numel * torch.empty((), dtype=dtype).element_size()
        if self._scratch_buf.numel() < nbytes:
            self._scratch_buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch_buf[:nbytes].view(dtype).view(box.lengths)

    def _choose(self, boxes):
        """Per region, the stored copies to try in order: all of one variant (the one this
        rank held, else the lowest holder's), this rank's own file first."""
        by_region: Dict[Box, list] = {}
        for sb in boxes:
            by_region.setdefault(sb.box, []).append(sb)
        out = []
        for region, cands in by_region.items():
            if self._present is not None:
                cands = sorted(cands, key=lambda c: not self._here(c.file))
            pick = cands[0]
            if self.prefer_rank is not None:
                pick = next((c for c in cands if self.prefer_rank in c.holders), pick)
            same = [c for c in cands if c.hash == pick.hash]
            out.append(sorted(same, key=lambda c: (c.file != pick.file, c.file)))
        return out

    def _here(self, fname: str) -> bool:
        if fname not in self._present:
            self._present[fname] = self.store.size_if_file(self.path_of(fname)) is not None
        return self._present[fname]

    def _stored_any(self, name: str, copies, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The first stored copy that reads and verifies; the error of each copy otherwise."""
        errors = []
        for sb in copies:
            try:
                t = self.stored(name, sb, out=out)
            except (IntegrityError, FormatError, OSError) as e:
                errors.append(e)
                continue
            if errors:
                warnings.warn(f"AdaCheck: read {name} box {sb.box.key()} from its copy in {sb.file}; "
                              f"the first copy is damaged: {errors[0]}", stacklevel=3)
            return t
        if len(errors) == 1:
            raise errors[0]
        raise IntegrityError(f"{name} box {copies[0].box.key()}: all {len(copies)} stored copies "
                             "are unreadable: " + "; ".join(str(e) for e in errors))

    def read(self, name: str, box: Optional[Box] = None, dtype: Optional[torch.dtype] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The elements of ``box`` (default: all) of logical tensor ``name``.

        With ``out`` (box-shaped) they are written there, cast to its dtype, without an
        intermediate copy; otherwise a new tensor (cast to ``dtype`` if given) is returned.
        """
        e = self._entry_for(name, box)
        box = box if box is not None else Box.full(e.shape)
        if not box.fits(e.shape):
            raise FormatError(f"{name}: asked for box {box} outside its shape {list(e.shape)}")
        if out is None:
            out = torch.empty(box.lengths, dtype=dtype or torch_dtype(e.dtype))
        elif tuple(out.shape) != tuple(box.lengths):
            raise ValueError(f"{name}: out has shape {list(out.shape)}, box {box} needs {list(box.lengths)}")
        if e.derived is not None:
            if self.verify and e.derived.boxes:
                # derived box by derived box, each verified against its holders' digest
                filled = sum(copy_intersection(out, box, self.derived_box(name, e, dbox, digest), dbox)
                             for dbox, digest in e.derived.boxes if box.intersect(dbox) is not None)
                if filled != box.numel:
                    raise FormatError(f"{name}: derived boxes cover {filled} of the {box.numel} elements asked for")
            elif out.dtype == torch_dtype(e.dtype):
                self.read(e.derived.source, box, out=out)
            else:   # derive exactly as saved (cast to the stored dtype), then cast to out's
                out.copy_(self.read(e.derived.source, box).to(torch_dtype(e.dtype)))
            return out
        filled = 0
        direct = out.is_contiguous() and out.dtype == torch_dtype(e.dtype)
        for copies in self._choose(e.boxes):
            sb = copies[0]
            if sb.box == box and not any((c.file, c.key, name, c.box) in self._cache for c in copies):
                # the whole request is one stored box: read it straight into out, or into a
                # reused scratch buffer when out has another dtype (a cast) or layout
                self._stored_any(name, copies, out=out if direct else self._scratch(box, torch_dtype(e.dtype)))
                if not direct:
                    out.copy_(self._scratch(box, torch_dtype(e.dtype)))
                filled += box.numel
            elif box.intersect(sb.box) is not None:
                filled += copy_intersection(out, box, self._stored_any(name, copies), sb.box)
        if filled != box.numel:
            raise FormatError(f"{name}: stored boxes cover {filled} of the {box.numel} elements "
                              f"asked for (box {box})")
        return out

    def read_flat(self, name: str, start: int, stop: int, dtype: Optional[torch.dtype] = None,
                  out: Optional[torch.Tensor] = None, within: Optional[Box] = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the row-major flattened tensor, or of its box ``within``
        (e.g. one tensor-parallel rank's slice) flattened on its own (into 1-D ``out`` if given)."""
        e = self.entry(name)
        if out is None:
            out = torch.empty(stop - start, dtype=dtype or torch_dtype(e.dtype))
        elif out.numel() != stop - start or out.dim() != 1:
            raise ValueError(f"{name}: out must be 1-D with {stop - start} elements")
        region = within if within is not None else Box.full(e.shape)
        pos = 0
        for b in flat_range_to_boxes(region.lengths, start, stop):
            self.read(name, b.shifted(region.offsets), out=out.narrow(0, pos, b.numel).view(b.lengths))
            pos += b.numel
        return out

    def objects(self, rank: Optional[int] = None):
        """The job's saved objects, or saving rank ``rank``'s, with their tensors read."""
        return self.decode(self.manifest.objects if rank is None else self.manifest.rank_objects[rank])

    def decode(self, tree):
        """A saved object tree (or part of one) with its tensors read."""
        for ref in jsontree.tensor_refs(tree):
            if not isinstance(ref, str) or not self.has(ref):
                raise FormatError(f"{self.dir}: its saved objects refer to tensor {ref!r}, which it does not store")
        return jsontree.decode(tree, lambda n: self.read(n))


def load(comm: Comm, load_dir: str, tag: Optional[str], read: Callable[[CheckpointReader], object],
         apply: Callable[[object], object], verify: bool = True, on_corrupt: str = "raise",
         how_to_load: Callable[[str, Manifest], str] = lambda tag, manifest: f"tag={tag!r}",
         undo: Optional[Callable[[], None]] = None, store: Storage = LOCAL):
    """:meth:`Checkpointer.load` of this process's default job (DEFAULT_CACHES)."""
    return Checkpointer(store, Options(verify=verify, on_corrupt=on_corrupt), DEFAULT_CACHES).load(
        comm, load_dir, tag, read, apply, how_to_load, undo)


def _stage(comm: Comm, load_dir: str, tag: Optional[str], read, verify: bool, undo=None, store: Storage = LOCAL,
           prefer_present: bool = False):
    def open_():
        d = resolve(load_dir, tag, store)
        return d, commit.read_manifest(d, store)

    ckpt_dir, manifest = agree(comm, f"AdaCheck load from {load_dir} (open)", open_)
    if not comm.same(manifest.tag):
        tags = comm.all_gather_object(manifest.tag)
        raise ConfigError(f"ranks resolved different checkpoints to load: {tags}; is {load_dir} "
                          "the same shared directory on every rank?")
    reader = CheckpointReader(ckpt_dir, manifest, verify=verify, prefer_rank=comm.rank, store=store,
                              prefer_present=prefer_present)
    staged = agree(comm, f"AdaCheck load of {ckpt_dir} (read)", lambda: read(reader), on_failure=undo)
    return ckpt_dir, manifest, staged, reader


def _advice(load_dir: str, failed: Optional[str], intact, how_to_load, explicit: bool) -> str:
    what = f"Checkpoint {failed!r} in {load_dir}" if failed else f"The checkpoint that {load_dir}/latest should name"
    if intact is None:
        return (f"Nothing was loaded. {what} cannot be loaded, and no other checkpoint there verifies "
                "either: restore the damaged files from a copy.")
    tag, manifest = intact
    return (f"Nothing was loaded. {what} cannot be loaded; the newest intact checkpoint there "
            f"is {tag!r} (step {manifest.step}, every stored box verified). To load it: {how_to_load(tag, manifest)}"
            + ("" if explicit else "; or set on_corrupt \"fallback\" (Megatron: --adacheck-on-corrupt fallback) "
               "to load the newest intact checkpoint when the latest is damaged") + ".")
