"""Checkpoint tiers: the memory tier in front of the checkpoint directory (the durable tier).

With ``tiers.memory`` every save is an ordinary AdaCheck checkpoint written into node-local memory
(``$ADACHECK_MEMORY_DIR``, ``tiers.memory_dir``, default ``/dev/shm/adacheck``), under the job's
identity and the checkpoint directory it stands for::

    <memory dir>/<job>/<key of the checkpoint directory>/<tag>/...

so a process killed by SIGKILL, or restarted by torchrun's elastic agent, finds it, and another
job never takes it for its own.  Every ``persist_interval``-th save is copied to the checkpoint
directory in the background, and the newest one at a clean exit (then the job's memory files
go).  The copy needs no collective: each rank copies the files it wrote (a checkpoint in parts:
its part and rank file too) and leaves a marker; rank 0 writes the manifest once every marker is
there and every shard file has its size, then ``latest``: the durable tier's commit protocol is
the save's.  ``keep`` newest checkpoints
stay in memory (one being copied is kept too).

A job across nodes (the node: ``$ADACHECK_NODE`` or the host name) writes one copy of each box per
node that holds it, no derived tensors (:class:`NodeSpread`): each node's memory then holds what its
own ranks hold, and its lowest rank writes the node's manifest and keeps its directory.  With
``tiers.peer`` each writer's file is also sent, over torch.distributed, to a rank of the next node,
so the loss of one node (its processes and its memory) loses nothing.  Saved in parts (the
partitioned exchange), each node's directory holds rank 0's ``manifest.json`` and its own ranks'
shard files, parts and rank files (with ``peer``, the previous node's too: each rank sends its
own to its partner, :meth:`NodeSpread.move_own`); a node's holdings then follow its rank files.

A load picks the newest checkpoint across the tiers (the memory tier on a tie: it is faster), the
same on every rank, and says which tier it read from.  In memory, a checkpoint counts only when the
nodes' memories hold every stored region between them, each file with its size (:func:`plan_recovery`);
a node that lacks what its ranks need (a replacement node; another layout: everything) receives it
from the nodes that hold it before any rank reads, each file checked against the manifest
(:func:`fetch`, :func:`receive_file`)."""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

from ..storage import commit
from ..storage import manifest_files
from ..online import deltas
from ..errors import SaveWarning
from ..storage.backends import LOCAL, Storage
from ..storage.direct import SpareFiles
from .location import DELTA_FILE, SOURCE_NAME, remove_job_memory, durable_key, memory_location, spares_of
from .peers import NodeSpread
from .persist import ChainCopy, held_in, persist_checkpoint
from .persist import persist_chain

log = logging.getLogger("adacheck")


class MemoryTier:
    """The memory tier of one job's Checkpointer (see the module's docstring).  ``memory`` is the
    Checkpointer that writes the memory copies (no fsync, no references between checkpoints, its
    own caches); ``confirm`` checks a persisted checkpoint's files before its manifest; ``node_id``
    names the machine a rank runs on."""

    def __init__(self, config, memory, confirm: Callable, node_id: Callable[[], str], fsync: bool,
                 keep_last: Optional[int], on_error: str = "warn"):
        self.config, self.memory, self.confirm, self.node_id = config, memory, confirm, node_id
        self.fsync, self.keep_last, self.on_error = fsync, keep_last, on_error
        self.saves: Dict[str, int] = {}
        self.newest: Dict[str, tuple] = {}        # durable key -> (memory dir, tag, store, durable dir, latest?)
        self.committed: Dict[str, tuple] = {}     # durable key -> the newest of its saves known committed in memory
        self.due: Dict[str, str] = {}             # durable key -> the tag whose copy was started last
        self.owed: set = set()                    # durable keys whose due copy found its memory save failed
        self.persisted: set = set()               # (durable key, tag) committed to durable storage
        self.persisting: Optional[str] = None     # the tag being copied
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.rank = 0
        self.leads = True              # this rank keeps its node's memory directory (its lowest rank)
        self.nodes: Optional[Tuple[str, ...]] = None
        self.online = False            # the job records online deltas into the memory copies
        self.chain: Optional[ChainCopy] = None     # the persisted base's deltas going to durable storage
        self.fence: Optional[Callable] = None      # (persist_checkpoint's): this job still owns the directory

    # ------------------------------------------------------------------ where
    def location(self, store: Storage, save_dir: str) -> str:
        return memory_location(store, save_dir, self.config.memory_dir)

    def _placement(self, comm) -> None:
        """At the first save (collective): the node of every rank.  Across nodes, the memory copies
        are written once per node (each node's ranks recover from their own node's memory) and,
        with ``peer``, sent to the next node too (see NodeSpread)."""
        if self.nodes is not None:
            return
        self.nodes = tuple(comm.all_gather_object(self.node_id()))
        count = len(set(self.nodes))
        spread = NodeSpread(self.nodes, self.config.peer)
        self.leads = spread.leads(comm.rank)
        if count > 1:
            self.memory.configure(replace(self.memory.options, copies=count, derive=False, spread=spread))
        elif self.config.peer and comm.rank == 0:
            log.warning("AdaCheck: tiers.peer: every rank of this job runs on one node (%s), so there is no other "
                        "node to keep a copy; the memory tier works alone (set $ADACHECK_NODE per node if the "
                        "nodes share a host name)", self.nodes[0])

    # ------------------------------------------------------------------ save
    def save(self, comm, store: Storage, save_dir: str, tag: str, collect, update_latest: bool,
             asynchronous: bool = False, persist: Optional[bool] = None, online: bool = False):
        """Save ``tag`` into the memory tier (``asynchronous``: return after the snapshot, the
        memory copy is written behind training as an async save); it is then copied to the
        checkpoint directory when ``persist`` is True, never when it is False (a non-persistent
        checkpoint; the newest is still copied at a clean exit), and with None when it is the
        ``persist_interval``-th since the last copy.  ``online``: the job records online deltas
        into the memory copies (a chain per base, in the base's directory; across nodes each
        node's, see DeltaSpread)."""
        self._placement(comm)
        self.online = online
        self.rank = comm.rank
        mem = self.location(store, save_dir)
        durable = durable_key(store, save_dir)
        if self.leads and not os.path.exists(os.path.join(mem, SOURCE_NAME)):
            os.makedirs(mem, exist_ok=True)
            LOCAL.write_atomic(os.path.join(mem, SOURCE_NAME), durable.encode(), fsync=False)
        if self.thread is not None and not self.thread.is_alive():
            self._end_copy()        # a copy that ended: reported now, and no longer kept from retention
        t0 = time.perf_counter()
        self.memory.finish(waiting_for=tag)     # the previous memory save, if it was asynchronous
        self._note_committed(durable)
        # its files are copied under their names into the checkpoint directory: past every generation of
        # this tag there (a re-saved tag never writes over a committed checkpoint's files)
        floor = 0
        if comm.rank == 0:
            try:
                floor = commit.generation_of(store.join(save_dir, tag), store)
            except OSError as e:      # the copy will tell whether the directory can be written
                log.warning("AdaCheck: could not list %s before saving %s to memory: %s", save_dir, tag, e)
        if asynchronous:
            self._retain(mem, ())         # before the new save's files exist: nothing in flight now
            self.memory.save_async(comm, mem, tag, collect, update_latest=update_latest, min_generation=floor)
            manifest = None
        else:
            manifest = self.memory.save(comm, mem, tag, collect, update_latest=update_latest, min_generation=floor)
            self._retain(mem, (tag,))
        n = self.saves[durable] = self.saves.get(durable, 0) + 1
        self.newest[durable] = (mem, tag, store, save_dir, update_latest)
        log.info("AdaCheck: %s %s the memory tier (%s) in %.2fs", tag,
                 "snapshotted for" if asynchronous else "saved to", mem, time.perf_counter() - t0)
        if comm.rank == 0 and log.isEnabledFor(logging.INFO):
            held = held_in(mem)
            log.info("AdaCheck: the memory tier holds %d checkpoint(s) of %s, %.1f MB (keep: %d)", held[0], save_dir,
                     held[1] / 1e6, self.config.keep)
        if persist or (persist is None and (n % self.config.persist_interval == 0 or durable in self.owed)):
            self.saves[durable] = 0
            self.owed.discard(durable)
            self.due[durable] = tag
            self.start_persist(durable)
        elif self.chain is not None and os.path.dirname(self.chain.src) == mem:
            self.chain.follow(os.path.join(mem, tag))     # its deltas go on from the persisted base's
        return manifest

    def _note_committed(self, durable: str) -> None:
        """Once the previous memory save of ``durable`` has ended: whether it committed (its
        manifest is in memory on every node); the newest that did is what exit persists when a
        later one failed.  One that failed when its copy to durable storage was due makes the
        next save's copy due."""
        last = self.newest.get(durable)
        if last is None:
            return
        if manifest_files.has_manifest(os.path.join(last[0], last[1]), LOCAL):
            self.committed[durable] = last
        elif self.due.get(durable) == last[1]:
            self.owed.add(durable)    # its copy was due: the next save is copied, not the interval's next

    def _retain(self, mem: str, protect: tuple) -> None:
        """Rank 0: the newest ``keep`` memory checkpoints stay (and ``protect``, and the one being
        copied to durable storage); the others' files are deleted (on every node, by its lowest
        rank).  Only while no memory save is in flight (its files have no manifest yet)."""
        if self.leads:
            protect = protect + ((self.persisting,) if self.persisting else ())
            retired = commit.apply_retention(mem, self.config.keep, protect=protect, store=LOCAL)
            if retired:
                self._keep_spares(mem, retired)
            commit.collect_garbage(mem, store=LOCAL)

    def _keep_spares(self, mem: str, retired: List[str]) -> None:
        """The delta files of the retired chains become the node's spares (:func:`spares_of`): the
        next chain's steps are written over them instead of into new memory.  A copy to durable
        storage that fell behind reads under a lock that keeps its file from being written over
        (:meth:`SpareFiles.held`); its copy of that chain then ends, as it would with the files
        deleted.  So does the peer thread (:func:`pack_step`)."""
        files = []
        for tag in retired:
            d = os.path.join(mem, tag)
            for step in deltas.step_dirs(d):
                at = deltas.step_dir(d, step)
                files += [os.path.join(at, n) for n in os.listdir(at) if DELTA_FILE.match(n)]
        SpareFiles(spares_of(mem)).refill(files)

    def start_persist(self, durable: str) -> None:
        """Copy the newest memory checkpoint of ``durable`` to it in the background (one at a
        time: a copy still running is waited for first, and said so)."""
        t0 = time.perf_counter()
        self._end_copy()
        waited = time.perf_counter() - t0
        mem, tag, store, save_dir, update_latest = self.newest[durable]
        if waited > 0.001:
            log.warning("AdaCheck: persisting %s waited %.2fs for the previous copy to durable storage", tag, waited)
        self.persisting = tag
        rank = self.rank
        in_memory = self.memory.pending       # an asynchronous memory save of tag: committed first

        def run():
            t = time.perf_counter()
            try:
                if in_memory is not None:
                    in_memory.thread.join()
                    if in_memory.error is not None:
                        log.warning("AdaCheck: %s is not copied to %s: its memory save failed (the next save is)",
                                    tag, save_dir)
                        return
                if persist_checkpoint(rank, os.path.join(mem, tag), store, save_dir, tag, self.fsync, update_latest,
                                      self.keep_last, self.confirm, fence=self.fence):
                    self.persisted.add((durable, tag))
                    log.info("AdaCheck: %s persisted to %s in %.2fs (background)", tag, save_dir, time.perf_counter() - t)
            except BaseException as e:  # noqa: BLE001 - reported by finish on the training thread
                self.error = e

        self.thread = threading.Thread(target=run, name=f"adacheck-persist-{tag}", daemon=True)
        self.thread.start()
        if self.online:       # its deltas follow it; a chain not finished stays as far as it got
            if self.chain is not None:
                self.chain.end(wait=False)
            self.chain = ChainCopy(rank, os.path.join(mem, tag), store, store.join(save_dir, tag), self.fsync)

    def finish(self) -> None:
        """Wait for the copy to durable storage in flight; a failure is a warning (or raises with
        on_error "raise"): the checkpoint stays in memory, the durable tier as it was.  An
        asynchronous memory save in flight commits first; then the memory tier is trimmed to
        ``keep`` again, the checkpoint just copied no longer kept for its copy (it stayed a
        ``keep`` + 1st until the next save when the copy outlasted the memory save)."""
        trim = self.memory.pending is not None or self.thread is not None    # else nothing changed
        if self.memory.pending is not None:
            self.memory.finish()
        self._end_copy()
        if trim:
            for mem, tag, *_ in list(self.newest.values()):
                self._retain(mem, (tag,))
        if self.chain is not None:
            self.chain.copy()         # the persisted base's deltas written so far

    def _end_copy(self) -> None:
        """Wait for the copy to durable storage in flight (only that) and report it."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        tag, self.persisting = self.persisting, None
        e, self.error = self.error, None
        if e is not None:       # any error: a storage's OSError too, as an asynchronous save says it
            if self.on_error == "raise":
                raise e
            warnings.warn(f"AdaCheck: copying {tag} from the memory tier to durable storage failed; it stays in "
                          f"memory and the checkpoint directory is as it was (on_error: warn): {e}", SaveWarning,
                          stacklevel=3)

    # ------------------------------------------------------------------ exit
    def close(self) -> None:
        """At a clean exit: the copy in flight finishes, the newest memory checkpoint of each
        checkpoint directory is persisted if it was not, then (once committed) the job's memory
        files of that directory go, on every node.  No collective (see persist_checkpoint)."""
        try:
            self.finish()
        except Exception as e:  # noqa: BLE001 - the interpreter is exiting
            log.warning("AdaCheck: %s", e)
        chain, self.chain = self.chain, None
        if chain is not None:
            chain.end(wait=True)
        for durable, newest in list(self.newest.items()):
            mem, tag, store, save_dir, update_latest = newest
            if not manifest_files.has_manifest(os.path.join(mem, tag), LOCAL):
                # its memory save failed (said when it did): the newest that committed is the job's state
                self._note_committed(durable)
                before = self.committed.get(durable)
                if self.rank == 0:
                    log.warning("AdaCheck: at exit, %s is not in the memory tier (its save failed); %s", tag,
                                f"persisting {before[1]}, the newest checkpoint there, instead" if before else
                                "no earlier checkpoint of this job is there either")
                if before is None:
                    if self.leads and not any(manifest_files.has_manifest(os.path.join(mem, t), LOCAL) for t in LOCAL.list(mem)):
                        remove_job_memory(mem)     # no committed checkpoint there: nothing to keep
                    continue
                mem, tag, store, save_dir, update_latest = before
            done = (durable, tag) in self.persisted
            if not done:
                try:
                    done = persist_checkpoint(self.rank, os.path.join(mem, tag), store, save_dir, tag, self.fsync,
                                              update_latest, self.keep_last, self.confirm, timeout_s=120.0,
                                              fence=self.fence)
                    if done and self.rank == 0:
                        log.info("AdaCheck: %s persisted to %s at exit", tag, save_dir)
                except Exception as e:  # noqa: BLE001 - the interpreter is exiting: keep the memory copy
                    log.warning("AdaCheck: at exit, %s could not be persisted to %s; it stays in the memory tier (%s): %s",
                                tag, save_dir, mem, e)
                    done = False
            if done:
                copied = chain.last if chain is not None and chain.src == os.path.join(mem, tag) else None
                done = persist_chain(self.rank, self.nodes if self.leads else None, self.fsync, mem, tag, store, save_dir,
                                     after=copied)
            if done and self.leads and self.rank != 0:
                # another node's memory: it goes once rank 0 has committed the copy in durable storage
                deadline, dst = time.monotonic() + 120.0, store.join(save_dir, tag)
                while not manifest_files.has_manifest(dst, store) and time.monotonic() < deadline:
                    time.sleep(0.1)
                done = manifest_files.has_manifest(dst, store)
            if done and self.leads:
                remove_job_memory(mem)
        self.newest.clear()
        self.committed.clear()
        self.owed.clear()
        self.memory.close()       # its writer process, if any, stops
