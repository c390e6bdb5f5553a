"""A job's asynchronous saves (:class:`AsyncSaves`): at most one in flight (:class:`PendingSave`),
its persist running in a thread of this process or in the rank's writer process, reported (or
its failure said as it is on storage) when it ends."""
from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Callable, Dict, Optional

from ..errors import AdaCheckError, LeaseError, SaveWarning
from ..format.manifest import MANIFEST_NAME
from ..plan.exchange import Comm, background_comm
from ..storage import commit
from ..storage import manifest_files
from ..types import Manifest
from . import writer_process
from .options import Options
from .steps import Snapshot, shown_dir
from .staging import Staging

log = logging.getLogger("adacheck")

UNKNOWN = object()


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
        self.manifest_before = None     # what identified a manifest already there, or UNKNOWN
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
            return manifest_files.read_manifest(self.ckpt_dir, self.store)
        except (AdaCheckError, OSError):
            return None


class AsyncSaves:
    """The asynchronous saves of one job: the save in flight (``pending``, at most one), the host
    buffers snapshots are copied into (``staging``, reused from one save to the next), and where
    their persist runs: this rank's writer process (``writer``; ``options.writer`` "process") or a
    thread of this process on a gloo group of its own."""

    def __init__(self):
        self.staging = Staging()
        self.pending: Optional[PendingSave] = None
        self.writer: Optional["writer_process.WriterProcess"] = None
        self.no_writer: Optional[str] = None    # why this job cannot have writer processes
        self.comm: Optional[Comm] = None        # the thread's group (made at the first save persisted in one)

    def ready(self, comm: Comm, options: Options) -> Staging:
        """Collectively, before a snapshot: the writer processes started (once; a job that cannot
        have them persists in a thread, with a warning) or the thread's group made; returns the
        buffers to copy the snapshot into (shared memory when a writer process reads them)."""
        if options.writer == "process" and self.no_writer is None:
            self.writer, self.no_writer = writer_process.start(comm, self.writer)
            if self.no_writer is not None:
                log.warning("AdaCheck: asynchronous saves persist in a thread: %s", self.no_writer)
        if self.in_process(options):
            if not self.staging.shared:
                self.staging.release()
                self.staging = Staging(shared=True)
        elif self.comm is None:
            self.comm = background_comm(comm)
        return self.staging

    def in_process(self, options: Options) -> bool:
        return options.writer == "process" and self.writer is not None

    def start(self, comm: Comm, snap: Snapshot, update_latest: bool, options: Options, trusted: Dict[str, str],
              persist: Callable[[Comm, Snapshot, bool], Manifest], called: float) -> PendingSave:
        """Persist ``snap`` in the background (``persist`` in a thread, else the writer process with
        the job's ``trusted`` references); ``called``: when the save call began (its stall)."""
        pending = PendingSave(snap, update_latest)
        pending.rank, pending.shown_dir = comm.rank, shown_dir(snap)
        in_process, background, writer, staging = self.in_process(options), self.comm, self.writer, self.staging

        def run():
            try:
                pending.manifest_before = pending.manifest_stamp()
            except Exception:  # noqa: BLE001 - then a failure is not told apart from a commit (said as before)
                pending.manifest_before = UNKNOWN
            try:
                if not in_process:
                    pending.manifest = persist(background, snap, update_latest)
                    return
                if snap.ready is not None:
                    snap.ready()        # the device-to-host copies have landed
                pending.manifest, pending.trusted = writer.persist(snap, staging, update_latest, options, trusted)
            except BaseException as e:  # noqa: BLE001 - reported by wait / failed on the caller's thread
                pending.error = e
            finally:
                pending.finished = time.perf_counter()

        pending.thread = threading.Thread(target=run, name=f"adacheck-persist-{snap.tag}", daemon=True)
        self.pending = pending
        pending.thread.start()
        pending.stall = time.perf_counter() - called
        return pending

    def wait(self, waiting_for: Optional[str] = None) -> Optional[PendingSave]:
        """The save in flight, once it has ended (None: none was); ``waiting_for``: the tag of a
        new save that has to wait (logged with how long)."""
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
        return pending

    @staticmethod
    def failed(pending: PendingSave, on_error: str) -> Optional[Manifest]:
        """A save that failed, said as it is on storage; returns its manifest when it counts as
        committed.  Failed before its commit: the previous checkpoint is the newest.  After it (its
        manifest is there): it counts as committed when ``latest`` names it too, else it loads by
        its tag only.  A save refused because another job took the directory over committed
        nothing (a manifest there now is the other job's, perhaps of the same tag).  Raises
        instead of warning with ``on_error`` "raise"."""
        error = pending.error
        manifest = None if isinstance(error, LeaseError) else pending.committed_all_the_same()
        if manifest is None:
            if on_error == "raise":
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
            return manifest
        said += (f"'latest' names {repr(latest) if latest else 'no intact checkpoint'}, not this one: load "
                 f"{pending.tag!r} by its tag, or write {pending.tag} into "
                 f"{pending.store.join(pending.save_dir, commit.LATEST)}")
        if on_error == "raise":
            error.args = (said,)
            raise error
        warnings.warn(said + " (on_error: warn; training goes on)", SaveWarning, stacklevel=4)
        return None

    def stop(self) -> None:
        """The writer process stops (at exit)."""
        if self.writer is not None:
            self.writer.stop()
            self.writer = None
