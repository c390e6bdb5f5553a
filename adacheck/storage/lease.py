"""One writer per save directory: the lease a job takes at its first save there.

Two jobs saving into one directory destroy each other's checkpoints (a re-saved tag's files
share names; one job's clean-up removes the files of the other's save in flight).  So a
directory has one owner at a time:

- the lease is a small JSON file, ``<save_dir>/.adacheck-lease.json``, written through the
  directory's :class:`~adacheck.storage.backends.Storage` (POSIX, an object store, the memory tier's
  durable directory alike).  It names the job (``$ADACHECK_JOB``, else torchrun's run id, else
  an id rank 0 makes), the incarnation of that job (one per run of rank 0's process), the host
  and pid of rank 0, when it was acquired and last renewed, its time to live and a *generation*
  (the fencing token: it grows by one at every change of owner);
- rank 0 takes it at the job's first save into the directory and renews it at every save and
  from a timer every third of its time to live; it is removed when the job's process exits;
- another job's save is refused (:class:`~adacheck.errors.LeaseError`, on every rank) while the
  lease is live, unless it takes over: explicitly (``takeover``), or on its own once the lease
  has expired (not renewed within its ``ttl_s``: the owner died), or because it is the same job
  (the same ``$ADACHECK_JOB`` / run id: a restart) in another incarnation;
- the owner checks its generation before it writes a manifest and before it writes ``latest``:
  a job whose lease was taken over fails its save there and publishes nothing.

Expiry compares the lease's renewal time (the owner's clock) with the reader's clock: hosts must
agree on the time to well within ``ttl_s``.  Loads take no lease: a job that only reads (an
evaluation beside training) reads committed checkpoints as before.

Acquisition is read, write, read again after a pause: storage without a conditional write (POSIX
rename, S3) cannot refuse the second of two writers, so each one reads back what stayed; of two
jobs that start their first saves within the same few milliseconds one fails at its first
publish instead of its first save (its generation is not the one on storage)."""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Dict, Optional, Tuple

from ..errors import FormatError, LeaseError
from .backends import Storage

log = logging.getLogger("adacheck")

LEASE_NAME = ".adacheck-lease.json"
DEFAULT_TTL_S = 120.0
VERSION = 1
SETTLE_MIN_S, SETTLE_MAX_S = 0.05, 2.0     # the pause before an acquisition reads back what stayed


def node_id() -> str:
    """Which machine this process runs on, for leases and for placing copies: $ADACHECK_NODE if
    set (e.g. when containers share a host name), else the host name."""
    return os.environ.get("ADACHECK_NODE") or socket.gethostname()


# one incarnation per process: every Checkpointer of this process is the same run of the job
_PROCESS = {"incarnation": uuid.uuid4().hex[:16], "generated": None, "pid": os.getpid()}


JOB_ENV = "ADACHECK_JOB"


def named_job() -> Tuple[Optional[str], str]:
    """(the job's name, where it came from) where the job is named: ``$ADACHECK_JOB``, else
    torchrun's run id; (None, "") else."""
    job = os.environ.get(JOB_ENV)
    if job:
        return job, f"${JOB_ENV}"
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return run, "torchrun's run id ($TORCHELASTIC_RUN_ID)"
    return None, ""


def _this_process() -> dict:
    if _PROCESS["pid"] != os.getpid():      # a forked rank: a run of its own
        _PROCESS.update(incarnation=uuid.uuid4().hex[:16], generated=None, pid=os.getpid())
    return _PROCESS


def job_identity() -> Tuple[str, str]:
    """(this job's name, where it came from): ``$ADACHECK_JOB``, else torchrun's run id
    (``$TORCHELASTIC_RUN_ID``, not its default "none"), else one made for this process (rank 0's
    is the job's: it travels to the others with the lease decision)."""
    job, source = named_job()
    if job is not None:
        return job, source
    me = _this_process()
    if me["generated"] is None:
        me["generated"] = f"{node_id()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return me["generated"], "made by AdaCheck (no $ADACHECK_JOB or torchrun run id)"


def _zombie(pid: int) -> bool:
    """A process that has exited but was not reaped yet (Linux: state Z in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True)
class Lease:
    """What a lease file says (validated: every byte read is checked before use)."""
    job: str
    incarnation: str
    host: str
    pid: int
    acquired: float
    renewed: float
    ttl_s: float
    generation: int
    job_from: str = ""

    def __post_init__(self):
        for key in ("job", "incarnation", "host", "job_from"):
            if not isinstance(getattr(self, key), str):
                raise FormatError(f"lease field {key!r} must be a string, got {getattr(self, key)!r}")
        for key in ("pid", "generation"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise FormatError(f"lease field {key!r} must be an integer >= 0, got {v!r}")
        for key in ("acquired", "renewed", "ttl_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise FormatError(f"lease field {key!r} must be a finite number >= 0, got {v!r}")

    def expired(self, now: float) -> bool:
        return now > self.renewed + self.ttl_s or self.owner_gone()

    def owner_gone(self) -> bool:
        """Its rank 0 ran on this host and that process is gone (a crashed or killed job restarted
        on the same machine): the lease is dead now, not only once its time to live has passed.
        (A pid reused by another process only makes this wait for the expiry.)"""
        if self.host != node_id() or self.pid <= 0 or self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:     # alive, another user's
            return False
        return _zombie(self.pid)

    def to_bytes(self) -> bytes:
        return json.dumps({"adacheck_lease": VERSION, "job": self.job, "job_from": self.job_from,
                           "incarnation": self.incarnation, "host": self.host, "pid": self.pid,
                           "acquired": self.acquired, "renewed": self.renewed, "ttl_s": self.ttl_s,
                           "generation": self.generation}, indent=1).encode("utf-8") + b"\n"

    @classmethod
    def parse(cls, raw: bytes, where: str) -> "Lease":
        try:
            tree = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise FormatError(f"{where} is not a lease (not JSON: {e})") from None
        if not isinstance(tree, dict) or tree.get("adacheck_lease") != VERSION:
            raise FormatError(f"{where} is not an AdaCheck lease of version {VERSION}")
        try:
            return cls(**{k: tree[k] for k in ("job", "incarnation", "host", "pid", "acquired", "renewed", "ttl_s",
                                               "generation")}, job_from=tree.get("job_from", ""))
        except KeyError as e:
            raise FormatError(f"{where}: the lease has no {e.args[0]!r}") from None
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None

    def owner(self) -> str:
        return f"job {self.job!r} (rank 0 on host {self.host}, pid {self.pid})"


@dataclass(frozen=True)
class Holding:
    """A lease this job holds: where (``path`` on its storage), as which job and incarnation, at
    which generation (the fencing token checked before a manifest and ``latest`` are written)."""
    path: str
    save_dir: str
    job: str
    incarnation: str
    generation: int
    ttl_s: float


def lease_path(store: Storage, save_dir: str) -> str:
    return store.join(save_dir, LEASE_NAME)


def read(store: Storage, save_dir: str) -> Optional[Lease]:
    """The lease of ``save_dir`` (None: there is none); a FormatError when it is damaged."""
    path = lease_path(store, save_dir)
    try:
        raw = store.read_bytes(path, 1 << 16)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return Lease.parse(raw, path)


def live(store: Storage, save_dir: str, now: Optional[float] = None) -> Optional[Lease]:
    """The lease of ``save_dir`` if it has not expired (a damaged one counts as expired)."""
    try:
        lease = read(store, save_dir)
    except FormatError:
        return None
    now = time.time() if now is None else now
    return lease if lease is not None and not lease.expired(now) else None


def refusal(save_dir: str, lease: Lease, now: float) -> str:
    """Why this job may not save into ``save_dir``, and what to do."""
    job, source = job_identity()
    return (f"AdaCheck: the checkpoint directory {save_dir} belongs to another job: {lease.owner()} has held its "
            f"lease since {when(lease.acquired)} (generation {lease.generation}) and renewed it "
            f"{max(0.0, now - lease.renewed):.0f}s ago. This job ({job!r}, {source}) saves nothing there and "
            f"removes nothing there; its checkpoints are refused. A lease expires {lease.ttl_s:g}s after its last "
            f"renewal (its owner renews it while it runs: then it is at {when(lease.renewed + lease.ttl_s)}); a job "
            f"that finds it expired takes the directory over on its own. To take it over now, set \"takeover\": true "
            f"in the adacheck block (Megatron: --adacheck-takeover): the other job's next save then fails and 'latest' "
            f"stays this job's. To run both jobs, give this one another save_dir. Loading from {save_dir} stays "
            f"allowed (it reads committed checkpoints only).")


def taken_over(holding: Holding, lease: Optional[Lease], doing: str) -> str:
    """Why this job, which held ``holding``, may no longer write into its directory."""
    if lease is None:
        now = "its lease was removed (by hand, or by a job that took it over and ended)"
    else:
        now = (f"{lease.owner()} took the directory over at {when(lease.acquired)} (lease generation "
               f"{lease.generation}; this job held generation {holding.generation})")
    return (f"AdaCheck: {doing} into {holding.save_dir} is refused: {now}. This job ({holding.job!r}) no longer owns "
            f"the directory: 'latest' is left as the new owner wrote it and this job's checkpoints committed before "
            f"stay. Give this job another save_dir (or set \"takeover\": true to take the directory back).")


def decide(current: Optional[Lease], job: str, incarnation: str, takeover: bool, now: float,
           save_dir: str) -> Tuple[str, int]:
    """Pure: what a job does with ``current`` at a save: ("renew", its generation) when it is this
    incarnation's, ("acquire", the next generation) when there is none, it expired, it is the same
    job's earlier incarnation (a restart), or ``takeover``; else a LeaseError (:func:`refusal`)."""
    if current is None:
        return "acquire", 0
    if current.job == job and current.incarnation == incarnation:
        return "renew", current.generation
    if current.job == job or takeover or current.expired(now):
        return "acquire", current.generation + 1
    raise LeaseError(refusal(save_dir, current, now))


def acquire(store: Storage, save_dir: str, ttl_s: float, takeover: bool,
            settle: Callable[[float], None] = time.sleep) -> Tuple[Holding, Optional[Lease]]:
    """Rank 0, at a job's first save into ``save_dir`` (and to take it back after a takeover):
    take or renew its lease (:func:`decide`); returns (what this job holds, the lease it replaced
    when that was another job's or an earlier incarnation's).  An acquisition writes the lease,
    waits a little (three times what reading and writing took, 0.05-2 s) and reads it back: a
    LeaseError when another job's write stayed."""
    job, source = job_identity()
    incarnation, path = _this_process()["incarnation"], lease_path(store, save_dir)
    t0, now = time.perf_counter(), time.time()
    try:
        current = read(store, save_dir)
    except FormatError as e:
        log.warning("AdaCheck: %s; this job takes the directory's lease over", e)
        current = None
        store.remove(path)
    action, generation = decide(current, job, incarnation, takeover, now, save_dir)
    acquired = current.acquired if action == "renew" else now
    mine = Lease(job, incarnation, node_id(), os.getpid(), acquired, now, float(ttl_s), generation, source)
    store.make_dirs(save_dir)
    store.write_atomic(path, mine.to_bytes(), fsync=False)
    holding = Holding(path, save_dir, job, incarnation, generation, float(ttl_s))
    if action == "renew":
        return holding, None
    settle(min(max(3 * (time.perf_counter() - t0), SETTLE_MIN_S), SETTLE_MAX_S))
    stayed = read(store, save_dir)
    if stayed is None or (stayed.incarnation, stayed.generation) != (incarnation, generation):
        raise LeaseError(refusal(save_dir, stayed, time.time()) if stayed is not None else
                         f"AdaCheck: the lease of {save_dir} vanished while this job took it: another job or a person "
                         "is removing it. Save again, or give this job another save_dir")
    return holding, current


def check(store: Storage, holding: Holding, doing: str) -> Lease:
    """The fencing check, before a manifest or ``latest`` is written: the lease on storage is
    still ``holding``'s (the same incarnation and generation), returned; else a LeaseError."""
    try:
        lease = read(store, holding.save_dir)
    except FormatError:
        lease = None
    if lease is None or (lease.incarnation, lease.generation) != (holding.incarnation, holding.generation):
        raise LeaseError(taken_over(holding, lease, doing))
    return lease


def renew(store: Storage, holding: Holding) -> None:
    """Write ``holding``'s lease again with the time now (after :func:`check`)."""
    lease = check(store, holding, "a save")
    store.write_atomic(holding.path, Lease(lease.job, lease.incarnation, lease.host, lease.pid, lease.acquired,
                                           time.time(), holding.ttl_s, lease.generation, lease.job_from).to_bytes(),
                       fsync=False)


def release(store: Storage, holding: Holding) -> bool:
    """Remove ``holding``'s lease if it is still this job's; returns whether it was."""
    try:
        check(store, holding, "releasing the lease")
    except LeaseError:
        return False
    store.remove(holding.path)
    return True


class Leases:
    """The leases a job's Checkpointer holds, on rank 0: per directory, (storage, Holding).  One
    timer thread per process renews every live Leases' leases every third of their time to live;
    :meth:`close` (at exit, through :mod:`adacheck.checkpoint.lifecycle`) removes them."""

    exit_order = 2      # after the saves in flight and the memory tier's last copy

    def __init__(self):
        self.held: Dict[str, Tuple[Storage, Holding]] = {}
        self.lost: Dict[str, str] = {}      # directories taken over from this job: why (it never takes them back)
        self.lock = threading.Lock()

    def take(self, store: Storage, save_dir: str, ttl_s: float, takeover: bool) -> Holding:
        """Rank 0 at a save: this job's lease of ``save_dir``, renewed (a LeaseError when another job
        took it over since), or acquired at the job's first save there."""
        key = store.canonical(save_dir)
        with self.lock:
            if key in self.lost:
                raise LeaseError(self.lost[key])
            had = self.held.get(key)
            if had is not None and had[1].ttl_s == float(ttl_s):
                try:
                    renew(store, had[1])
                    return had[1]
                except LeaseError as e:
                    self.lose(key, str(e))
                    raise
            holding, replaced = acquire(store, save_dir, ttl_s, takeover and had is None)
            if replaced is not None:
                how = ("an earlier run of this job (a restart)" if replaced.job == holding.job else
                       "its lease had expired" if replaced.expired(time.time()) else "\"takeover\": true")
                log.warning("AdaCheck: this job (%r) took %s over from %s, whose lease was renewed at %s (%s)",
                            holding.job, save_dir, replaced.owner(), when(replaced.renewed), how)
            self.held[key] = (store, holding)
        _renewing(self)
        return holding

    def lose(self, key: str, why: str) -> None:
        """The lease of ``key`` was taken over: this job's saves there are refused from now on."""
        self.held.pop(key, None)
        self.lost[key] = why

    def fence(self, holding: Optional[Holding], store: Storage, doing: str) -> None:
        """Before a manifest or ``latest`` is written (rank 0): the lease is still ``holding``'s
        (:func:`check`; None: no lease to check); one taken over is lost for good."""
        if holding is not None:
            try:
                check(store, holding, doing)
            except LeaseError as e:
                self.lose(store.canonical(holding.save_dir), str(e))
                raise

    def fence_dir(self, store: Storage, save_dir: str, doing: str) -> None:
        """:meth:`fence` with the lease this job holds of ``save_dir`` (the memory tier's copies
        there, rank 0)."""
        key = store.canonical(save_dir)
        if key in self.lost:
            raise LeaseError(self.lost[key])
        held = self.held.get(key)
        self.fence(held[1] if held is not None else None, store, doing)

    def period(self) -> float:
        with self.lock:
            return min((h.ttl_s for _, h in self.held.values()), default=DEFAULT_TTL_S) / 3

    def renew_all(self) -> None:
        with self.lock:
            for key, (store, holding) in list(self.held.items()):
                try:
                    renew(store, holding)
                except LeaseError as e:
                    log.warning("%s", e)
                    self.lose(key, str(e))
                except Exception as e:  # noqa: BLE001 - a storage hiccup: the next renewal may succeed
                    log.warning("AdaCheck: could not renew the lease of %s: %s", holding.save_dir, e)

    def close(self) -> None:
        """Remove the leases this job still holds (it ends)."""
        with self.lock:
            for store, holding in self.held.values():
                try:
                    release(store, holding)
                except Exception as e:  # noqa: BLE001 - at exit: the lease then expires
                    log.warning("AdaCheck: could not remove the lease of %s: %s", holding.save_dir, e)
            self.held.clear()


_RENEWED: "weakref.WeakSet[Leases]" = weakref.WeakSet()
_TIMER = {"thread": None, "pid": None}
_WAKE = threading.Event()


def _renewing(leases: Leases) -> None:
    """Renew ``leases`` from this process's timer thread (started once per process)."""
    _RENEWED.add(leases)
    thread = _TIMER["thread"]
    if thread is None or not thread.is_alive() or _TIMER["pid"] != os.getpid():
        _TIMER["thread"] = threading.Thread(target=_renew_forever, name="adacheck-lease", daemon=True)
        _TIMER["pid"] = os.getpid()
        _TIMER["thread"].start()
    _WAKE.set()      # its period may be shorter now


def _renew_forever() -> None:
    while True:
        period = min((leases.period() for leases in list(_RENEWED)), default=DEFAULT_TTL_S / 3)
        if _WAKE.wait(period):
            _WAKE.clear()
            continue
        for leases in list(_RENEWED):
            leases.renew_all()
