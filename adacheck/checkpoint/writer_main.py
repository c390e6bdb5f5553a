"""The writer process's side of :mod:`adacheck.checkpoint.writer_process`: started as
``python -c "...main(FD)"`` with FD one end of a socket pair, it meets the other writers of the
job, then persists one save at a time (hash, exchange, plan, write, commit) from the shared
staging arena, and answers with the manifest or the error, and the warnings raised."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import time
import warnings
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds

from . import staging
from .checkpointer import Checkpointer
from .steps import Snapshot
from ..errors import kind_of
from ..plan.exchange import describe_error, world_in_store


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the writer ends when its socket closes
        pass
    if os.getppid() != parent:           # the parent died before the line above
        os._exit(1)


def _serve(conn: Connection, sock: socket.socket) -> None:
    hello = conn.recv()
    _die_with_parent(hello["parent"])
    try:
        comm = world_in_store(hello["address"], hello["prefix"], hello["rank"], hello["world_size"],
                              hello["timeout_s"], hello["meet_s"])
    except Exception as e:  # noqa: BLE001 - a peer never came (it died as it started): the rank reports it
        job = conn.recv()
        if job is not None:
            conn.send({"error": ("", f"the AdaCheck writer processes did not meet within {hello['meet_s']:.0f}s "
                                     f"(one died as it started?): {describe_error(e)}"), "warnings": []})
        return
    ckp = Checkpointer()
    arena, mapping = None, None
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return                          # the rank is gone
        if job is None:
            return
        if job.new_arena:
            fd = recvfds(sock, 1)[0]
            arena = mapping = None
            arena, mapping = staging.map_shared(fd, job.arena_bytes)
            os.close(fd)
        ckp.configure(job.options)
        ckp.caches.trusted = dict(job.trusted)
        reply: dict = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                store, save_dir = ckp.locate(job.save_dir)
                shards = {(s.name, s.box): dataclasses.replace(s, tensor=staging.view(arena, slot))
                          for s, slot in zip(job.shards, job.slots)}
                snap = Snapshot(save_dir, job.tag, store.join(save_dir, job.tag), store, shards,
                                           job.objects, job.rank_objects, job.layout, job.framework, job.step,
                                           time.perf_counter() - job.seconds_before,
                                           min_generation=job.min_generation, lease=job.lease)
                reply["manifest"] = ckp.persist(comm, snap, job.update_latest)
                reply["trusted"] = dict(ckp.caches.trusted)
            except Exception as e:  # noqa: BLE001 - sent to the rank, which reports it
                reply["error"] = (kind_of(e), describe_error(e))
        reply["warnings"] = [(f"{w.category.__module__}:{w.category.__qualname__}", str(w.message)) for w in caught]
        conn.send(reply)
        if "error" in reply:
            return      # this world may be broken (a peer died): every rank starts new writers


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd = int(argv[0])
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    try:
        _serve(conn, sock)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)     # no interpreter teardown racing gloo's threads, see adacheck.checkpoint.lifecycle

