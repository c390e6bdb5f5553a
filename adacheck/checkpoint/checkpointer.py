"""The checkpoints of one job, independent of any framework: :class:`Checkpointer`.

An integration describes what its rank holds as a :class:`~adacheck.checkpoint.state.LocalState`;
``save`` turns the states of all ranks into one committed checkpoint (the steps:
:class:`~adacheck.checkpoint.saving.SavePipeline`), ``save_async`` returns once the state is
copied to host buffers, and ``load`` opens one and hands a
:class:`~adacheck.checkpoint.reader.CheckpointReader` to the integration, which asks for exactly
the boxes its current layout needs (:class:`~adacheck.checkpoint.loading.Loader`)."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

from ..storage import commit
from . import lifecycle
from ..gcpause import pausing
from ..errors import ConfigError, LeaseError
from ..plan.exchange import Comm, agree
from ..storage.lease import Holding, Leases
from ..types import Manifest
from .staging import Staging
from ..storage.backends import LOCAL, Storage, is_url, open_storage, storage_path, url_protocol
from .background import AsyncSaves, PendingSave
from .loading import LoadResult, Loader
from .options import DEFAULT_CACHES, Caches, Options
from ..storage.lease import node_id
from .reader import CheckpointReader
from .saving import SavePipeline, describe_save, save_report
from .steps import Snapshot, shown_dir
from ..integration import LocalState, Restore

if TYPE_CHECKING:
    from ..tiers.peers import DeltaSpread

log = logging.getLogger("adacheck")


class Checkpointer:
    """The checkpoints of one job: where they live (``store``), how they are saved and loaded
    (``options``), and what the job keeps between them (``caches``).

    A save runs the steps of a :class:`SavePipeline` (``pipeline_class``) on this job's options and
    caches, behind this job's lease of the save directory; a load runs a :class:`Loader`.  It
    knows nothing of tiers: with ``options.tiers``, a
    :class:`~adacheck.tiers.tiered.TieredCheckpointer` wraps the memory tier around it
    (:func:`adacheck.jobs.checkpointer` chooses)."""

    pipeline_class = SavePipeline
    has_tiers = False      # whether this class serves options.tiers

    def __init__(self, store: Storage = LOCAL, options: Optional[Options] = None, caches: Optional[Caches] = None):
        self.store = store
        self.options = options if options is not None else Options()
        self.caches = caches if caches is not None else Caches()
        self._check_tiers(self.options)
        self._stores: Dict[str, Storage] = {}
        self.background = AsyncSaves()       # the asynchronous saves
        self.last_committed: Optional[Manifest] = None   # of the last save that committed (reported)
        self.last_loaded: Optional[LoadResult] = None    # what the last load read, and from where
        self.last_save: Optional[dict] = None    # save_report of the last save that committed (reported)
        self.on_saved: Optional[Callable[[dict], None]] = None   # called with it on every rank
        self.explains = True     # a README in the directories it saves to (not in the memory tier's)
        self.leases = Leases()   # the save directories' leases this job holds (rank 0)
        self.takes_leases = True     # not the memory tier's own: its directories are the job's

    def _check_tiers(self, options: Options) -> None:
        if (options.tiers is not None) != self.has_tiers:
            raise ConfigError(f"{type(self).__name__} does not serve options with{'' if options.tiers else 'out'} "
                              "tiers: make the job's checkpointer with adacheck.jobs.checkpointer(options)")

    def has_checkpoint(self, load_dir: str, comm: Optional[Comm] = None) -> bool:
        """Whether a load of ``load_dir`` without a tag finds something: a ``latest`` or a complete
        checkpoint there (``comm`` is used by a tier, whose answer is collective)."""
        store, where = self.locate(load_dir)
        return commit.has_checkpoint(where, store)

    def chain_location(self, save_dir: str) -> Tuple[Storage, str]:
        """Where online deltas of the bases saved to ``save_dir`` go: ``save_dir`` itself."""
        return self.locate(save_dir)

    def recording(self, comm: Comm, save_dir: str) -> "Recording":
        """Where and how an online recorder of the bases saved to ``save_dir`` records (see
        :class:`Recording`).  Called by every rank where it makes its recorder."""
        return Recording(*self.chain_location(save_dir))

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
        if protocol not in self._stores:     # one storage per protocol: its read blocks are kept
            self._stores[protocol] = open_storage(path, self.options.storage_options or None)[0]
        return self._stores[protocol], storage_path(path)

    def check_writable(self, comm: Comm, save_dir: str) -> None:
        """Collectively, at start-up: :func:`check_writable` of ``save_dir`` (a path or URL)."""
        check_writable(comm, *self.locate(save_dir), save_dir)

    # ------------------------------------------------------------------ save
    def pipeline(self) -> SavePipeline:
        """The steps of a save with this job's options and caches, fenced by its leases."""
        return self.pipeline_class(self.options, self.caches, self.leases.fence, self.explains)

    def snapshot(self, comm: Comm, save_dir: str, tag: str, collect: Callable[[], LocalState],
                 staging: Optional[Staging] = None) -> Snapshot:
        """Step 0 of a save into ``save_dir`` (a path or URL): :meth:`SavePipeline.snapshot`."""
        store, path = self.locate(save_dir)
        return self.pipeline().snapshot(comm, store, path, tag, collect, staging, given_dir=str(save_dir))

    def persist(self, comm: Comm, snap: Snapshot, update_latest: bool = True) -> Manifest:
        """Steps 1-6 of a save from its snapshot: :meth:`SavePipeline.persist`."""
        return self.pipeline().persist(comm, snap, update_latest)

    @pausing
    def load(self, comm: Comm, load_dir: str, tag: Optional[str], restore: Restore) -> LoadResult:
        """Collectively load a checkpoint of ``load_dir``: :meth:`Loader.load` (what happens when
        the checkpoint is damaged, and ``on_corrupt``); also kept as ``last_loaded``.

        Args:
            comm: the job's ranks (every rank calls this).
            load_dir: the save directory (a path or an fsspec URL), or a checkpoint directory.
            tag: the checkpoint to load; None: the one ``latest`` names.
            restore: the integration's :class:`~adacheck.integration.Restore`: stages this
                rank's part, then applies it once every rank staged.

        Returns:
            A :class:`LoadResult`.
        """
        loaded = self.loader().load(comm, load_dir, tag, restore)
        self.last_loaded = loaded
        return loaded

    def loader(self) -> Loader:
        """The :class:`Loader` of this job's loads."""
        return Loader(self.options, self.caches, self.locate)

    def hold(self, comm: Comm, save_dir: str) -> Optional[Holding]:
        """Collectively, at every save: rank 0 takes or renews this job's lease of ``save_dir``
        (:mod:`adacheck.storage.lease`; returned there, None on the other ranks).  Another job's live lease
        (without ``takeover``), or this job's lease taken over by another job, is a LeaseError on
        every rank, before anything is written; a directory that cannot be reached is
        :meth:`lease_unreachable`."""
        if not self.takes_leases:
            return None
        store, path = self.locate(save_dir)
        lifecycle.keep(self.leases)     # removed at exit; a job dropped before: its leases expire

        def run():
            if comm.rank != 0:
                return None
            try:
                return self.leases.take(store, path, self.options.lease_ttl_s, self.options.takeover)
            except LeaseError:
                raise
            except Exception as e:  # noqa: BLE001 - the storage's own error says why
                self.lease_unreachable(save_dir, e)
                return None
        return agree(comm, f"AdaCheck save into {save_dir} (its lease)", run)

    def lease_unreachable(self, save_dir: str, error: Exception) -> None:
        """The lease of ``save_dir`` could not be taken (rank 0, not another job's lease): raised
        here; a tier that saves elsewhere first warns instead."""
        raise error

    @pausing
    def save(self, comm: Comm, save_dir: str, tag: str, collect: Callable[[], LocalState],
             update_latest: bool = True, recorder=None, persist: Optional[bool] = None,
             min_generation: int = 0) -> Manifest:
        """Collectively write checkpoint ``tag`` under ``save_dir``.  Nothing saved before is
        touched until the new manifest is durable; a failure on any rank is raised on every rank.

        Args:
            comm: the job's ranks (every rank calls this).
            save_dir: the save directory, a path or an fsspec URL.
            tag: the checkpoint's name in it.
            collect: returns this rank's :class:`LocalState`.
            update_latest: point ``latest`` at it once committed.
            recorder: the job's :class:`~adacheck.online.recorder.OnlineRecorder`, if it records:
                its chain is made complete up to this step first, and a checkpoint committed into
                its directory is the base the deltas of the next steps belong to.
            persist: None; with the memory tier (a TieredCheckpointer), whether to copy this one
                to ``save_dir``.
            min_generation: the lowest generation its files may have (rank 0's counts).

        Returns:
            Its manifest (its ``stats`` also hold, in memory only, the exchange's cost and each
            step's seconds).
        """
        lifecycle.register()
        started = time.perf_counter()
        holding = self.hold(comm, save_dir)
        _refuse_non_persistent(persist)
        self.finish()
        if recorder is not None:
            recorder.flush()
        snap = replace(self.snapshot(comm, save_dir, tag, collect), min_generation=min_generation, lease=holding)
        manifest = self.persist(comm, snap, update_latest)
        if recorder is not None:
            start_chain(recorder, snap.store, snap.save_dir, manifest)
        seconds = time.perf_counter() - started
        self._saved(comm.rank, save_report(manifest, shown_dir(snap), seconds, seconds, False))
        self.last_committed = manifest
        return manifest

    @pausing
    def save_async(self, comm: Comm, save_dir: str, tag: str, collect: Callable[[], LocalState],
                   update_latest: bool = True, persist: Optional[bool] = None,
                   min_generation: int = 0) -> PendingSave:
        """Collectively snapshot this rank's state into reusable host buffers and return: hashing,
        the exchange, planning, writing and the commit (manifest, then ``latest``) run in the
        background (:class:`AsyncSaves`).  At most one save is in flight: this waits for the
        previous one first (and says so).  :meth:`poll` reports a finished one, :meth:`finish`
        waits for it; both raise or warn about a failure (``options.on_error``).

        Args:
            comm, save_dir, tag, collect, update_latest, persist, min_generation: as for
                :meth:`save`; ``collect``'s tensors are copied before this returns, and may
                change after.

        Returns:
            The :class:`PendingSave` in flight.
        """
        holding = self.hold(comm, save_dir)
        _refuse_non_persistent(persist)
        called = time.perf_counter()
        lifecycle.keep(self)       # finished at exit, before the interpreter tears down
        self.finish(waiting_for=tag)
        staging = self.background.ready(comm, self.options)
        snap = replace(self.snapshot(comm, save_dir, tag, collect, staging=staging), min_generation=min_generation,
                       lease=holding)
        return self.background.start(comm, snap, update_latest, self.options, dict(self.caches.trusted), self.persist,
                                     called)

    @property
    def pending(self) -> Optional[PendingSave]:
        """The asynchronous save in flight (None: none)."""
        return self.background.pending

    @property
    def writer(self):
        """This rank's writer process of asynchronous saves (None: none started)."""
        return self.background.writer

    def poll(self) -> Optional[Manifest]:
        """Cheap, at every training step: report the in-flight save if it has finished (its
        manifest; None while it runs or when none is in flight)."""
        if self.pending is None or not self.pending.done():
            return None
        return self.finish()

    def finish(self, waiting_for: Optional[str] = None) -> Optional[Manifest]:
        """Wait for the in-flight asynchronous save and report it: its manifest, or (it failed)
        a warning and None, or the error with ``on_error="raise"``.  ``waiting_for``: the tag
        of a new save that has to wait (logged with how long)."""
        pending = self.background.wait(waiting_for)
        if pending is None:
            return None
        if pending.error is not None:
            manifest = AsyncSaves.failed(pending, self.options.on_error)
            if manifest is not None:
                self.last_committed = manifest
            return manifest
        seconds = pending.finished - pending.started
        pending.manifest.stats["seconds"]["background"] = seconds
        self._saved(pending.rank, save_report(pending.manifest, pending.shown_dir, pending.stall,
                                              seconds + pending.stall, True))
        if pending.trusted is not None:      # the writer process's references, now this job's
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

    def configure(self, options: Options) -> None:
        """Other options from the next save or load on (the one in flight finishes first)."""
        self._check_tiers(options)
        if options != self.options:
            self.finish()
            self.options, self._stores = options, {}

    def close(self) -> None:
        """At exit (lifecycle): the in-flight save commits; a failure is logged; the writer
        process stops."""
        try:
            self.finish()
        except Exception as e:  # noqa: BLE001 - the interpreter is exiting
            log.warning("AdaCheck: the asynchronous save did not commit: %s", e)
        self.background.stop()



def check_writable(comm: Comm, store: Storage, path: str, save_dir: str) -> None:
    """Collectively, at start-up: every rank creates ``save_dir``, writes a small file into it
    through its storage and removes it again, so that a directory the job cannot write is
    found before training, not at the first save.  A ConfigError on every rank names each rank
    that could not, and why; nothing else in ``save_dir`` is touched.  ``path`` on ``store`` is
    ``save_dir`` as the user named it."""
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
    spread: Optional["DeltaSpread"] = None
    bridge: bool = False
    spares: Optional[str] = None


def start_chain(recorder, store: Storage, save_dir: str, manifest: Manifest) -> None:
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


def load(comm: Comm, load_dir: str, tag: Optional[str], read: Callable[[CheckpointReader], object],
         apply: Callable[[object], object] = lambda staged: staged, verify: bool = True, on_corrupt: str = "raise",
         store: Storage = LOCAL) -> LoadResult:
    """:meth:`Checkpointer.load` of this process's default job (DEFAULT_CACHES), with a
    :class:`~adacheck.integration.Restore` made of ``read`` and ``apply``."""
    return Checkpointer(store, Options(verify=verify, on_corrupt=on_corrupt), DEFAULT_CACHES).load(
        comm, load_dir, tag, Restore.of(read, apply))
