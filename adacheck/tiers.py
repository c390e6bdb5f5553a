"""Checkpoint tiers: the memory tier in front of the checkpoint directory (the durable tier).

With ``tiers.memory`` every save is an ordinary AdaCheck checkpoint written into node-local memory
(``$ADACHECK_MEMORY_DIR``, ``tiers.memory_dir``, default ``/dev/shm/adacheck``), under the job's
identity and the checkpoint directory it stands for::

    <memory dir>/<job>/<key of the checkpoint directory>/<tag>/...

so a process killed by SIGKILL, or restarted by torchrun's elastic agent, finds it, and another
job never takes it for its own.  Every ``persist_interval``-th save is copied to the checkpoint
directory in the background, and the newest one at a clean exit (then the job's memory files
go).  The copy needs no collective: each rank copies the files it wrote and leaves a marker;
rank 0 writes the manifest once every writer's marker is there and every file has its size,
then ``latest``: the durable tier's commit protocol is the save's.  ``keep`` newest checkpoints
stay in memory (one being copied is kept too).

A load picks the newest checkpoint across the tiers (the memory tier on a tie: it is faster), the
same on every rank, and says which tier it read from.  All ranks of the job must run on one node
(the memory tier of one node is read by every rank); across nodes the peer tier is needed, which
is not built yet: such a job gets a ConfigError at its first save.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from . import commit
from .errors import AdaCheckError, ConfigError
from .manifest import parse
from .storage import LOCAL, Storage, copy_file

log = logging.getLogger("adacheck")

DEFAULT_MEMORY_DIR = "/dev/shm/adacheck"
MEMORY_ENV, JOB_ENV = "ADACHECK_MEMORY_DIR", "ADACHECK_JOB"
PERSIST_TIMEOUT_S = 600.0
SOURCE_NAME = "SOURCE"          # in a memory location: the checkpoint directory it stands for


def job_identity() -> Tuple[Optional[str], str]:
    """(the job's identity, where it came from): ``$ADACHECK_JOB``, else torchrun's run id."""
    job = os.environ.get(JOB_ENV)
    if job:
        return job, f"${JOB_ENV}"
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return run, "torchrun's run id ($TORCHELASTIC_RUN_ID)"
    return None, ""


def memory_root(configured: Optional[str]) -> str:
    return os.environ.get(MEMORY_ENV) or configured or DEFAULT_MEMORY_DIR


def durable_key(store: Storage, save_dir: str) -> str:
    """The checkpoint directory ``save_dir`` on ``store``, as one string (kept in SOURCE_NAME)."""
    return f"{store.describe()}|{store.canonical(save_dir)}"


def memory_location(store: Storage, save_dir: str, memory_dir: Optional[str] = None) -> str:
    """Where this job's memory tier keeps the checkpoints of ``save_dir`` (on ``store``)."""
    job, _ = job_identity()
    if job is None:
        raise ConfigError(f"the memory tier keeps a job's checkpoints under the job's identity, and this job has "
                          f"none: set ${JOB_ENV} (the same value for a restarted job) or start it with torchrun")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job)[:100] or "_"
    key = hashlib.sha256(durable_key(store, save_dir).encode()).hexdigest()[:16]
    return os.path.join(memory_root(memory_dir), safe, key)


def _marker(rank: int) -> str:
    return f".persisted-rank{rank:05d}"


def persist_checkpoint(rank: int, src_dir: str, dst_store: Storage, dst_dir: str, tag: str, fsync: bool,
                       update_latest: bool, keep_last: Optional[int], confirm: Callable,
                       timeout_s: float = PERSIST_TIMEOUT_S) -> bool:
    """Copy this rank's files of the committed memory checkpoint ``src_dir`` to ``dst_dir/tag``
    on ``dst_store``; rank 0 then commits it there (manifest, ``latest``, retention).  No
    collective: rank 0 waits for every writer's marker (up to ``timeout_s``).  Returns whether
    this rank's part is done (rank 0: whether the checkpoint was committed)."""
    path = LOCAL.join(src_dir, commit.MANIFEST_NAME)
    manifest_bytes = LOCAL.read_bytes(path)
    nonce = hashlib.sha256(manifest_bytes).hexdigest()
    manifest = parse(manifest_bytes.decode("utf-8"), where=path)
    dst = dst_store.join(dst_dir, tag)
    dst_store.make_dirs(dst)
    writers = sorted({int(info["writer"]) for info in manifest.files.values()})
    for fname, info in sorted(manifest.files.items()):
        if int(info["writer"]) == rank:
            copy_file(LOCAL, LOCAL.join(src_dir, fname), dst_store, dst_store.join(dst, fname), fsync=fsync)
    if rank in writers:
        dst_store.write_atomic(dst_store.join(dst, _marker(rank)), nonce.encode(), fsync=fsync)
    if rank != 0:
        return True
    deadline = time.monotonic() + timeout_s
    waiting = list(writers)
    while waiting:
        waiting = [r for r in waiting if not _marked(dst_store, dst, r, nonce)]
        if not waiting:
            break
        if time.monotonic() > deadline:
            log.warning("AdaCheck: %s was not persisted to %s: ranks %s did not copy their files within %.0fs; "
                        "it stays in the memory tier", tag, dst_dir, waiting, timeout_s)
            return False
        time.sleep(0.05)
    confirm(dst_store, dst, {f: dict(info) for f, info in manifest.files.items()})
    commit.write_manifest(dst, manifest, dst_store)
    for r in writers:
        dst_store.remove(dst_store.join(dst, _marker(r)))
    if update_latest:
        commit.write_latest(dst_dir, tag, dst_store)
    if keep_last:
        latest = commit.read_latest(dst_dir, dst_store)
        commit.apply_retention(dst_dir, keep_last, protect=(tag,) + ((latest,) if latest else ()), store=dst_store)
    commit.collect_garbage(dst_dir, store=dst_store)
    return True


def _marked(store: Storage, ckpt: str, rank: int, nonce: str) -> bool:
    try:
        return store.read_bytes(store.join(ckpt, _marker(rank))).decode() == nonce
    except (FileNotFoundError, UnicodeDecodeError):
        return False


def newest_committed(save_dir: str, store: Storage) -> Optional[Tuple[str, int]]:
    """(tag, step) of the newest complete checkpoint in ``save_dir`` (by step), or None."""
    best = None
    if not store.is_dir(save_dir):
        return None
    for t, m, _ in commit.list_checkpoints(save_dir, store):
        if m is not None:
            step = m.step if m.step is not None else -1
            if best is None or step > best[1]:
                best = (t, step)
    return best


def held_in(mem: str) -> Tuple[int, int]:
    """(complete checkpoints, bytes of every file) in a memory location."""
    count = sum(1 for _, m, _ in commit.list_checkpoints(mem, LOCAL) if m is not None) if os.path.isdir(mem) else 0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(mem) for f in fs)
    return count, size


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
        self.persisted: set = set()               # (durable key, tag) committed to durable storage
        self.persisting: Optional[str] = None     # the tag being copied
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.rank = 0
        self.one_node = False

    # ------------------------------------------------------------------ where
    def location(self, store: Storage, save_dir: str) -> str:
        return memory_location(store, save_dir, self.config.memory_dir)

    def _check_one_node(self, comm) -> None:
        if self.one_node:
            return
        nodes = sorted(set(comm.all_gather_object(self.node_id())))
        if len(nodes) > 1:
            raise ConfigError(f"adacheck.tiers.memory: the ranks of this job run on {len(nodes)} nodes ({', '.join(nodes[:4])}"
                              f"{', ...' if len(nodes) > 4 else ''}); the memory tier needs them on one node until "
                              "the peer tier is built: turn tiers.memory off for this job")
        self.one_node = True

    # ------------------------------------------------------------------ save
    def save(self, comm, store: Storage, save_dir: str, tag: str, collect, update_latest: bool,
             asynchronous: bool = False):
        """Save ``tag`` into the memory tier (``asynchronous``: return after the snapshot, the
        memory copy is written behind training as an async save); every ``persist_interval``-th
        is then copied to the checkpoint directory."""
        self._check_one_node(comm)
        self.rank = comm.rank
        mem = self.location(store, save_dir)
        durable = durable_key(store, save_dir)
        if comm.rank == 0 and not os.path.exists(os.path.join(mem, SOURCE_NAME)):
            os.makedirs(mem, exist_ok=True)
            LOCAL.write_atomic(os.path.join(mem, SOURCE_NAME), durable.encode(), fsync=False)
        if self.thread is not None and not self.thread.is_alive():
            self._end_copy()        # (a copy that ended: reported now, and no longer kept from retention)
        t0 = time.perf_counter()
        self.memory.finish(waiting_for=tag)     # (the previous memory save, if it was asynchronous)
        if asynchronous:
            self._retain(mem, ())         # (before the new save's files exist: nothing in flight now)
            self.memory.save_async(comm, mem, tag, collect, update_latest=True)
            manifest = None
        else:
            manifest = self.memory.save(comm, mem, tag, collect, update_latest=True)
            self._retain(mem, (tag,))
        n = self.saves[durable] = self.saves.get(durable, 0) + 1
        self.newest[durable] = (mem, tag, store, save_dir, update_latest)
        log.info("AdaCheck: %s %s the memory tier (%s) in %.2fs", tag,
                 "snapshotted for" if asynchronous else "saved to", mem, time.perf_counter() - t0)
        if comm.rank == 0 and log.isEnabledFor(logging.INFO):
            held = held_in(mem)
            log.info("AdaCheck: the memory tier holds %d checkpoint(s) of %s, %.1f MB (keep: %d)", held[0], save_dir,
                     held[1] / 1e6, self.config.keep)
        if n % self.config.persist_interval == 0:
            self.start_persist(durable)
        return manifest

    def _retain(self, mem: str, protect: tuple) -> None:
        """Rank 0: the newest ``keep`` memory checkpoints stay (and ``protect``, and the one being
        copied to durable storage); the others' files are deleted.  Only while no memory save is
        in flight (its files have no manifest yet)."""
        if self.rank == 0:
            protect = protect + ((self.persisting,) if self.persisting else ())
            commit.apply_retention(mem, self.config.keep, protect=protect, store=LOCAL)
            commit.collect_garbage(mem, store=LOCAL)

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
        in_memory = self.memory.pending       # (an asynchronous memory save of tag: committed first)

        def run():
            t = time.perf_counter()
            try:
                if in_memory is not None:
                    in_memory.thread.join()
                    if in_memory.error is not None:
                        log.warning("AdaCheck: %s is not copied to %s: its memory save failed", tag, save_dir)
                        return
                if persist_checkpoint(rank, os.path.join(mem, tag), store, save_dir, tag, self.fsync, update_latest,
                                      self.keep_last, self.confirm):
                    self.persisted.add((durable, tag))
                    log.info("AdaCheck: %s persisted to %s in %.2fs (background)", tag, save_dir, time.perf_counter() - t)
            except BaseException as e:  # noqa: BLE001 - reported by finish on the training thread
                self.error = e

        self.thread = threading.Thread(target=run, name=f"adacheck-persist-{tag}", daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """Wait for the copy to durable storage in flight; a failure is a warning (or raises with
        on_error "raise"): the checkpoint stays in memory, the durable tier as it was.  An
        asynchronous memory save in flight commits first (then the memory tier is trimmed to
        ``keep`` again)."""
        if self.memory.pending is not None:
            self.memory.finish()
            for mem, tag, *_ in list(self.newest.values()):
                self._retain(mem, (tag,))
        self._end_copy()

    def _end_copy(self) -> None:
        """Wait for the copy to durable storage in flight (only that) and report it."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        tag, self.persisting = self.persisting, None
        e, self.error = self.error, None
        if e is not None:
            if self.on_error == "raise" and isinstance(e, AdaCheckError):
                raise e
            log.warning("AdaCheck: copying %s from the memory tier to durable storage failed; it stays in memory "
                        "and the checkpoint directory is as it was: %s", tag, e)

    # ------------------------------------------------------------------ load
    def choose(self, comm, store: Storage, load_dir: str, tag: Optional[str]) -> Tuple[Storage, str, str]:
        """(storage, directory, tier) to load from: the memory tier when it holds ``tag`` (or,
        without one, a checkpoint at least as new as durable storage's newest), else the
        checkpoint directory; decided by rank 0 for every rank."""
        self.finish()
        mem = self.location(store, load_dir)

        def decide():
            if tag is not None:
                in_memory = commit.has_manifest(os.path.join(mem, str(tag)), LOCAL)
                return ("memory", None) if in_memory else ("durable", None)
            m = newest_committed(mem, LOCAL)
            latest = commit.latest_or_none(load_dir, store) if store.is_dir(load_dir) else None
            d_step = -1
            if latest is not None:
                try:
                    step = commit.read_manifest(store.join(load_dir, latest), store).step
                    d_step = step if step is not None else -1
                except AdaCheckError:
                    d_step = -1
            if m is not None and m[1] >= d_step:
                return "memory", m
            return "durable", m

        where, m = comm.broadcast_object(decide() if comm.rank == 0 else None)
        if where == "memory":
            log.info("AdaCheck: loading from the memory tier (%s) instead of %s", mem, load_dir)
            return LOCAL, mem, "memory"
        if m is None:
            log.warning("AdaCheck: the memory tier holds no checkpoint of %s for this job (%s); loading from "
                        "durable storage", load_dir, mem)
        else:
            log.warning("AdaCheck: the memory tier's newest checkpoint of %s (%s, step %s) is older than durable "
                        "storage's; loading from durable storage", load_dir, m[0], m[1])
        return store, load_dir, "durable"

    # ------------------------------------------------------------------ exit
    def close(self) -> None:
        """At a clean exit: the copy in flight finishes, the newest memory checkpoint of each
        checkpoint directory is persisted if it was not, then (rank 0, once committed) the job's
        memory files of that directory go.  No collective (see persist_checkpoint)."""
        try:
            self.finish()
        except Exception as e:  # noqa: BLE001 - the interpreter is exiting
            log.warning("AdaCheck: %s", e)
        for durable, (mem, tag, store, save_dir, update_latest) in list(self.newest.items()):
            done = (durable, tag) in self.persisted
            if not done:
                try:
                    done = persist_checkpoint(self.rank, os.path.join(mem, tag), store, save_dir, tag, self.fsync,
                                              update_latest, self.keep_last, self.confirm, timeout_s=120.0)
                    if done and self.rank == 0:
                        log.info("AdaCheck: %s persisted to %s at exit", tag, save_dir)
                except Exception as e:  # noqa: BLE001 - the interpreter is exiting: keep the memory copy
                    log.warning("AdaCheck: at exit, %s could not be persisted to %s; it stays in the memory tier (%s): %s",
                                tag, save_dir, mem, e)
                    done = False
            if done and self.rank == 0:
                LOCAL.remove_tree(mem)
                parent = os.path.dirname(mem)
                try:
                    os.rmdir(parent)      # (the job's directory, once it is empty)
                except OSError:
                    pass
        self.newest.clear()
        self.memory.close()       # (its writer process, if any, stops)
