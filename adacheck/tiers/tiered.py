"""The memory tier wrapped around a job's checkpointer: :class:`TieredCheckpointer`.

A :class:`~adacheck.checkpoint.Checkpointer` saves to and loads from the checkpoint directory (the
durable tier) and knows nothing of tiers.  With ``options.tiers``, a TieredCheckpointer is used
instead (:func:`adacheck.jobs.checkpointer` chooses): every save goes into node-local memory
through its :class:`~adacheck.tiers.memory.MemoryTier` (which writes with a plain Checkpointer of
its own and copies checkpoints to the durable tier behind training), and a load reads the newest
checkpoint of either tier (:class:`TieredLoader`)."""
from __future__ import annotations

import logging
import os
import time
from typing import Optional, Sequence, Tuple

from ..checkpoint import lifecycle
from ..gcpause import pausing
from ..checkpoint.checkpointer import Checkpointer, Recording, start_chain
from ..checkpoint.loading import Loader, Opened, Source, stage_checkpoint
from ..checkpoint.options import Caches, Options
from ..storage.lease import node_id
from ..checkpoint.reader import confirm_files
from ..errors import AdaCheckError
from ..integration import Restore
from ..plan.exchange import Comm, agree
from ..storage import commit
from ..storage.backends import LOCAL, Storage
from ..types import Manifest
from .location import spares_of
from .memory import MemoryTier
from .peers import DeltaSpread, NodeSpread
from .persist import newest_committed
from .recovery import fetch, holdings, newer_in_memory, plan_recovery

log = logging.getLogger("adacheck")


class TieredCheckpointer(Checkpointer):
    """A job's checkpoints with the memory tier in front of the checkpoint directory (see the
    module's docstring).  ``tier`` is its :class:`MemoryTier`; every other member is the
    :class:`Checkpointer`'s, whose leases, caches and storage it keeps for the durable tier."""

    has_tiers = True

    def __init__(self, store: Storage = LOCAL, options: Optional[Options] = None, caches: Optional[Caches] = None):
        super().__init__(store, options, caches)
        self.tier = self._make_tier()

    def _make_tier(self) -> MemoryTier:
        """The memory tier: its copies are checkpoints of their own (no fsync, no references
        between them), written by a Checkpointer with its own caches, into directories that are
        the job's (no lease, no README)."""
        o = self.options
        memory = Checkpointer(LOCAL, Options(keep_last=None, fsync=False, reference_previous=False, copies=1,
                                             exchange=o.exchange, chunk_bytes=o.chunk_bytes, verify=o.verify,
                                             on_corrupt=o.on_corrupt, on_error=o.on_error, writer=o.writer))
        memory.on_saved, memory.explains, memory.takes_leases = self._saved_to_memory, False, False
        tier = MemoryTier(o.tiers, memory, confirm_files, node_id, fsync=o.fsync, keep_last=o.keep_last,
                          on_error=o.on_error)
        tier.fence = self.leases.fence_dir
        return tier

    def _saved_to_memory(self, report: dict) -> None:
        """A save into the memory tier committed (its checkpointer logged it): this job's last save."""
        self.last_save = report
        if self.on_saved is not None:
            self.on_saved(report)

    def has_checkpoint(self, load_dir: str, comm: Optional[Comm] = None) -> bool:
        """Whether a load of ``load_dir`` without a tag finds something there or, in memory, one
        of this job's checkpoints of it, on any node (with ``comm``: collective, the same answer
        on every rank)."""
        store, where = self.locate(load_dir)
        found = (commit.has_checkpoint(where, store)
                 or newest_committed(self.tier.location(store, where), LOCAL) is not None)
        return found if comm is None else comm.any(found)

    def lease_unreachable(self, save_dir: str, error: Exception) -> None:
        # the memory tier saves whatever the checkpoint directory does; its copies there say so
        log.warning("AdaCheck: the lease of %s could not be taken (%s: %s); the save goes to the memory "
                    "tier, and its copy to %s is not fenced until a later save takes the lease",
                    save_dir, type(error).__name__, error, save_dir)

    @pausing
    def save(self, comm: Comm, save_dir: str, tag: str, collect, update_latest: bool = True, recorder=None,
             persist: Optional[bool] = None, min_generation: int = 0) -> Optional[Manifest]:
        """:meth:`Checkpointer.save` into the memory tier; ``persist``: copy this one to
        ``save_dir`` now (True), never (False: a non-persistent checkpoint), or every
        ``persist_interval``-th (None).  The memory tier's generations follow the checkpoint
        directory's, so ``min_generation`` is not used."""
        lifecycle.register()
        self.hold(comm, save_dir)
        manifest = self._save_to_memory(comm, save_dir, tag, collect, update_latest, False, persist, recorder)
        if manifest is not None:
            self.last_committed = manifest
        return manifest

    @pausing
    def save_async(self, comm: Comm, save_dir: str, tag: str, collect, update_latest: bool = True,
                   persist: Optional[bool] = None, min_generation: int = 0):
        """:meth:`Checkpointer.save_async` into the memory tier (the copies to durable storage run
        behind it)."""
        self.hold(comm, save_dir)
        return self._save_to_memory(comm, save_dir, tag, collect, update_latest, True, persist, None)

    def _save_to_memory(self, comm: Comm, save_dir: str, tag: str, collect, update_latest: bool,
                        asynchronous: bool, persist: Optional[bool], recorder):
        lifecycle.keep(self, strong=True)    # at exit the newest memory checkpoint is persisted, also when
        # the caller let this job go: the memory tier's promise
        store, path = self.locate(save_dir)
        if recorder is not None:
            recorder.flush()
        manifest = self.tier.save(comm, store, path, tag, collect, update_latest, asynchronous=asynchronous,
                                  persist=persist, online=recorder is not None)
        if recorder is not None:
            start_chain(recorder, *self.chain_location(save_dir), manifest)
        return manifest

    def chain_location(self, save_dir: str) -> Tuple[Storage, str]:
        """The memory copies of ``save_dir``'s bases (each chain in its base's directory there)."""
        store, path = self.locate(save_dir)
        return LOCAL, self.tier.location(store, path)

    def recording(self, comm: Comm, save_dir: str) -> Recording:
        """Collective (every rank calls it where it makes its recorder): across nodes each node
        keeps its ranks' chains; a step that takes a base bridges the chains; spare delta files
        are reused."""
        store, where = self.chain_location(save_dir)
        nodes = comm.all_gather_object(node_id())
        spread = DeltaSpread(comm, nodes, self.options.tiers.peer) if len(set(nodes)) > 1 else None
        return Recording(store, where, spread, bridge=True, spares=spares_of(where))

    def loader(self) -> Loader:
        return TieredLoader(self.options, self.caches, self.locate, self.tier)

    def poll(self) -> Optional[Manifest]:
        memory = self.tier.memory
        if memory.pending is not None and memory.pending.done():
            memory.finish()       # an asynchronous memory save that ended: reported now
        return super().poll()

    def finish(self, waiting_for: Optional[str] = None) -> Optional[Manifest]:
        self.tier.finish()
        return super().finish(waiting_for)

    def configure(self, options: Options) -> None:
        old = self.options.tiers
        super().configure(options)
        if self.options.tiers != old:
            self.tier.close()         # its newest checkpoint persisted, its memory freed
            self.tier = self._make_tier()

    def close(self) -> None:
        super().close()
        self.tier.close()


class TieredLoader(Loader):
    """A load from the newest checkpoint of either tier (:meth:`choose_tier`)."""

    def __init__(self, options: Options, caches: Caches, locate, tier: MemoryTier):
        super().__init__(options, caches, locate)
        self.tier = tier
        self.given: Optional[Tuple[Storage, str]] = None     # the checkpoint directory asked for
        self.across = False            # this load runs on several nodes

    def choose(self, comm: Comm, asked: Source, restore: Restore) -> Source:
        self.given = (asked.store, asked.load_dir)
        return self.choose_tier(comm, asked.store, asked.load_dir, asked.tag, reads_objects_of=restore.reads_objects_of)

    def choose_tier(self, comm, store: Storage, load_dir: str, tag: Optional[str], everything: bool = False,
                    reads_objects_of: Sequence[int] = ()) -> Source:
        """Where to load from: the memory tier when the nodes' memories
        hold ``tag`` complete between them (or, without one, the checkpoint the memory's ``latest``
        names, as every save that moves ``latest`` writes it there first: see :func:`newer_in_memory`),
        else the checkpoint directory (tag as given).  Decided by rank
        0 for every rank; a node that lacks files its ranks need (a node replaced after a loss:
        the peer copies; another layout: every region, as with ``everything``) gets them from the
        nodes that hold them first (collective), and the objects of the saving ranks each of its
        ranks reads (``reads_objects_of``, see Restore)."""
        tier = self.tier
        tier.finish()
        mem = tier.location(store, load_dir)
        placed = comm.all_gather_object((tier.node_id(), tuple(int(r) for r in reads_objects_of)))
        nodes = [n for n, _ in placed]
        self.across = len(set(nodes)) > 1
        leads = NodeSpread(tuple(nodes), False).leads(comm.rank)
        # rank 0 decides for every rank
        gathered = comm.gather_object((holdings(mem), commit.latest_or_none(mem, LOCAL)) if leads else None)

        def decide():
            reports = [g[0] if g else None for g in gathered]
            newest = max(((h["step"], t) for rep in reports for t, h in (rep or {}).items()), default=None)
            if tag is not None:
                plan = plan_recovery(reports, nodes, str(tag), everything, reads_objects_of=[o for _, o in placed])
                return ("memory", plan, newest) if plan is not None else ("durable", None, newest)
            return newer_in_memory(reports, [g[1] for g in gathered if g], store, load_dir,
                                   lambda t, below=None: plan_recovery(reports, nodes, t, everything, below=below,
                                                                       reads_objects_of=[o for _, o in placed])) \
                + (newest,)

        where, plan, newest = comm.broadcast_object(decide() if comm.rank == 0 else None)
        if where == "memory":
            if plan["moves"] or plan["deltas"]:
                t0 = time.perf_counter()
                try:
                    got = agree(comm, f"AdaCheck: the memory tier's {plan['tag']} to every node",
                                lambda: fetch(comm, os.path.join(mem, plan["tag"]), plan))
                except AdaCheckError as e:
                    log.warning("AdaCheck: the memory tier's %s could not be gathered from the other nodes (%s); "
                                "loading from durable storage", plan["tag"], e)
                    return Source(store, load_dir, "durable", tag)
                if got:
                    log.info("AdaCheck: rank %d received %.1f MB of %s from other nodes' memory (a node's own memory "
                             "lacked them) in %.2fs", comm.rank, got / 1e6, plan["tag"], time.perf_counter() - t0)
            if tag is None and leads and os.path.isdir(mem) and commit.latest_or_none(mem, LOCAL) != plan["tag"]:
                commit.write_latest(mem, plan["tag"], LOCAL)     # a node that lacked it: its newest now
            log.info("AdaCheck: loading %s from the memory tier (%s) instead of %s", plan["tag"], mem, load_dir)
            return Source(LOCAL, mem, "memory", plan["tag"])
        if newest is None:
            log.warning("AdaCheck: the memory tier holds no checkpoint of %s for this job (%s); loading from "
                        "durable storage", load_dir, mem)
        elif plan is None:
            log.warning("AdaCheck: the memory tier holds no complete checkpoint of %s%s (every node's memory "
                        "together lacks files of its newest, %s, step %s: a node and its peer copy were lost); "
                        "loading from durable storage", load_dir, "" if tag is None else f" named {tag}", newest[1],
                        newest[0])
        else:
            log.warning("AdaCheck: the memory tier's newest complete checkpoint of %s (%s, step %s) is older than "
                        "durable storage's; loading from durable storage", load_dir, plan["tag"], plan["step"])
        return Source(store, load_dir, "durable", tag)

    def stage(self, comm: Comm, source: Source, restore: Restore) -> Opened:
        if source.tier != "memory":
            return super().stage(comm, source, restore)
        verify = self.options.verify
        try:     # a node's memory holds a copy of what its ranks held when saved, preferred
            return stage_checkpoint(comm, source, restore, verify, prefer_present=True)
        except AdaCheckError as e:
            if not self.across:
                raise
            # another layout than the holders of the saved regions tell: every node gets a copy of
            # every region, and the ranks stage again (nothing was applied)
            log.warning("AdaCheck: staging from the memory tier failed (%s); every node gathers the whole "
                        "checkpoint and tries again", str(e).splitlines()[0])
            again = self.choose_tier(comm, *self.given, source.tag, everything=True)
            return stage_checkpoint(comm, again, restore, verify, prefer_present=True)
