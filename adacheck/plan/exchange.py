"""The only module that calls torch.distributed.

``Comm`` is the small interface the rest of AdaCheck uses; ``agree`` turns a local
step into a collective one: every rank runs it, one small reduction says whether any rank
failed (the errors are gathered only then), and if any rank failed every rank raises the
same DistributedError naming each cause (also an
instance of the AdaCheck error class every failing rank raised, when they agree).  A rank
that fails therefore never leaves the others waiting in a later collective.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import traceback
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..errors import AdaCheckError, ConfigError, DistributedError, kind_of

GATHERS = ("ring", "allgather")                 # how all_gather_bytes moves the blocks
EXCHANGES = ("auto",) + GATHERS + ("partitioned",)     # how a save shares what the ranks hold (adacheck.plan.partition)
PARTITIONED_FROM = 32       # "auto": the ring below this many ranks, the partitioned exchange from here on


def exchange_for(how: str, world_size: int) -> str:
    """The exchange a save of ``world_size`` ranks runs for the configured ``how``: "auto" is the
    ring (one manifest file, every rank plans the whole job) below PARTITIONED_FROM ranks, and the
    partitioned exchange from there on (what a rank sends, plans and reads follows its own boxes;
    the whole-job plan's time grows with the job: scripts/bench_plan.py)."""
    if how == "auto":
        return "partitioned" if world_size >= PARTITIONED_FROM else "ring"
    return how


class Comm:
    rank: int = 0
    world_size: int = 1

    def all_gather_object(self, obj: Any) -> List[Any]:
        raise NotImplementedError

    def all_gather_bytes(self, data: bytes, how: str = "ring") -> List[bytes]:
        """Every rank's ``data``, in rank order, on every rank.

        ``ring``: N-1 steps of send-to-next / receive-from-previous, so each rank sends and
        receives each other rank's block once and nothing funnels through one rank;
        ``allgather``: one collective over blocks padded to the longest.
        """
        if how not in GATHERS:
            raise ValueError(f"unknown exchange {how!r}; expected one of {GATHERS}")
        return [data]

    def all_to_all_bytes(self, blocks: Sequence[Optional[bytes]]) -> List[bytes]:
        """``blocks[r]`` (None or empty: nothing) to rank r, in one collective; returns the block
        each rank sent here, in rank order (empty where it sent nothing).  A rank receives what
        was sent to it only: its traffic is its own blocks', not the world's."""
        return [bytes(blocks[0] or b"")]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank (one small reduction)."""
        return bool(flag)

    def max_each(self, values: Sequence[int]) -> List[int]:
        """The elementwise maximum over the ranks of ``values`` (the same length on every rank)."""
        return [int(v) for v in values]

    def same(self, value: str) -> bool:
        """Whether every rank holds the same ``value`` (two small reductions of a 60-bit hash of it,
        whatever the world size)."""
        h = int(hashlib.sha256(value.encode("utf-8")).hexdigest()[:15], 16)
        high, low = self.max_each([h, -h])
        return high == -low

    def sum_each(self, values: Sequence[int]) -> List[int]:
        """The elementwise sum over the ranks of ``values`` (the same length on every rank)."""
        return [int(v) for v in values]

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[List[Any]]:
        """Every rank's ``obj`` on rank ``dst`` (in rank order); None on the others."""
        out = self.all_gather_object(obj)
        return out if self.rank == dst else None

    def bytes_received(self, sizes: List[int], how: str) -> int:
        """Bytes this rank receives in ``all_gather_bytes`` for blocks of ``sizes``."""
        n = len(sizes)
        if n == 1:
            return 0
        if how == "ring":
            return sum(sizes) - sizes[self.rank] + 8 * (n - 1)
        return (n - 1) * max(sizes) + 8 * (n - 1)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.all_gather_object(obj)[src]

    def transfer(self, moves: Sequence[Tuple[int, int]], read: Callable[[int], Any],
                 deliver: Callable[[int, Any], None], sizes: Optional[Sequence[int]] = None,
                 window_bytes: int = 1 << 30, into: Optional[Callable[[int, int], Any]] = None) -> int:
        """Point-to-point moves, the same list on every rank: move ``i`` = (source, destination)
        sends ``read(i)`` (bytes, or a uint8 CPU tensor) from the source rank to the destination,
        which gets ``deliver(i, data)``, a bytes-like object (None: the source could not read it;
        its error, or one raised by ``deliver``, is raised after every move, so no rank is left
        waiting).  The moves run in windows, the same on every rank: each holds consecutive moves of
        at most ``window_bytes`` by their expected ``sizes`` (one move each without them); in a
        window every rank starts all its sends and receives, then waits for them, so a window is
        like a collective and cannot deadlock.  ``into(i, nbytes)``: the uint8 tensor move ``i``
        is received into (default: new memory), which ``deliver`` has done with when it returns.
        Returns the bytes received here."""
        failed: List[BaseException] = []

        def guarded(fn, *args):
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 - raised after the moves (the others go on meanwhile)
                failed.append(e)
                return None

        windows, cur, cur_bytes = [], [], 0
        for i in range(len(moves)):
            size = sizes[i] if sizes is not None else window_bytes
            if cur and cur_bytes + size > window_bytes:
                windows.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += size
        if cur:
            windows.append(cur)
        got = 0
        for window in windows:
            outgoing = {}
            for i in window:
                src, dst = moves[i]
                if src == self.rank:
                    data = guarded(read, i)      # None: the destination is told, size -1
                    if dst == self.rank:
                        data = data.numpy() if hasattr(data, "numpy") else data     # a tensor, as received
                        guarded(deliver, i, data)
                        got += 0 if data is None else len(data)
                    else:
                        outgoing[i] = data
            incoming = [i for i in window if moves[i][1] == self.rank and moves[i][0] != self.rank]
            received = self._exchange_blocks([(moves[i][1], d) for i, d in outgoing.items()],
                                             [moves[i][0] for i in incoming],
                                             into and (lambda k, n, ids=incoming: into(ids[k], n))) \
                if outgoing or incoming else []
            for i, data in zip(incoming, received):
                got += 0 if data is None else len(data)
                guarded(deliver, i, data)
        if failed:
            raise failed[0]
        return got

    def _exchange_blocks(self, sends, recv_from, into=None) -> list:
        """Send each (rank, data) of ``sends`` and receive one block from each rank of
        ``recv_from`` (in order), all at once: the received blocks (None: the source had none),
        the k-th into ``into(k, nbytes)`` where given."""
        raise NotImplementedError("a world of one moves nothing between ranks")

    def barrier(self) -> None:
        self.all_gather_object(None)


class SoloComm(Comm):
    """A world of one process (no process group needed)."""

    def all_gather_object(self, obj):
        return [obj]


class TorchComm(Comm):
    """torch.distributed over ``group`` (default: the world)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self):
        self._dist.barrier(group=self.group)

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

    def gather_object(self, obj, dst: int = 0):
        out = [None] * self.world_size if self.rank == dst else None
        self._dist.gather_object(obj, out, dst=self._global(dst), group=self.group)
        return out

    def any(self, flag: bool) -> bool:
        return self.max_each([int(bool(flag))])[0] > 0

    def max_each(self, values):
        return self._reduce(values, self._dist.ReduceOp.MAX)

    def sum_each(self, values):
        return self._reduce(values, self._dist.ReduceOp.SUM)

    def _reduce(self, values, op):
        import torch
        t = torch.tensor(list(values), dtype=torch.int64)
        self._dist.all_reduce(t, op=op, group=self.group)
        return [int(v) for v in t]

    def all_to_all_bytes(self, blocks):
        import torch
        n = self.world_size
        if n == 1:
            return [bytes(blocks[0] or b"")]
        sizes = torch.tensor([len(b or b"") for b in blocks], dtype=torch.int64)
        incoming = torch.empty(n, dtype=torch.int64)
        self._dist.all_to_all_single(incoming, sizes, group=self.group)
        send = torch.frombuffer(bytearray(b"".join(b or b"" for b in blocks)) or bytearray(1), dtype=torch.uint8)
        recv = torch.empty(max(int(incoming.sum()), 1), dtype=torch.uint8)
        self._dist.all_to_all_single(recv[:int(incoming.sum())], send[:int(sizes.sum())],
                                     output_split_sizes=incoming.tolist(), input_split_sizes=sizes.tolist(),
                                     group=self.group)
        out, at = [], 0
        for k in incoming.tolist():
            out.append(bytes(recv[at:at + k].numpy()))
            at += k
        return out

    def _global(self, r: int) -> int:
        return r if self.group is None else self._dist.get_global_rank(self.group, r)

    def _sendrecv(self, out, to: int, into, frm: int) -> None:
        reqs = []
        if out.numel():
            reqs.append(self._dist.isend(out, self._global(to), group=self.group))
        if into.numel():
            reqs.append(self._dist.irecv(into, self._global(frm), group=self.group))
        for q in reqs:
            q.wait()

    def _exchange_blocks(self, sends, recv_from, into=None) -> list:
        import torch
        d = self._dist
        # sizes first (-1: nothing follows), then the data; every send and receive started before any wait
        heads_in = [torch.zeros(1, dtype=torch.int64) for _ in recv_from]
        reqs = [d.isend(torch.tensor([-1 if data is None else len(data)], dtype=torch.int64), self._global(to),
                        group=self.group) for to, data in sends]
        reqs += [d.irecv(h, self._global(frm), group=self.group) for h, frm in zip(heads_in, recv_from)]
        for q in reqs:
            q.wait()
        bufs = [None if int(h) < 0 else into(k, int(h)) if into is not None else torch.empty(int(h), dtype=torch.uint8)
                for k, h in enumerate(heads_in)]
        reqs = []
        for to, data in sends:
            if data is not None and len(data):
                out = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
                reqs.append(d.isend(out, self._global(to), group=self.group))
        reqs += [d.irecv(b, self._global(frm), group=self.group) for b, frm in zip(bufs, recv_from)
                 if b is not None and b.numel()]
        for q in reqs:
            q.wait()
        return [None if b is None else b.numpy() for b in bufs]      # bytes-like arrays: no copy

    def all_gather_bytes(self, data: bytes, how: str = "ring") -> List[bytes]:
        import torch
        super().all_gather_bytes(data, how)   # validates ``how``
        n, r = self.world_size, self.rank
        if n == 1:
            return [bytes(data)]
        if how == "allgather":
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
            self._dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
            top = max(int(t) for t in sizes)
            mine = torch.zeros(max(top, 1), dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
            bufs = [torch.empty_like(mine) for _ in range(n)]
            self._dist.all_gather(bufs, mine, group=self.group)
            return [bytes(b[:int(k)].numpy()) for b, k in zip(bufs, sizes)]
        blocks: List[bytes] = [b""] * n
        blocks[r] = bytes(data)
        nxt, prv = (r + 1) % n, (r - 1) % n
        for step in range(n - 1):
            cur = blocks[(r - step) % n]            # the block received in the previous step
            size_in = torch.zeros(1, dtype=torch.int64)
            self._sendrecv(torch.tensor([len(cur)], dtype=torch.int64), nxt, size_in, prv)
            buf = torch.empty(int(size_in), dtype=torch.uint8)
            out = torch.frombuffer(bytearray(cur), dtype=torch.uint8) if cur else torch.empty(0, dtype=torch.uint8)
            self._sendrecv(out, nxt, buf, prv)
            blocks[(r - step - 1) % n] = bytes(buf.numpy())
        return blocks


def default_comm() -> Comm:
    """torch.distributed's world when it is initialized (on a group that carries the host tensors
    AdaCheck exchanges, see :func:`host_group`), else a world of one.  Collective the first time
    in a world whose default group is NCCL: every rank calls it at the same point."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return TorchComm(host_group())
    except ImportError:  # pragma: no cover
        pass
    return SoloComm()


def one_process_group() -> Callable[[], None]:
    """A process group for offline code that needs one (a conversion in one process): a gloo group
    of this process alone, or the one it is in, when that has one rank (ConfigError in a larger
    one).  Returns what tears down the group it made (nothing for one it found)."""
    import torch.distributed as dist
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConfigError("conversion runs in one process; call it outside a distributed job")
        return lambda: None
    rendezvous = tempfile.mkdtemp(prefix="adacheck-pg-")
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(rendezvous, 'rendezvous')}",
                            rank=0, world_size=1)

    def done() -> None:
        dist.destroy_process_group()
        shutil.rmtree(rendezvous, ignore_errors=True)
    return done


HOST_BACKENDS = ("gloo", "mpi")
_host_group = (None, None)      # the default group it was made for, the gloo group


def host_group():
    """The group AdaCheck's collectives run on: None (the default group) when its backend carries
    CPU tensors (gloo, mpi, or a per-device mix such as ``cpu:gloo,cuda:nccl``), else a gloo group
    over the same ranks, made once per default group.  A GPU job's default group is NCCL, which
    carries device tensors only: hashes, plans and manifests are host bytes."""
    import torch.distributed as dist
    backend = str(dist.get_backend()).lower()
    per_device = dict(p.split(":", 1) if ":" in p else ("cpu", p) for p in backend.split(","))
    if per_device.get("cpu") in HOST_BACKENDS:
        return None
    global _host_group
    world = dist.group.WORLD
    if _host_group[0] is not world:
        _host_group = (world, dist.new_group(backend="gloo"))
    return _host_group[1]


def background_comm(comm: Comm, timeout_s: float = 1800.0) -> Comm:
    """A communicator over the same ranks as ``comm`` on a gloo process group of its own, for
    collectives that run in a background thread while training uses its own groups (gloo, or
    NCCL, which would serialise with the training's kernels).  Collective: every rank of
    ``comm`` calls it at the same point."""
    if comm.world_size == 1:
        return SoloComm()
    import datetime
    import torch.distributed as dist
    group = getattr(comm, "group", None)
    ranks = None if group is None else [dist.get_global_rank(group, r) for r in range(comm.world_size)]
    return TorchComm(dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))


def store_address():
    """(host, port) of the TCP store the job's default process group met in (torchrun, env://,
    tcp://), for other processes of the job to meet in; None when it met in another kind."""
    import torch.distributed as dist
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        store = _get_default_store()
    except Exception:  # noqa: BLE001 - (no default group, or another torch): no store to share
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def world_in_store(address, prefix: str, rank: int, world_size: int, timeout_s: float, meet_s: float) -> Comm:
    """A new gloo world (the default process group of this process) of ``world_size`` processes,
    meeting under ``prefix`` in the TCP store at ``address`` (see :func:`store_address`), within
    ``meet_s`` seconds (a peer that never comes, say one that died while it started, is an error
    then, not a wait as long as a collective may take); the communicator's collectives, on a group
    of their own, wait up to ``timeout_s``."""
    if world_size == 1:
        return SoloComm()
    import datetime
    import torch.distributed as dist
    meet = datetime.timedelta(seconds=meet_s)
    store = dist.PrefixStore(prefix, dist.TCPStore(address[0], address[1], is_master=False, timeout=meet))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=meet)
    return TorchComm(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))


def describe_error(e: BaseException) -> str:
    if isinstance(e, AdaCheckError):
        return str(e)
    text = f"{type(e).__name__}: {e}"
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        last = tb[-1]
        text += f" (at {last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
    return text


def agree(comm: Comm, what: str, fn: Callable[[], Any],
          on_failure: Optional[Callable[[], None]] = None) -> Any:
    """Run ``fn`` on every rank; return its result where all succeeded, else raise everywhere.

    ``on_failure`` runs on every rank (also the healthy ones) before the error is raised,
    e.g. to remove temporary files.
    """
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - gathered and re-raised below
        error = (kind_of(e), describe_error(e))
        local_exc = e
    if not comm.any(error is not None):     # one small reduction; every rank's error only when one failed
        return result
    outcomes = comm.all_gather_object(error)
    failures = {r: tuple(out) for r, out in enumerate(outcomes) if out is not None}
    if failures:
        if on_failure is not None:
            try:
                on_failure()
            except Exception:  # noqa: BLE001 - cleanup must not mask the real cause
                pass
        err = DistributedError.of(what, failures)
        if error is not None:
            raise err from local_exc
        raise err
    return result
