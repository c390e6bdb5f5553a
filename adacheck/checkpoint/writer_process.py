"""The writer process of asynchronous saves (``async_writer: "process"``).

A training rank's background persist (hash, exchange, plan, write, commit: see
:mod:`adacheck.checkpoint`) competes with its training loop for the GIL when it runs in a thread.
Here it runs in a process of its own instead, one per rank, started with ``subprocess`` (a fresh
interpreter: not forked from a process holding CUDA and NCCL state, and not re-running the user's
training script as ``multiprocessing``'s spawn would):

- **Shared memory.**  The snapshot's host copies lie in one shared arena
  (:class:`adacheck.checkpoint.staging.Staging` with ``shared=True``, an anonymous ``memfd``).  Its file
  descriptor travels to the writer over the socket the two share, once per new arena; each save
  then sends only where each box lies, the objects and the layout.
- **Its own world.**  The writer processes of a job form a gloo world of their own, as many ranks
  as the job's, meeting in the training's own TCP store under a fresh prefix: no port to choose,
  and never the training's process groups or NCCL.
- **Lifecycle.**  One save in flight, as with the thread.  The writer dies with its rank
  (``PR_SET_PDEATHSIG``); a writer that died, or a save that failed, is replaced by new writers
  on every rank at the next save (all ranks agree on it).  At exit the save in flight commits and
  the writer is told to stop.

The rank's side (:class:`WriterProcess`) is used by :meth:`Checkpointer.save_async`; the
writer's is :mod:`adacheck.checkpoint.writer_main`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
import warnings
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from typing import Optional

from ..errors import KINDS as ERROR_KINDS
from ..errors import AdaCheckError
from ..plan.exchange import Comm, store_address

log = logging.getLogger("adacheck")

STOP_SECONDS = 30.0
# how long the writers of a job wait for each other to start: a writer that died as it started
# fails the save in flight on every rank after this, not after a collective's timeout
# $ADACHECK_WRITER_MEET_SECONDS: for clusters where starting an interpreter takes longer
MEET_SECONDS = 120.0
_CHILD = "import sys; from adacheck.checkpoint.writer_main import main; main(sys.argv[1:])"


@dataclasses.dataclass
class Job:
    """One save for the writer: the snapshot without its tensors (``shards``: LocalShard with
    ``tensor`` None, ``slots``: where each one's copy lies in the arena)."""
    save_dir: str
    tag: str
    shards: list
    slots: list
    objects: Optional[dict]
    rank_objects: dict
    layout: dict
    framework: dict
    step: Optional[int]
    update_latest: bool
    options: object
    trusted: dict
    seconds_before: float           # the snapshot's seconds (counted in the manifest's total)
    arena_bytes: int
    new_arena: bool                 # its file descriptor follows the message
    min_generation: int = 0         # Snapshot.min_generation
    lease: Optional[object] = None  # Snapshot.lease: rank 0's, checked before the manifest and 'latest'


class WriterProcess:
    """This rank's writer process.  Collective: every rank of ``comm`` creates its own at the
    same point (``nonce``: rank 0's, the same on every rank)."""

    def __init__(self, comm: Comm, nonce: str, address, timeout_s: float):
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the folder that holds the adacheck package (this file is adacheck/checkpoint/writer_process.py)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.conn = Connection(os.dup(ours.fileno()))
        self.failed = False
        self.generation = None        # of the staging arena the writer has mapped
        meet_s = float(os.environ.get("ADACHECK_WRITER_MEET_SECONDS", MEET_SECONDS))
        self.conn.send({"rank": comm.rank, "world_size": comm.world_size, "prefix": f"adacheck-writer/{nonce}/",
                        "address": address, "timeout_s": timeout_s, "meet_s": meet_s, "parent": os.getpid()})

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def died(self) -> str:
        code = self.proc.poll()
        how = "is running" if code is None else (f"was killed by signal {-code}" if code < 0 else f"exited with {code}")
        return f"the AdaCheck writer process (pid {self.proc.pid}) {how}"

    def persist(self, snap, staging, update_latest: bool, options, trusted: dict):
        """Run the persist of ``snap`` (staged in ``staging``) in the writer; returns (manifest,
        the writer's trusted checkpoints).  Raises the writer's error, or says that it died."""
        new_arena = self.generation != staging.generation
        shards = [dataclasses.replace(s, tensor=None) for s in snap.shards.values()]
        job = Job(snap.given_dir, snap.tag, shards, list(staging.slots), snap.objects, snap.rank_objects,
                  snap.layout, snap.framework, snap.step, update_latest, options, dict(trusted),
                  time.perf_counter() - snap.started, staging.nbytes, new_arena, snap.min_generation, snap.lease)
        try:
            self.conn.send(job)
            if new_arena:
                sendfds(self.sock, [staging.fd])
                self.generation = staging.generation
            reply = self.conn.recv()
        except (EOFError, OSError) as e:
            self.failed = True
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            raise AdaCheckError(f"{self.died()} during the save of {snap.ckpt_dir} ({type(e).__name__}: {e}); "
                                "new writers are started at the next save") from None
        for category, message in reply.get("warnings", ()):
            warnings.warn(message, _category(category), stacklevel=2)
        if "error" in reply:
            self.failed = True
            kind, message = reply["error"]
            if kind not in ERROR_KINDS:     # a collective of the writers' world failed: a writer died?
                message = (f"{message}\nin the AdaCheck writer process (pid {self.proc.pid}), whose world "
                           f"lost a peer or failed; checkpoint {snap.tag!r} was not published, and new "
                           "writers are started at the next save")
            raise ERROR_KINDS.get(kind, AdaCheckError)(message)
        return reply["manifest"], reply["trusted"]

    def stop(self) -> None:
        """Tell the writer to exit (no save is in flight) and wait for it; kill it if it hangs."""
        try:
            if self.alive:
                self.conn.send(None)
                self.proc.wait(timeout=STOP_SECONDS)
        except (OSError, EOFError, subprocess.TimeoutExpired):
            log.warning("AdaCheck: %s did not stop when asked; killing it", self.died())
            self.proc.kill()
            self.proc.wait()
        finally:
            self.conn.close()
            self.sock.close()


def _category(where: str):
    """The warning class named ``module:qualname`` (the writer's), as this process has it."""
    module, _, name = where.partition(":")
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning


def start(comm: Comm, old: Optional[WriterProcess], timeout_s: float = 1800.0):
    """(this rank's writer for the next save, None) where every rank can have one: ``old`` if
    every rank's writer is alive and sound, else new writers on every rank; or (None, why not)
    on every rank when some rank cannot (no ``memfd`` there; a job that did not meet in a TCP
    store).  Collective."""
    sound = old is not None and old.alive and not old.failed
    nonce = uuid.uuid4().hex if comm.rank == 0 else None
    address = store_address() if comm.rank == 0 and comm.world_size > 1 else None
    memfd = hasattr(os, "memfd_create")
    gathered = comm.all_gather_object((sound, nonce, address, memfd))
    why = None
    if not all(g[3] for g in gathered):
        why = "writer processes need Linux (memfd_create)"
    elif comm.world_size > 1 and gathered[0][2] is None:
        why = ("writer processes meet in the job's TCP store, and this job's process group met in another "
               "kind (torchrun, or init_process_group with env:// or tcp://, have one)")
    if why is not None:
        if old is not None and old.alive:
            old.stop()
        return None, f"{why}; set \"async_writer\": \"thread\" to say so"
    if all(g[0] for g in gathered):
        return old, None
    if old is not None:
        if old.alive:
            old.stop()
        elif not old.failed:
            log.warning("AdaCheck: %s; starting a new one", old.died())
        log.info("AdaCheck: starting new writer processes (one on every rank)")
    return WriterProcess(comm, gathered[0][1], gathered[0][2], timeout_s), None
