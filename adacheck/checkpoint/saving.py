"""The steps of one save, each collective and run under ``agree`` (a failure on any rank is
raised on every rank, and the new files are removed): :class:`SavePipeline`.

``snapshot`` (collect this rank's part; an asynchronous save copies it into reusable host
buffers) -> ``prepare`` (hash) -> ``exchange`` (ring, or the partitioned exchange of
:mod:`adacheck.plan.partition`) -> ``plan`` (pure: who writes what, what is referenced or
derived) -> ``write`` (this rank's file, committed) -> ``commit`` (the manifest, once every file
is confirmed) -> ``publish`` (``latest``, retention, garbage).  Each step's result is a typed
value (:class:`Snapshot`, :class:`Prepared`, :class:`Exchanged`, ``WritePlan``, :class:`Written`,
``Manifest``).  Nothing already committed is touched before the new manifest is durable."""
from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from dataclasses import replace
from typing import Callable, Dict, Optional, Tuple

from ..storage import commit
from ..storage import manifest_files
from ..errors import AdaCheckError, FormatError, IntegrityError, SaveWarning
from ..plan.exchange import Comm, agree, exchange_for
from ..storage.lease import Holding
from ..format.compression import ENCODING_KEY, Encoder
from ..format.compression import check as check_compression
from ..format.manifest import COMPRESSED_SINCE, FORMAT_VERSION, PAGED_SINCE, JOB_OBJECTS, dumps
from ..gcpause import paused
from ..plan.planner import WritePlan, plan_save, previous_index
from ..types import Box, Manifest, meta_of_row, meta_row
from .staging import Staging
from ..storage.backends import LOCAL, Storage
from ..format.writer import write_safetensors_to
from .options import Caches, Options
from ..storage.lease import node_id
from .reader import confirm_files
from .state import Deferred, bytes_of, object_shards, shard_metas, split_chunks
from ..integration import LocalShard, LocalState
from .partitioned import PartitionedSteps
from .steps import Exchanged, Prepared, Snapshot, Written

log = logging.getLogger("adacheck")


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
                             lambda k: bytes_of(staged[k]), metadata)
        size = fw.commit()
        state = store.file_state(path)
        if state is None or state[0] != size:
            raise IntegrityError(f"{path}: {size} bytes were written and committed, but the storage then shows "
                                 + ("no such file" if state is None else f"{state[0]} bytes")
                                 + f" ({store.describe()}); the checkpoint is not published")
        return state
    except BaseException:
        fw.abort()      # after the commit it leaves the file to the save's cleanup
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


def _unfenced(holding: Optional[Holding], store: Storage, doing: str) -> None:
    """No lease to check (the memory tier's own saves: its directories are the job's)."""


class SavePipeline:
    """The steps of one save for a job: its ``options``, its ``caches`` (what it keeps from one
    save to the next), ``fence`` (called by the rank that writes the manifest and ``latest``,
    before it writes them: raises when the save directory's lease is no longer this job's) and
    ``explains`` (a README in the save directory).  Each step is a method with a typed result;
    :meth:`persist` runs steps 1-6 from a :class:`Snapshot`."""

    def __init__(self, options: Options, caches: Caches,
                 fence: Callable[[Optional[Holding], Storage, str], None] = _unfenced, explains: bool = True):
        self.options, self.caches, self.fence, self.explains = options, caches, fence, explains
        self.partitioned = PartitionedSteps(options, caches, self._remove_mine)

    def persist(self, comm: Comm, snap: Snapshot, update_latest: bool = True) -> Manifest:
        """Steps 1-6 of a save from its snapshot: hash, exchange, plan, write, commit, publish."""
        try:
            t_start = time.perf_counter()
            prepared = self.prepare(comm, snap)
            t_hashed = time.perf_counter()
            exchanged = self.exchange(comm, prepared)
            t_prepare = time.perf_counter()
            plan = self.plan(comm, prepared, exchanged)
            t_plan = time.perf_counter()
            written = self.write(comm, prepared, plan)
            t_write = time.perf_counter()
            manifest = self.commit(comm, prepared, exchanged, plan, written)
            t_commit = time.perf_counter()
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
        # this rank's seconds in each step (in memory only, as every stat above): where a save's time goes
        manifest.stats["phases"] = {"collect": max(snap.collected - snap.started, 0.0), "hash": t_hashed - t_start,
                                    "exchange": t_prepare - t_hashed, "plan": t_plan - t_prepare,
                                    "write": t_write - t_plan, "commit": t_commit - t_write,
                                    "publish": t_end - t_commit}
        return manifest

    def snapshot(self, comm: Comm, store: Storage, save_dir: str, tag: str, collect: Callable[[], LocalState],
                 staging: Optional[Staging] = None, given_dir: str = "") -> Snapshot:
        """Step 0: this rank's part (the integration's ``collect()``), chunked, objects encoded;
        with ``staging`` its tensors copied into host buffers (the async save's snapshot).
        ``save_dir`` is on ``store``; ``given_dir``: as the caller named it (a URL)."""
        started = time.perf_counter()
        ckpt_dir = store.join(save_dir, tag)

        def run():
            commit.check_tag(tag)
            state = collect()
            shards = [c for s in state.shards for c in split_chunks(s, self.options.chunk_bytes)]
            objects = None
            if comm.rank == 0:
                objects, extra = object_shards(state.objects, JOB_OBJECTS.rstrip("/"), replicated=False)
                shards += extra
            rank_objects, extra = object_shards(state.rank_objects, f"rank{comm.rank}", replicated=False)
            shards += extra
            ready = None
            if staging is not None:
                shards, ready = staging.stage(shards)
            by_key = {(s.name, s.box): s for s in shards}
            if len(by_key) != len(shards):
                raise FormatError("the integration reported the same (tensor, box) twice on one rank")
            return Snapshot(save_dir, tag, ckpt_dir, store, by_key, objects, rank_objects, state.layout,
                            state.framework, state.step, started, ready, given_dir, collected=time.perf_counter())

        return agree(comm, f"AdaCheck save of {ckpt_dir} (snapshot)", run)

    def prepare(self, comm: Comm, snap: Snapshot) -> Prepared:
        """Step 1: the snapshot's boxes hashed with their identity; rank 0 readies the directory."""
        opts, store, save_dir, ckpt_dir, tag = self.options, snap.store, snap.save_dir, snap.ckpt_dir, snap.tag

        def run():
            generation = previous = None
            if comm.rank == 0:
                stale = store.abort_uploads(save_dir, commit.SAVED_FILE)   # no rank of the job writes here now
                if stale:
                    log.warning("AdaCheck: aborted %d unfinished uploads under %s left by an interrupted save",
                                stale, save_dir)
                store.make_dirs(ckpt_dir)
                generation = max(commit.generation_of(ckpt_dir, store), snap.min_generation)
                previous = self.caches.previous(store, save_dir, tag) if opts.reference_previous else None
            elif opts.spread is not None:
                store.make_dirs(ckpt_dir)       # each node's own directory
            if snap.ready is not None:
                snap.ready()
            metas = shard_metas(list(snap.shards.values()))
            if not opts.derive:
                metas = [replace(m, derive=None, derive_ok=False) if m.derive is not None else m for m in metas]
            return {"metas": metas, "objects": snap.objects,
                    "rank_objects": snap.rank_objects, "layout": snap.layout, "generation": generation,
                    "previous": previous, "step": snap.step, "node": node_id(), "framework": snap.framework}

        payload = agree(comm, f"AdaCheck save of {ckpt_dir} (prepare)", run)
        return Prepared(save_dir, tag, ckpt_dir, snap.shards, payload, snap.started, store, snap.lease,
                        how=exchange_for(opts.exchange, comm.world_size))

    def exchange(self, comm: Comm, prepared: Prepared) -> Exchanged:
        """Step 2: every rank's payload on every rank (partitioned: see :class:`Exchanged`)."""
        t0, how = time.perf_counter(), prepared.how
        if how == "partitioned":
            return self.partitioned.exchange(comm, prepared, t0)
        with paused():
            gathered, received, compact = _exchange(comm, prepared.payload, how,
                                                    self.caches.exchanged)
        stats = {"how": how, "seconds": time.perf_counter() - t0, "bytes_received": received,
                 "ranks_sent_digest_only": compact}
        return Exchanged(gathered, gathered[0]["generation"], gathered[0]["previous"], stats)

    def plan(self, comm: Comm, prepared: Prepared, exchanged: Exchanged) -> WritePlan:
        """Step 3 (pure, the same on every rank once the checkpoint to reference is indexed)."""
        store, save_dir, prev_tag = prepared.store, prepared.save_dir, exchanged.previous

        def index_previous(names=None):
            if prev_tag is None:
                return None, None
            m = manifest_files.read_manifest(store.join(save_dir, prev_tag), store)
            sizes = {}   # each referenced file's bytes, None when it is gone (one stat per file)

            def size(ref):
                if ref not in sizes:
                    sizes[ref] = store.size_if_file(store.join(save_dir, ref))
                return sizes[ref]

            index = previous_index(prev_tag, m, lambda ref: size(ref) is not None, saving=prepared.tag, names=names)
            return index, {ref: n for ref, n in sizes.items() if n is not None}

        if exchanged.partitioned:
            return self.partitioned.plan(comm, prepared, exchanged, index_previous)
        previous, sizes = agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (previous checkpoint {prev_tag})",
                                index_previous)
        plan = plan_save([g["metas"] for g in exchanged.gathered], exchanged.generation, previous, file_sizes=sizes,
                         copies=self.options.copies, nodes=[g["node"] for g in exchanged.gathered],
                         cache=self.caches.plan)
        if comm.rank == 0:
            for w in plan.warnings:
                warnings.warn(f"AdaCheck: {w}", SaveWarning, stacklevel=3)
        return plan

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
                staged = Encoder(encoding).encode_all({k: bytes_of(t) for k, t in staged.items()})
                metadata[ENCODING_KEY] = encoding
            return persist(prepared.ckpt_dir, my_file, staged, metadata, self.options.fsync, prepared.store)

        size, tag = agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (write)", run,
                          on_failure=lambda: self._remove_mine(prepared, my_file))
        if prepared.how == "partitioned":
            return self.partitioned.written(comm, my_file, size, tag)
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
        tensors, index, ranks, mine = plan.tensors, None, None, ()
        rank_objects, layout = tuple(g["rank_objects"] for g in gathered), {"ranks": [g["layout"] for g in gathered]}
        topology = dict({"world_size": comm.world_size},
                        **({"copies": copies, "nodes": [g["node"] for g in gathered]} if copies > 1 else {}))
        if exchanged.partitioned:       # each rank's part of the tensor table, and its rank file
            version = PAGED_SINCE
            topology.pop("nodes", None)      # each rank's is in its rank file, as are its bytes written
            stats.pop("per_rank_bytes", None)
            parts = self.partitioned.write_parts(comm, prepared, exchanged, plan, written)
            mine = parts.mine
            if parts.tables is not None:
                (tensors, ranks, files, rank_objects, layout), index = parts.tables, parts.index
        manifest = Manifest(
            format_version=version, tag=prepared.tag, step=gathered[0]["step"],
            framework=dict(gathered[0]["framework"], generation=exchanged.generation),
            topology=topology, tensors=tensors, objects=gathered[0]["objects"], rank_objects=rank_objects,
            layout=layout, files=files, stats=stats, index=index, ranks=ranks)

        here, spread, leads, root = files, self.options.spread, self._leads(comm), None
        if spread is not None and exchanged.partitioned:       # every node's leader writes rank 0's manifest
            raw = agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (manifest)",
                        lambda: dumps(manifest).encode("utf-8") if comm.rank == 0 else None)
            got = comm.all_to_all_bytes([raw if raw is not None and dst != 0 and spread.leads(dst) else None
                                         for dst in range(comm.world_size)])
            root = raw if comm.rank == 0 else got[0] if leads else None
        elif spread is not None:      # a memory-tier save across nodes: each node's directory is its own
            here = agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (copies to other nodes)",
                         lambda: spread.move(comm, prepared.ckpt_dir, files),
                         on_failure=lambda: self._remove_mine(prepared, written.my_file))

        def run():
            if leads:
                self.fence(prepared.lease, prepared.store, f"writing the manifest of {prepared.tag!r}")
                if not exchanged.partitioned:       # partitioned: confirmed by the ranks, above
                    confirm_files(prepared.store, prepared.ckpt_dir,
                                  here if spread is not None else    # other nodes' copies: their sizes
                                  {f: dict(info, tag=written.tags[info["writer"]]) for f, info in files.items()})
                if root is not None:
                    manifest_files.write_manifest_bytes(prepared.ckpt_dir, root, prepared.store)
                else:
                    manifest_files.write_manifest(prepared.ckpt_dir, manifest, prepared.store)

        agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (commit)", run,
              on_failure=lambda: self._remove_mine(prepared, written.my_file, *mine))
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
                commit.tidy_after(save_dir, prepared.tag, keep_last, store)

        agree(comm, f"AdaCheck save of {prepared.ckpt_dir} (publish)", run)
        self.caches.trust(prepared.ckpt_dir, store)
