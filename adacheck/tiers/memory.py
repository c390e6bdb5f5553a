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
(:func:`fetch`, :func:`receive_file`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..storage import commit

from ..online import deltas
from ..format.compression import ENCODING_KEY
from ..errors import AdaCheckError, ConfigError, FormatError, SaveWarning
from ..plan.exchange import agree
from ..format.manifest import (JOB_OBJECTS, RANK_OBJECT, RANKED_SINCE, meta_name, parse, part_name, part_names, rank_file_name,
                       referenced_files, writer_of)
from ..plan.planner import file_name
from ..format.safetensors_file import SafetensorsFile
from ..storage.backends import LOCAL, Storage, copy_file
from ..format.writer import SpareFiles

log = logging.getLogger("adacheck")

DEFAULT_MEMORY_DIR = "/dev/shm/adacheck"
MEMORY_ENV, JOB_ENV = "ADACHECK_MEMORY_DIR", "ADACHECK_JOB"
PERSIST_TIMEOUT_S = 600.0
SOURCE_NAME = "SOURCE"          # in a memory location: the checkpoint directory it stands for
CHAIN_COPIED = ".deltas-persisted-rank"     # in a memory checkpoint: this rank's deltas are in durable storage


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


DELTA_FILE = re.compile(r"^rank\d+\.safetensors$")
SPARES = ".spare-deltas"        # in a job's memory directory: delta files of retired chains, to write over


def spares_of(mem: str) -> str:
    """The directory of spare delta files (:class:`~adacheck.format.writer.SpareFiles`) of the memory
    directory ``mem``."""
    return os.path.join(mem, SPARES)


def memory_location(store: Storage, save_dir: str, memory_dir: Optional[str] = None) -> str:
    """Where this job's memory tier keeps the checkpoints of ``save_dir`` (on ``store``)."""
    job, _ = job_identity()
    if job is None:
        raise ConfigError(f"the memory tier keeps a job's checkpoints under the job's identity, and this job has "
                          f"none: set ${JOB_ENV} (the same value for a restarted job) or start it with torchrun")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job)[:100] or "_"
    key = hashlib.sha256(durable_key(store, save_dir).encode()).hexdigest()[:16]
    return os.path.join(memory_root(memory_dir), safe, key)


# ---------------------------------------------------------------------- across nodes
@dataclass(frozen=True)
class NodeSpread:
    """How a memory checkpoint of a job across nodes is laid out (the memory Checkpointer's
    ``Options.spread``): ``nodes[r]`` is the node of rank r.  Every node's memory holds a copy
    of each box its ranks hold (the save writes one copy per node: ``copies`` = the number of
    nodes, no derived tensors), so the node's ranks recover from it alone; with ``peer`` each
    writer's file is also sent to the next node (in sorted order), which then holds what the
    lost node's ranks need.  The lowest rank of each node writes the node's manifest."""
    nodes: Tuple[str, ...]
    peer: bool

    @cached_property
    def by_node(self) -> Dict[str, List[int]]:
        """node -> its ranks in order (built once: every question below is then O(1) in the job)."""
        on: Dict[str, List[int]] = {}
        for r, n in enumerate(self.nodes):
            on.setdefault(n, []).append(r)
        return on

    @cached_property
    def _order(self) -> Dict[str, str]:
        """node -> the next node (in sorted order, the last to the first)."""
        order = sorted(self.by_node)
        return {n: order[(i + 1) % len(order)] for i, n in enumerate(order)}

    def ranks_on(self, node: str) -> List[int]:
        return list(self.by_node.get(node, ()))

    def leads(self, rank: int) -> bool:
        return self.by_node[self.nodes[rank]][0] == rank

    def next_node(self, node: str) -> str:
        return self._order[node]

    def before(self, rank: int) -> int:
        """The rank before ``rank`` on its node (cyclic: the node's last before its first)."""
        here = self.by_node[self.nodes[rank]]
        return here[here.index(rank) - 1]

    def partner(self, rank: int) -> Optional[int]:
        """The rank of the next node that keeps copies of what ``rank`` writes (None: one node)."""
        node = self.nodes[rank]
        there = self.by_node[self.next_node(node)]
        if self.nodes[there[0]] == node:
            return None
        return there[self.by_node[node].index(rank) % len(there)]

    def peer_moves(self, files: Dict[str, dict]) -> List[Tuple[str, int, int]]:
        """(file, writer, the rank of the next node that keeps its copy), the same on every rank."""
        if not self.peer:
            return []
        out = []
        for fname, info in sorted(files.items()):
            w = int(info["writer"])
            d = self.partner(w)
            if d is not None:
                out.append((fname, w, d))
        return out

    def move(self, comm, ckpt_dir: str, files: Dict[str, dict]) -> Dict[str, dict]:
        """Collective, after every writer's file is committed on its node (in the memory
        directory ``ckpt_dir``): the peer copies travel (a failure is raised once every move is
        done, see Comm.transfer); returns the files this rank's node holds."""
        moves = self.peer_moves(files)
        comm.transfer([(w, d) for _, w, d in moves], lambda i: _read_file(os.path.join(ckpt_dir, moves[i][0])),
                      lambda i, data: receive_file(ckpt_dir, moves[i][0], data, files[moves[i][0]]["nbytes"],
                                                   check=None),
                      sizes=[int(files[f]["nbytes"]) for f, _, _ in moves])
        mine = self.nodes[comm.rank]
        here = {f for f, info in files.items() if self.nodes[int(info["writer"])] == mine}
        here |= {f for f, _, d in moves if self.nodes[d] == mine}
        return {f: files[f] for f in sorted(here)}

    def move_own(self, comm, ckpt_dir: str, tag: str, own: Callable[[int], List[str]]) -> None:
        """Collective, in a save in parts (format 5) once every rank's files are written: with
        ``peer``, the files of each rank (``own(rank)``: its shard file if it wrote one, its part and
        rank file, rank 0's meta file) go in one block to its partner on the next node, which keeps
        each only when it is one of that rank's names (a shard file: a safetensors file written for
        ``tag``; the JSON files check themselves when read).  One window: a rank sends one block
        and receives one from each rank whose partner it is."""
        if not self.peer:
            return
        moves = [(w, d) for w in range(len(self.nodes)) for d in [self.partner(w)] if d is not None]

        def deliver(i, data):
            w = moves[i][0]
            if data is None:
                raise FormatError(f"rank {w} could not read its files of {tag} to send to its peer node")
            names = set(own(w))
            for fname, body in unpack_files(data).items():
                if fname not in names:
                    raise FormatError(f"rank {w} sent {fname!r} as its file of {tag}, which is not one of its names "
                                      f"({sorted(names)}): refused")
                receive_file(ckpt_dir, fname, body, len(body), by="its sender",
                             check=tagged_check(tag, fname) if fname.endswith(".safetensors") else None)

        comm.transfer(moves, lambda i: pack_paths(ckpt_dir, [f for f in own(moves[i][0])
                                                             if os.path.isfile(os.path.join(ckpt_dir, f))]),
                      deliver, sizes=[0] * len(moves))


class DeltaSpread:
    """Online deltas of a job whose memory tier spans nodes (``OnlineRecorder``'s ``spread``).

    Each node's memory holds its own ranks' chains: a gradient that several ranks hold is stored
    once per node (the recorder's replica share runs within the node), the chain file is the node's
    lowest rank's, and a step counts when the records of the node's ranks are there (all nodes
    agree on the step at recovery: :func:`adacheck.online.recovery.committed`).  With ``peer`` every step
    a rank writes is also sent to its partner on the next node (:meth:`NodeSpread.partner`) by a
    thread of its own, over a gloo process group of its own: training never waits for it.  Every
    rank hands the thread the same steps in the same order (written or not: a step a rank could not
    write travels as nothing, and its partner says so), so each step is one round of
    :meth:`Comm.transfer` on every rank; the receiver checks what arrives like a reader would
    (:func:`receive_step`).  Made collectively (every rank, at the same point)."""

    exit_order = 0.5      # (at exit: after the delta logs, which hand it their last steps)

    def __init__(self, comm, nodes: Sequence[str], peer: bool, timeout_s: float = 300.0):
        from ..checkpoint import lifecycle
        from ..plan.exchange import background_comm
        self.rank, self.nodes = comm.rank, tuple(nodes)
        self.layout = NodeSpread(self.nodes, peer)
        self.moves = [(w, d) for w in range(len(self.nodes)) for d in [self.layout.partner(w)] if d is not None] \
            if peer else []
        self.comm = background_comm(comm, timeout_s) if self.moves else None
        # the blocks sent and received, in memory kept from step to step (new memory would have
        # its pages faulted in on every step: most of what a step cost this thread)
        self._outgoing, self._incoming = defaultdict(Reused), defaultdict(Reused)     # (by move)
        self.sent = self.received = 0          # steps (this rank's) and bytes
        self.cpu_seconds = 0.0                 # CPU time of the peer thread (reading, sending, receiving, writing)
        self.failures = 0
        self._jobs: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        if self.comm is not None:
            lifecycle.keep(self)

    def group(self, rank: int) -> List[int]:
        """The ranks whose chains are kept with ``rank``'s (its node's)."""
        return self.layout.ranks_on(self.nodes[rank])

    def leads(self, rank: int) -> bool:
        return self.layout.leads(rank)

    def written(self, ckpt_dir: str, step: int, ok: bool) -> None:
        """DeltaLog's ``on_written``: step ``step`` of the chain in ``ckpt_dir`` is written here
        (``ok``) or not; its peer copy follows behind training."""
        if self.comm is None or self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="adacheck-peer-deltas", daemon=True)
            self._thread.start()
        self._jobs.put((ckpt_dir, step, ok))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                c0 = time.thread_time()
                self._send(*job)
                self.cpu_seconds += time.thread_time() - c0
            finally:
                self._jobs.task_done()

    def _send(self, ckpt_dir: str, step: int, ok: bool) -> None:
        def read(i):
            block = pack_step(ckpt_dir, step, self.moves[i][0], self._outgoing[i]) if ok else None
            if block is None:
                raise FormatError(f"rank {self.rank} has no step {step} to send (its delta log did not write it)")
            return block

        def deliver(i, data):
            src = self.moves[i][0]
            if data is None:
                raise FormatError(f"rank {src} sent nothing for step {step}")
            receive_step(ckpt_dir, step, src, unpack_files(data), f"a peer's delta (from rank {src})")

        try:
            got = self.comm.transfer(self.moves, read, deliver, sizes=[0] * len(self.moves),    # (one round)
                                     into=lambda i, n: self._incoming[i](n))
            self.received += got
            self.sent += 1
        except Exception as e:  # noqa: BLE001 - a step without its peer copy: said, the next ones go on
            self.failures += 1
            if self.failures <= 3:
                log.warning("AdaCheck: step %d of the online deltas in %s has no copy on the next node: %s%s", step,
                            ckpt_dir, e, " (further failures are not reported)" if self.failures == 3 else "")

    def flush(self, timeout_s: float = 120.0) -> bool:
        """Wait until every step handed over so far has travelled (at most ``timeout_s``: a
        partner that died leaves its steps behind); whether they did."""
        deadline = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._jobs.unfinished_tasks

    def close(self, timeout_s: float = 120.0) -> None:
        """The steps handed over travel (every rank closes after the same steps), then the thread
        ends; it is left behind after ``timeout_s`` (a partner that died)."""
        if self._closed:
            return
        self._closed = True
        from ..checkpoint import lifecycle
        lifecycle.release(self)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("AdaCheck: the peer copies of the online deltas did not finish within %.0fs", timeout_s)


def _remove_job_memory(mem: str) -> None:
    """The memory directory ``mem`` of one checkpoint directory goes, and the job's directory
    above it once that is empty."""
    LOCAL.remove_tree(mem)
    try:
        LOCAL.remove_dir(os.path.dirname(mem))
    except OSError:
        pass        # (the interpreter may be exiting: the empty directory stays)


def _block_head(sizes: List[Tuple[str, int]]) -> bytes:
    """The start of a :func:`pack_files` block whose files (in name order) have these sizes."""
    head = json.dumps([[n, k] for n, k in sorted(sizes)]).encode()
    return len(head).to_bytes(8, "little") + head


def pack_files(files: Dict[str, bytes]) -> bytes:
    """Named files as one block (a JSON table of names and sizes, then the contents)."""
    return b"".join([_block_head([(n, len(b)) for n, b in files.items()]), *(bytes(files[n]) for n in sorted(files))])


class Reused:
    """A uint8 host buffer handed out again and again, ``buffer(nbytes)``: a view of its first
    ``nbytes``, grown when a block needs more (the caller is done with the last view first)."""

    def __init__(self):
        self._buf = None

    def __call__(self, nbytes: int):
        import torch
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None        # (freed before the larger one is made)
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]


def pack_step(ckpt_dir: str, step: int, rank: int, buffer: Optional[Callable[[int], object]] = None):
    """Rank ``rank``'s committed files of ``step`` in the memory checkpoint ``ckpt_dir`` as one
    :func:`pack_files` block, a uint8 tensor the files are read straight into (it is sent as it
    is: one copy of the gradients on the way out; ``buffer(nbytes)`` gives it, e.g. a
    :class:`Reused`); None when the step's record is not there.  The record is read first (the
    gradients it commits are whole), the gradients under :meth:`SpareFiles.held` (not written
    over meanwhile)."""
    import torch
    d = deltas.step_dir(ckpt_dir, step)
    json_name, grad_name = f"rank{rank}.json", f"rank{rank}.safetensors"
    try:
        record = LOCAL.read_bytes(os.path.join(d, json_name))
    except FileNotFoundError:
        return None
    path = os.path.join(d, grad_name)
    if not os.path.exists(path):
        return torch.frombuffer(bytearray(pack_files({json_name: record})), dtype=torch.uint8)
    with SpareFiles.held(path), open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = _block_head([(json_name, len(record)), (grad_name, size)]) + record    # (the record's name sorts first)
        out = buffer(len(head) + size) if buffer is not None else torch.empty(len(head) + size, dtype=torch.uint8)
        view = memoryview(out.numpy())
        view[:len(head)] = head
        _fill(f, view[len(head):], path)
    return out


def _fill(f, view: memoryview, path: str) -> None:
    """``view`` read whole from the open file ``f`` (an OSError when it ends first)."""
    at = 0
    while at < len(view):
        n = f.readinto(view[at:])
        if not n:
            raise OSError(f"{path} ended at byte {at}, before the {len(view)} bytes it had when its block was made")
        at += n


def pack_paths(d: str, names: Sequence[str]):
    """The files ``names`` of directory ``d`` as one :func:`pack_files` block, a uint8 tensor the
    files are read straight into (it is sent as it is)."""
    import torch
    names = sorted(names)
    sizes = [os.path.getsize(os.path.join(d, n)) for n in names]
    head = _block_head(list(zip(names, sizes)))
    out = torch.empty(len(head) + sum(sizes), dtype=torch.uint8)
    view = memoryview(out.numpy())
    view[:len(head)] = head
    at = len(head)
    for name, size in zip(names, sizes):
        with open(os.path.join(d, name), "rb") as f:
            _fill(f, view[at:at + size], os.path.join(d, name))
        at += size
    return out


def unpack_files(data) -> Dict[str, memoryview]:
    """:func:`pack_files`'s files, as views into ``data`` (no copy); a FormatError when ``data`` is
    not such a block (bytes-like, or a uint8 tensor)."""
    data = memoryview(data.numpy() if hasattr(data, "numpy") else data).cast("B")
    try:
        n = int.from_bytes(bytes(data[:8]), "little")
        table = json.loads(bytes(data[8:8 + n]).decode("utf-8")) if 8 + n <= len(data) else None
    except (ValueError, UnicodeDecodeError):
        table = None
    if not isinstance(table, list) or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                                              and isinstance(e[1], int) and e[1] >= 0 for e in table) \
            or 8 + n + sum(e[1] for e in table) != len(data):
        raise FormatError("a peer sent a block that is not a table of files and their contents: refused")
    out, at = {}, 8 + n
    for name, size in table:
        out[name] = data[at:at + size]
        at += size
    return out


def _read_file(path: str):
    """A memory-tier file as a uint8 tensor (for Comm.transfer: read once, sent without a copy)."""
    import numpy as np
    import torch
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def receive_file(ckpt_dir: str, fname: str, data: Optional[bytes], nbytes: int,
                 check: Optional[Callable[[str], None]], by: str = "the manifest",
                 spares: Optional[SpareFiles] = None) -> None:
    """Write a file another rank sent into the memory directory ``ckpt_dir``, under its name only
    once it is what the manifest (or ``by``) says: ``nbytes`` long and, with ``check``, a file
    whose header holds its dtypes and shapes.  ``fname`` must be a plain name: nothing is written
    outside ``ckpt_dir``.  ``spares``: write over one of them, if there is one free."""
    if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", "..") or "\\" in fname:
        raise FormatError(f"a peer sent {fname!r}, which is not a plain file name: refused")
    if data is None:
        raise FormatError(f"{fname}: the rank that holds it could not read it")
    if len(data) != nbytes:
        raise FormatError(f"{fname}: a peer sent {len(data)} bytes, {by} says {nbytes}: refused")
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, fname)
    tmp = path + commit.TMP_SUFFIX
    try:
        lock = spares.take(tmp) if spares is not None else None
        try:
            with open(tmp, "wb" if lock is None else "r+b") as f:
                f.write(data)
                f.truncate()        # (a longer spare's rest)
        finally:
            if lock is not None:
                os.close(lock)
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def receive_step(ckpt_dir: str, step: int, rank: int, files: Dict[str, bytes], where: str) -> None:
    """Keep rank ``rank``'s files of ``step`` that another node sent (``files``: name -> bytes) in
    the chain of the memory checkpoint ``ckpt_dir``, each only once it is what a reader relies on
    (:func:`adacheck.online.deltas.received_record`, :func:`adacheck.online.deltas.file_check`); the record is
    written last: it commits the step for that rank here."""
    rec = deltas.received_record(files, step, rank, where)
    d = deltas.step_dir(ckpt_dir, step)
    if rec["file"] is not None:
        receive_file(d, rec["file"], files[rec["file"]], rec["file_bytes"], check=deltas.file_check(rec, step, where),
                     by="its record", spares=SpareFiles(spares_of(os.path.dirname(ckpt_dir))))
    os.makedirs(d, exist_ok=True)
    LOCAL.write_atomic(os.path.join(d, f"rank{rank}.json"), bytes(files[f"rank{rank}.json"]), fsync=False)


def shard_check(manifest, fname: str) -> Callable[[str], None]:
    """A check for :func:`receive_file`: the file's header holds every box the manifest places
    in ``fname``, with the manifest's dtype and shape (or as encoded bytes, when compressed)."""
    def check(path: str) -> None:
        f = SafetensorsFile(path, LOCAL)
        encoded = f.metadata.get(ENCODING_KEY) is not None
        for name, e in manifest.tensors.items():
            for sb in e.boxes:
                if sb.file != fname:
                    continue
                if sb.key not in f.entries:
                    raise FormatError(f"{fname} from a peer lacks {sb.key!r} ({name}), which the manifest places there")
                dname, shape = f.entries[sb.key][:2]
                want = ("uint8", None) if encoded else (e.dtype, tuple(sb.box.lengths))
                if dname != want[0] or (want[1] is not None and tuple(shape) != want[1]):
                    raise FormatError(f"{fname} from a peer holds {sb.key!r} ({name}) as {dname}{list(shape)}, the "
                                      f"manifest says {e.dtype}{list(sb.box.lengths)}: refused")
    return check


def tagged_check(tag: str, fname: str) -> Callable[[str], None]:
    """A check for :func:`receive_file` of a shard file of a manifest in parts (whose boxes are in
    rank files and parts not read here): a safetensors file written for ``tag``; each box's bytes
    are checked against its hash when read."""
    def check(path: str) -> None:
        got = SafetensorsFile(path, LOCAL).metadata.get("adacheck_tag")
        if got != tag:
            raise FormatError(f"{fname} from a peer was written for {got!r}, not {tag!r}: refused")
    return check


def _own_shards(m) -> set:
    """The shard files a manifest in parts names in its own directory (its writers')."""
    return {f for t, f in referenced_files(m) if t is None}


def holdings(mem: str) -> Dict[str, dict]:
    """What this node's memory holds of ``mem``: per checkpoint with a manifest, its step, the
    manifest's digest, the files present (name -> size) and, per stored region, (its copies'
    files, the ranks that held it); for :meth:`MemoryTier.choose` across nodes."""
    out: Dict[str, dict] = {}
    if not os.path.isdir(mem):
        return out
    for tag in sorted(os.listdir(mem)):
        d = os.path.join(mem, tag)
        path = os.path.join(d, commit.MANIFEST_NAME)
        if not os.path.isfile(path):
            continue
        try:
            raw = LOCAL.read_bytes(path)
            m = parse(raw.decode("utf-8"), where=path, open_part=commit.PartFiles(LOCAL, d))
        except (AdaCheckError, UnicodeDecodeError, OSError) as e:
            log.warning("AdaCheck: the memory tier's %s is unreadable, not used: %s", path, e)
            continue
        world = int(m.topology.get("world_size", 0))
        names = sorted(_own_shards(m)) + part_names(m) if m.index is not None else list(m.files)
        present = {f: os.path.getsize(os.path.join(d, f)) for f in names if os.path.isfile(os.path.join(d, f))}
        objects: Dict[int, set] = {}
        if m.index is not None and int(m.topology.get("copies", 1)) > 1:
            # in parts, saved across nodes: what each rank needs, from the rank files here
            nbytes, groups, objects = _needed_in_parts(m, d, present)
            derived = False
        elif m.index is not None:
            # a manifest in parts (saved on one node): complete when every file it names is here;
            # a node that lacks it receives all of them (its files' sizes are those here)
            nbytes, groups, derived = dict(present), [((f,), tuple(range(world))) for f in names], True
        else:
            groups, objects = _groups_of(m.tensors, tuple(range(world)))
            nbytes = {f: int(i["nbytes"]) for f, i in m.files.items()}
            groups, derived = sorted(groups), any(e.derived is not None for e in m.tensors.values())
        out[tag] = {"step": m.step if m.step is not None else -1, "digest": hashlib.sha256(raw).hexdigest(),
                    "present": present, "nbytes": nbytes, "groups": groups, "world": world, "derived": derived,
                    "objects": {k: sorted(v) for k, v in objects.items()},
                    "chain": deltas.read_chain(d), "steps": _delta_steps(d, m.step if m.step is not None else -1)}
    return out


def _groups_of(tensors, everyone: Tuple[int, ...]) -> Tuple[set, Dict[int, set]]:
    """The stored regions of ``tensors`` as groups (the files of their copies, the ranks that held
    them; ``everyone`` for the tensors of the job's objects, which every rank reads), and per saving
    rank the files of its own objects' tensors, one tuple per region (other ranks may read those)."""
    regions: Dict[tuple, Tuple[set, set]] = {}
    for name, e in tensors.items():
        for sb in e.boxes:
            files, holders = regions.setdefault((name, sb.box), (set(), set()))
            files.add(sb.file)
            holders.update(everyone if name.startswith(JOB_OBJECTS) else sb.holders)
    groups, objects = set(), {}
    for (name, _), (files, holders) in regions.items():
        group = (tuple(sorted(files)), tuple(sorted(holders)))
        groups.add(group)
        if RANK_OBJECT.match(name):
            objects.setdefault(int(name[len("rank"):name.index("/")]), set()).add(group[0])
    return groups, objects


def _needed_in_parts(m, d: str, present: Dict[str, int]) -> Tuple[Dict[str, int], list, Dict[int, set]]:
    """For :func:`holdings`, a memory checkpoint in parts saved across nodes (each node's directory
    holds the manifest, its ranks' shard files, parts and rank files, and with ``peer`` copies of
    the previous node's): (the sizes of the files known here: a shard file's from its writer's
    rank file, a JSON file's as it is here; the groups (files, ranks that need one of them); per
    saving rank, the files of its objects: its rank file, and its object tensors' as far as known).
    Every rank needs its rank file and the meta file; the regions each rank held, one copy of each,
    as the rank files here say (the other nodes report the rest); a part only a load in another
    layout.  A rank file here that does not read is left out of ``present``."""
    g, ranks = m.index["generation"], int(m.index["ranks"])
    groups = {((meta_name(g),), tuple(range(ranks)))} | {((part_name(g, i),), ()) for i in range(m.index["parts"])}
    nbytes = {f: n for f, n in present.items() if f.endswith(".json")}
    objects: Dict[int, set] = {r: {(rank_file_name(g, r),)} for r in range(ranks)}
    for r in range(ranks):
        name = rank_file_name(g, r)
        groups.add(((name,), (r,)))
        if name not in present:
            continue
        try:
            table = m.ranks.get(r)
        except AdaCheckError as e:
            log.warning("AdaCheck: the memory tier's %s is unreadable, not used: %s", os.path.join(d, name), e)
            del present[name], nbytes[name]
            continue
        nbytes.update((f, int(info["nbytes"])) for f, info in table.files.items())
        found, its = _groups_of(table.tensors, (r,))
        groups |= found
        objects[r] |= its.get(r, set())
    return nbytes, sorted(groups), objects


_RECORD = re.compile(r"^rank(\d+)\.json$")


def _delta_steps(ckpt_dir: str, base_step: int) -> Dict[int, Tuple[int, int]]:
    """The online deltas a memory checkpoint holds, per rank with a record of step base+1: how many
    steps in a row from there (a chain is read up to its first gap) and their bytes.  A few numbers
    per rank, whatever the chain's length: every node's leader sends them to every rank."""
    out: Dict[int, Tuple[int, int]] = {}
    for s in deltas.step_dirs(ckpt_dir):
        if s <= base_step:
            continue
        d = deltas.step_dir(ckpt_dir, s)
        for name in os.listdir(d):
            m = _RECORD.match(name)
            if not m:
                continue
            r = int(m.group(1))
            n, size = out.get(r, (0, 0))
            if s == base_step + 1 + n:        # (the next step of rank r's run from the base)
                grads = os.path.join(d, f"rank{r}.safetensors")
                out[r] = (n + 1, size + os.path.getsize(os.path.join(d, name))
                          + (os.path.getsize(grads) if os.path.exists(grads) else 0))
    return out


def delta_moves(h: dict, reports: Sequence[Optional[dict]], key: Tuple[str, str], nodes: Sequence[str],
                 every: bool) -> List[Tuple[Optional[int], int, int, int, int]]:
    """The online deltas of the chosen checkpoint each node lacks, for :func:`plan_recovery`:
    (step, or None for the chain file; saving rank; from rank; to rank; its expected bytes).  A
    node needs the chains its ranks read: those of the ranks that shared a node with them when
    recorded (a chain kept per node: :class:`DeltaSpread`), or every rank's (``every``, or a chain
    not kept per node), up to the last step that some node holds for each of them."""
    held = {r: rep[key[0]] for r, rep in enumerate(reports)
            if rep and key[0] in rep and rep[key[0]]["digest"] == key[1]}
    info = next((x["chain"] for x in held.values() if x["chain"] is not None), None)
    if info is None:
        return []
    saved, world, base = info.get("nodes"), h["world"], h["step"]

    def chain_of(r: int, q: int) -> Tuple[int, int]:
        """(steps in a row, their bytes) of rank q's chain on the node led by rank r."""
        return held[r]["steps"].get(q, (0, 0)) if r in held else (0, 0)

    moves: List[Tuple[Optional[int], int, int, int, int]] = []
    for node in sorted(set(nodes), key=nodes.index):
        lead = nodes.index(node)
        mine = [r for r, n in enumerate(nodes) if n == node]
        if every or not saved or len(saved) != world:
            need = list(range(world))
        else:
            need = sorted({q for r in mine if r < world for q in range(world) if saved[q] == saved[r]})
        if lead not in held or held[lead]["chain"] is None:
            moves.append((None, 0, min(r for r in held if held[r]["chain"] is not None), lead, 0))
        source = {q: max(held, key=lambda r: (chain_of(r, q)[0], -r)) for q in need}
        upto = min((chain_of(source[q], q)[0] for q in need), default=0)
        for q in need:
            n, size = chain_of(source[q], q)
            moves += [(base + 1 + i, q, source[q], lead, size // max(n, 1))
                      for i in range(chain_of(lead, q)[0], upto)]
    return moves


def newer_in_memory(reports: Sequence[Optional[dict]], latests: Sequence[Optional[str]], store: Storage,
                    load_dir: str, plan: Callable) -> Tuple[str, Optional[dict]]:
    """Pure but for reading durable storage's ``latest``, on rank 0: ("memory" or "durable", the
    memory's plan) for a load without a tag.  The memory's candidate is the checkpoint its
    ``latest`` names (the newest save that moved ``latest``: it goes to memory first, also after
    a roll-back to an older tag), complete between the nodes' memories; if it is not, the newest
    complete one of no later step (``plan(tag, below)``: :func:`plan_recovery`); none if no memory
    holds it any more (nor without a ``latest``: the newest complete one).  Memory wins
    when durable storage's ``latest`` names a checkpoint the memory also holds (copied from it,
    so not newer) or one of no later step than the candidate's."""
    named = [t for t in latests if t is not None]
    latest_mem = max(sorted(set(named)), key=named.count) if named else None   # (every node's, but a new one)
    if latest_mem is None:
        chosen = plan(None)
    else:      # (one no memory holds any more: durable storage's)
        chosen = plan(latest_mem)
        steps = [rep[latest_mem]["step"] for rep in reports if rep and latest_mem in rep]
        if chosen is None and steps:
            chosen = plan(None, max(steps))
    if chosen is None:
        return "durable", None
    latest = commit.latest_or_none(load_dir, store) if store.is_dir(load_dir) else None
    if latest is None:
        return "memory", chosen
    d = store.join(load_dir, latest)
    try:      # (its bytes once: the step, and the digest memory's copies are compared by)
        raw = store.read_bytes(store.join(d, commit.MANIFEST_NAME))
        step = parse(raw.decode("utf-8"), where=d, open_part=commit.PartFiles(store, d)).step
    except (AdaCheckError, OSError, UnicodeDecodeError):
        return "memory", chosen
    digest = hashlib.sha256(raw).hexdigest()
    copied = chosen["tag"] == latest_mem and any(rep and rep.get(latest, {}).get("digest") == digest for rep in reports)
    return ("memory", chosen) if copied or chosen["step"] >= (step if step is not None else -1) else ("durable", chosen)


def plan_recovery(reports: Sequence[Optional[dict]], nodes: Sequence[str], tag: Optional[str],
                  everything: bool = False, reads_objects_of: Optional[Sequence[Sequence[int]]] = None,
                  below: Optional[int] = None) -> Optional[dict]:
    """Pure, on rank 0: from each node leader's :func:`holdings` (``reports[r]``, None for other
    ranks) and the node of each rank now, the newest checkpoint (or ``tag``) that the nodes'
    memories hold complete between them: every stored region has a copy whose file is present,
    with its size, on some node.  Returns None, or {"tag", "step", "digest", "moves"}: the files
    (and manifest, as None) each node lacks, [(file or None, from rank, to rank)], so that every
    node then holds the manifest and a copy of every region its ranks held when saved (every
    region: with ``everything``, or when the job's world size is not the saving one's), and the
    objects (rank file, object tensors) of the saving ranks ``reads_objects_of[r]`` its rank r reads."""
    on = NodeSpread(tuple(nodes), False).by_node
    leaders = {n: ranks[0] for n, ranks in on.items()}
    seen: Dict[Tuple[str, str], dict] = {}
    has: Dict[Tuple[str, str], Dict[str, set]] = {}     # checkpoint -> file -> leaders holding it
    with_manifest: Dict[Tuple[str, str], List[int]] = {}
    for r, rep in enumerate(reports):       # (each node's sizes and groups: the checkpoint's are all of them)
        for t, h in (rep or {}).items():
            key = (t, h["digest"])
            if key not in seen:
                seen[key] = dict(h, nbytes=dict(h["nbytes"]), groups=set(map(tuple, h["groups"])), objects={})
            else:
                for f, n in h["nbytes"].items():
                    seen[key]["nbytes"].setdefault(f, n)
                seen[key]["groups"].update(map(tuple, h["groups"]))
            for k, files in h.get("objects", {}).items():
                seen[key]["objects"].setdefault(k, set()).update(map(tuple, files))
            with_manifest.setdefault(key, []).append(r)
    for r, rep in enumerate(reports):
        for t, h in (rep or {}).items():
            key = (t, h["digest"])
            for f, size in h["present"].items():
                if size == seen[key]["nbytes"].get(f):
                    has.setdefault(key, {}).setdefault(f, set()).add(r)
    best = None
    for key, h in seen.items():
        if (tag is not None and key[0] != tag) or (below is not None and h["step"] > below):
            continue
        held = has.get(key, {})
        if all(any(f in held for f in files) for files, _ in h["groups"]):
            if best is None or (h["step"], key) > (seen[best]["step"], best):
                best = key
    if best is None:
        return None
    h, held = seen[best], has.get(best, {})
    every = everything or h["world"] != len(nodes) or h["derived"]
    moves: List[Tuple[Optional[str], int, int]] = []
    for node in sorted(leaders, key=leaders.get):
        lead, mine = leaders[node], set(on[node])
        if lead not in with_manifest[best]:
            moves.append((None, with_manifest[best][0], lead))
        local = {f for f, rs in held.items() if lead in rs}
        needed = [files for files, holders in sorted(h["groups"]) if every or mine.intersection(holders)]
        if not every and reads_objects_of is not None:      # (objects other saving ranks' files hold)
            others = {k for r in mine for k in reads_objects_of[r]} - mine
            needed += [files for k in sorted(others) for files in sorted(h["objects"].get(k, ()))]
        for files in needed:
            if any(f in local for f in files) or not any(f in held for f in files):
                continue
            # (the copy its own ranks wrote when saved, where there is one: the peer copy of a lost node)
            f = min((f for f in files if f in held), key=lambda f: (writer_of(f) not in mine, f))
            moves.append((f, min(held[f]), lead))
            local.add(f)
    return {"tag": best[0], "step": h["step"], "digest": best[1], "moves": moves, "nbytes": h["nbytes"],
            "deltas": delta_moves(h, reports, best, nodes, every)}


def fetch(comm, ckpt_dir: str, plan: dict) -> int:
    """Collective: the moves of :func:`plan_recovery` into each node's ``ckpt_dir``; a received
    manifest must hash to the agreed digest, a received shard be what that manifest says (see
    :func:`receive_file`); the manifest is written last.  A failure is raised once every move is
    done (Comm.transfer), and then no manifest is written.  Returns the bytes received here."""
    moves, digest, steps = plan["moves"], plan["digest"], plan.get("deltas", [])
    state = {"manifest": None, "raw": None}

    def manifest():
        if state["manifest"] is None:
            state["manifest"] = parse(LOCAL.read_bytes(os.path.join(ckpt_dir, commit.MANIFEST_NAME)).decode("utf-8"),
                                      where=ckpt_dir)
        return state["manifest"]

    def read(i):
        if i >= len(moves):
            step, rank = steps[i - len(moves)][:2]
            if step is None:
                return LOCAL.read_bytes(os.path.join(deltas.deltas_dir(ckpt_dir), deltas.CHAIN))
            block = pack_step(ckpt_dir, step, rank)
            if block is None:
                raise FormatError(f"{ckpt_dir} has no record of step {step} for rank {rank} to send")
            return block
        return _read_file(os.path.join(ckpt_dir, moves[i][0] or commit.MANIFEST_NAME))

    def deliver(i, data):
        if i >= len(moves):
            step, rank = steps[i - len(moves)][:2]
            if data is None:
                raise FormatError(f"the online deltas of {plan['tag']} (step {step}) could not be read on the node "
                                  "that holds them")
            if step is not None:
                receive_step(ckpt_dir, step, rank, unpack_files(data), f"{plan['tag']} from a peer")
                return
            try:
                info = json.loads(bytes(data).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                info = None
            if not isinstance(info, dict):
                raise FormatError(f"the chain file of {plan['tag']} a peer sent is not a JSON object: refused")
            deltas.write_chain(ckpt_dir, info, fsync=False)
            return
        fname = moves[i][0]
        if fname is None:
            raw = None if data is None else bytes(data)
            if raw is None or hashlib.sha256(raw).hexdigest() != digest:
                raise FormatError(f"the manifest of {plan['tag']} a peer sent is not the one agreed on: refused")
            state["manifest"], state["raw"] = parse(raw.decode("utf-8"), where=f"{plan['tag']} from a peer"), raw
            return
        m = manifest()
        if m.index is not None:       # (in parts: its JSON files check themselves when read)
            shards = _own_shards(m)
            if fname not in shards and fname not in part_names(m):
                raise FormatError(f"a peer sent {fname!r}, which the manifest of {plan['tag']} does not name: refused")
            receive_file(ckpt_dir, fname, data, plan["nbytes"].get(fname, len(data) if data is not None else 0),
                         by="the node that sent it", check=tagged_check(m.tag, fname) if fname in shards else None)
            return
        if fname not in m.files:
            raise FormatError(f"a peer sent {fname!r}, which the manifest of {plan['tag']} does not list: refused")
        receive_file(ckpt_dir, fname, data, int(m.files[fname]["nbytes"]), check=shard_check(m, fname))

    got = comm.transfer([(src, dst) for _, src, dst in moves] + [(src, dst) for _, _, src, dst, _ in steps],
                        read, deliver, sizes=[plan["nbytes"].get(f, 0) if f else 0 for f, _, _ in moves]
                        + [n for *_, n in steps])
    if state["raw"] is not None:
        LOCAL.write_atomic(os.path.join(ckpt_dir, commit.MANIFEST_NAME), state["raw"], fsync=False)
    return got


def _marker(rank: int) -> str:
    return f".persisted-rank{rank:05d}"


def own_files(generation: int, rank: int) -> List[str]:
    """The names of the files ``rank`` writes in a save in parts (format 5): its shard file (if it
    writes one), its part of the tensor table and its rank file; rank 0 the meta file too."""
    return [file_name(rank, generation), part_name(generation, rank), rank_file_name(generation, rank)] + (
        [meta_name(generation)] if rank == 0 else [])


def _copied_by(manifest, rank: int) -> List[str]:
    """The files of a committed memory checkpoint that ``rank`` copies to durable storage: the shard
    file it wrote and, for a manifest in parts (format 5), its part of the tensor table and its rank
    file (rank 0: the meta file too), so that no rank copies more than its own."""
    if manifest.index is None or manifest.format_version < RANKED_SINCE:     # (format 4: no rank files)
        g = manifest.index["generation"] if manifest.index is not None else None
        return [f for f, info in sorted(manifest.files.items()) if int(info["writer"]) == rank] + (
            [part_name(g, rank)] if g is not None and part_name(g, rank) in part_names(manifest) else [])
    index, g = manifest.index, manifest.index["generation"]
    wrote = any(a <= rank < b for a, b in index["writers"])
    return [f for f in own_files(g, rank) if wrote or not f.endswith(".safetensors")]


def _copiers(manifest) -> List[int]:
    """The ranks that copy files of ``manifest`` (see _copied_by), whose markers rank 0 waits for."""
    if manifest.index is None:
        return sorted({int(info["writer"]) for info in manifest.files.values()})
    return list(range(max(manifest.index["parts"], manifest.index.get("ranks", 0), 1)))


def persist_checkpoint(rank: int, src_dir: str, dst_store: Storage, dst_dir: str, tag: str, fsync: bool,
                       update_latest: bool, keep_last: Optional[int], confirm: Callable,
                       timeout_s: float = PERSIST_TIMEOUT_S, fence: Optional[Callable] = None) -> bool:
    """Copy this rank's files of the committed memory checkpoint ``src_dir`` to ``dst_dir/tag``
    on ``dst_store`` (:func:`_copied_by`); rank 0 then commits it there (manifest, ``latest``,
    retention).  No collective: each rank's marker says which files it copied, their sizes and
    content tags; rank 0 waits for every marker (up to ``timeout_s``) and confirms those files
    (all of them: a checkpoint in parts needs its parts and rank files too) before the manifest.
    Returns whether this rank's part is done (rank 0: whether the checkpoint was committed).
    ``fence(store, dir, doing)``: raises when this job no longer holds ``dst_dir``'s lease (checked by
    rank 0 before the manifest and before ``latest``)."""
    fence = fence if fence is not None else (lambda *_: None)
    manifest_bytes = LOCAL.read_bytes(LOCAL.join(src_dir, commit.MANIFEST_NAME))
    nonce = hashlib.sha256(manifest_bytes).hexdigest()
    manifest = parse(manifest_bytes.decode("utf-8"), where=LOCAL.join(src_dir, commit.MANIFEST_NAME),
                     open_part=commit.PartFiles(LOCAL, src_dir))
    dst = dst_store.join(dst_dir, tag)
    dst_store.make_dirs(dst)
    copiers = _copiers(manifest)
    told = {}       # file -> (its size, its content tag as it showed once copied)
    for fname in _copied_by(manifest, rank):
        path = dst_store.join(dst, fname)
        size = copy_file(LOCAL, LOCAL.join(src_dir, fname), dst_store, path, fsync=fsync)
        if fname in manifest.files:       # (a shard file: its size as its writer committed it)
            size = int(manifest.files[fname]["nbytes"])
        told[fname] = (size, (dst_store.file_state(path) or (None, None))[1])
    if rank in copiers:
        dst_store.write_atomic(dst_store.join(dst, _marker(rank)), json.dumps({"nonce": nonce, "files": told}).encode(),
                               fsync=fsync)
    if rank != 0:
        return True
    deadline = time.monotonic() + timeout_s
    waiting, files = list(copiers), {}
    while waiting:
        said = {r: _marked(dst_store, dst, r, nonce) for r in waiting}
        files.update((f, {"writer": r, "nbytes": n, "tag": t}) for r, x in said.items() if x for f, (n, t) in x.items())
        waiting = [r for r, x in said.items() if x is None]
        if not waiting:
            break
        if time.monotonic() > deadline:
            log.warning("AdaCheck: %s was not persisted to %s: ranks %s did not copy their files within %.0fs; "
                        "it stays in the memory tier", tag, dst_dir, waiting, timeout_s)
            return False
        time.sleep(0.05)
    confirm(dst_store, dst, files)
    fence(dst_store, dst_dir, f"copying the manifest of {tag!r} from the memory tier")
    commit.write_manifest_bytes(dst, manifest_bytes, dst_store)
    for r in copiers:
        dst_store.remove(dst_store.join(dst, _marker(r)))
    if update_latest:
        fence(dst_store, dst_dir, f"publishing {tag!r} ('latest') from the memory tier")
        commit.write_latest(dst_dir, tag, dst_store)
    commit.leave_readme(dst_dir, dst_store)
    retired = []
    if keep_last:
        latest = commit.read_latest(dst_dir, dst_store)
        retired = commit.apply_retention(dst_dir, keep_last, protect=(tag,) + ((latest,) if latest else ()),
                                         store=dst_store)
    # (only this tag's earlier generations and what retention retired: another rank may already be
    # copying the next checkpoint into a directory that has no manifest yet)
    commit.collect_garbage(dst_dir, store=dst_store, only=(tag, *retired),
                           keep_after=dst_store.mtime(dst_store.join(dst, commit.MANIFEST_NAME)))
    return True


def _marked(store: Storage, ckpt: str, rank: int, nonce: str) -> Optional[dict]:
    """The files ``rank`` copied for the checkpoint whose manifest hashes to ``nonce``, each
    (size, content tag), once its marker says it is done; None before."""
    try:
        said = json.loads(store.read_bytes(store.join(ckpt, _marker(rank))))
    except (FileNotFoundError, UnicodeDecodeError, ValueError):
        return None
    return said["files"] if isinstance(said, dict) and said.get("nonce") == nonce else None


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
    size = 0
    for d, _, fs in os.walk(mem):
        for f in fs:
            try:
                size += os.path.getsize(os.path.join(d, f))
            except FileNotFoundError:
                pass        # (renamed meanwhile by a rank's writer: a step's temporary, a spare taken)
    return count, size


class ChainCopy:
    """Behind training, in a thread of its own: this rank's online deltas of a base that was
    persisted, copied from the memory tier to durable storage as they are written
    (:func:`adacheck.online.deltas.copy_chain`: gradients, then the record).  Training never waits for
    it: durable storage takes the steps at its own pace.  The chain goes on through the bases
    kept in memory only (:meth:`follow`): the recorder also records a base's own step as the last
    delta of the chain before it (``Recording.bridge``), so the next base's deltas continue the
    persisted base's chain in durable storage, step after step.  When the next base is
    persisted, this chain has ended: the thread copies what is left of it and ends.  A chain it
    could not finish (the memory tier retired a base first, a storage error) stays in durable
    storage as far as it got, a shorter chain, never a wrong one, and that is said: durable
    storage then falls back to its bases."""

    POLL_S = 0.05

    def __init__(self, rank: int, src: str, store: Storage, dst: str, fsync: bool):
        self.rank, self.store, self.dst, self.fsync = rank, store, dst, fsync
        self.sources = [src]                  # the persisted base, then those whose chains continue it, in order
        self.at = 0                           # the one being copied
        self.last: Optional[int] = None       # the last step copied
        self.error: Optional[BaseException] = None
        self._ending = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="adacheck-chain-copy", daemon=True)
        self._thread.start()

    @property
    def src(self) -> str:
        """The persisted base's memory directory."""
        return self.sources[0]

    def follow(self, src: str) -> None:
        """The base in ``src`` (memory) was not persisted: its deltas continue this chain."""
        with self._lock:
            self.sources.append(src)

    def _run(self) -> None:
        while not self._ending.wait(self.POLL_S):
            if not self.copy():
                break
        self.copy()

    def copy(self) -> bool:
        """Copy the steps written since the last pass; False once copying failed."""
        with self._lock:
            while self.error is None:
                src = self.sources[self.at]
                try:
                    if not os.path.isdir(src):
                        raise FileNotFoundError(f"the memory tier retired {os.path.basename(src)} before its "
                                                "deltas were copied")
                    self.last = deltas.copy_chain(src, LOCAL, self.dst, self.store, self.rank,
                                                  fsync=self.fsync, after=self.last)
                except BaseException as e:  # noqa: BLE001 - said once, here; the chain stays as far as it got
                    self.error = e
                    self._report()
                    break
                # (on to the next base once its first step continues the chain: the bridged step is here)
                if self.at + 1 < len(self.sources) and self.last is not None and \
                        self.last + 1 in deltas.step_dirs(self.sources[self.at + 1]):
                    self.at += 1
                    continue
                break
            return self.error is None

    def _report(self) -> None:
        if self.error is not None:
            log.warning("AdaCheck: the online deltas of %s went to durable storage (%s) up to %s: %s; durable "
                        "storage recovers that far, the memory tier the newer steps",
                        os.path.basename(self.src), self.dst,
                        f"step {self.last}" if self.last is not None else "its base", self.error)

    def end(self, wait: bool) -> None:
        """The chain is complete (the next base was taken): copy the rest and stop; ``wait``
        for that (at exit), else it goes on behind training."""
        self._ending.set()
        if wait:
            self._thread.join()


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
        self.across = False            # the last load ran on several nodes
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
            self._end_copy()        # (a copy that ended: reported now, and no longer kept from retention)
        t0 = time.perf_counter()
        self.memory.finish(waiting_for=tag)     # (the previous memory save, if it was asynchronous)
        self._note_committed(durable)
        # its files are copied under their names into the checkpoint directory: past every generation of
        # this tag there (a re-saved tag never writes over a committed checkpoint's files)
        floor = 0
        if comm.rank == 0:
            try:
                floor = commit.generation_of(store.join(save_dir, tag), store)
            except OSError as e:      # (the copy will tell whether the directory can be written)
                log.warning("AdaCheck: could not list %s before saving %s to memory: %s", save_dir, tag, e)
        if asynchronous:
            self._retain(mem, ())         # (before the new save's files exist: nothing in flight now)
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
            self.chain.follow(os.path.join(mem, tag))     # (its deltas go on from the persisted base's)
        return manifest

    def _note_committed(self, durable: str) -> None:
        """Once the previous memory save of ``durable`` has ended: whether it committed (its
        manifest is in memory on every node); the newest that did is what exit persists when a
        later one failed.  One that failed when its copy to durable storage was due makes the
        next save's copy due."""
        last = self.newest.get(durable)
        if last is None:
            return
        if commit.has_manifest(os.path.join(last[0], last[1]), LOCAL):
            self.committed[durable] = last
        elif self.due.get(durable) == last[1]:
            self.owed.add(durable)    # (its copy was due: the next save is copied, not the interval's next)

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
        in_memory = self.memory.pending       # (an asynchronous memory save of tag: committed first)

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
        if self.online:       # (its deltas follow it; a chain not finished stays as far as it got)
            if self.chain is not None:
                self.chain.end(wait=False)
            self.chain = ChainCopy(rank, os.path.join(mem, tag), store, store.join(save_dir, tag), self.fsync)

    def finish(self) -> None:
        """Wait for the copy to durable storage in flight; a failure is a warning (or raises with
        on_error "raise"): the checkpoint stays in memory, the durable tier as it was.  An
        asynchronous memory save in flight commits first; then the memory tier is trimmed to
        ``keep`` again, the checkpoint just copied no longer kept for its copy (it stayed a
        ``keep`` + 1st until the next save when the copy outlasted the memory save)."""
        trim = self.memory.pending is not None or self.thread is not None    # (else nothing changed)
        if self.memory.pending is not None:
            self.memory.finish()
        self._end_copy()
        if trim:
            for mem, tag, *_ in list(self.newest.values()):
                self._retain(mem, (tag,))
        if self.chain is not None:
            self.chain.copy()         # (the persisted base's deltas written so far)

    def _end_copy(self) -> None:
        """Wait for the copy to durable storage in flight (only that) and report it."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        tag, self.persisting = self.persisting, None
        e, self.error = self.error, None
        if e is not None:       # (any error: a storage's OSError too, as an asynchronous save says it)
            if self.on_error == "raise":
                raise e
            warnings.warn(f"AdaCheck: copying {tag} from the memory tier to durable storage failed; it stays in "
                          f"memory and the checkpoint directory is as it was (on_error: warn): {e}", SaveWarning,
                          stacklevel=3)

    # ------------------------------------------------------------------ load
    def choose(self, comm, store: Storage, load_dir: str, tag: Optional[str], everything: bool = False,
               reads_objects_of: Sequence[int] = ()) -> Tuple[Storage, str, str, Optional[str]]:
        """(storage, directory, tier, tag) to load from: the memory tier when the nodes' memories
        hold ``tag`` complete between them (or, without one, the checkpoint the memory's ``latest``
        names, as every save that moves ``latest`` writes it there first: see :func:`newer_in_memory`),
        else the checkpoint directory (tag as given).  Decided by rank
        0 for every rank; a node that lacks files its ranks need (a node replaced after a loss:
        the peer copies; another layout: every region, as with ``everything``) gets them from the
        nodes that hold them first (collective), and the objects of the saving ranks each of its
        ranks reads (``reads_objects_of``, see Checkpointer.load)."""
        self.finish()
        mem = self.location(store, load_dir)
        placed = comm.all_gather_object((self.node_id(), tuple(int(r) for r in reads_objects_of)))
        nodes = [n for n, _ in placed]
        self.across = len(set(nodes)) > 1
        leads = NodeSpread(tuple(nodes), False).leads(comm.rank)
        # (rank 0 decides for every rank)
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
                    return store, load_dir, "durable", tag
                if got:
                    log.info("AdaCheck: rank %d received %.1f MB of %s from other nodes' memory (a node's own memory "
                             "lacked them) in %.2fs", comm.rank, got / 1e6, plan["tag"], time.perf_counter() - t0)
            if tag is None and leads and os.path.isdir(mem) and commit.latest_or_none(mem, LOCAL) != plan["tag"]:
                commit.write_latest(mem, plan["tag"], LOCAL)     # (a node that lacked it: its newest now)
            log.info("AdaCheck: loading %s from the memory tier (%s) instead of %s", plan["tag"], mem, load_dir)
            return LOCAL, mem, "memory", plan["tag"]
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
        return store, load_dir, "durable", tag

    # ------------------------------------------------------------------ exit
    def _persist_chain(self, mem: str, tag: str, store: Storage, save_dir: str, after: Optional[int] = None,
                       timeout_s: float = 120.0) -> bool:
        """At a clean exit, after its base: this rank's online deltas of the newest memory checkpoint
        go to durable storage with it (so the job's last steps outlive its memory files), and a
        marker says how that went.  On a node's lowest rank: whether every rank of the node copied
        its part (it waits for their markers); only then may the memory files go."""
        src = os.path.join(mem, tag)
        if not os.path.isdir(deltas.deltas_dir(src)):
            return True
        outcome = b"ok"
        try:
            last = deltas.copy_chain(src, LOCAL, store.join(save_dir, tag), store, self.rank, fsync=self.fsync,
                                     after=after)
            if last is not None:
                log.info("AdaCheck: rank %d's online deltas of %s are in %s up to step %d (at exit)", self.rank, tag,
                         save_dir, last)
        except Exception as e:  # noqa: BLE001 - the interpreter is exiting: the memory copy stays
            outcome = b"failed"
            log.warning("AdaCheck: at exit, rank %d's online deltas of %s could not be copied to %s (%s); they stay "
                        "in the memory tier (%s)", self.rank, tag, save_dir, e, mem)
        LOCAL.write_atomic(os.path.join(src, f"{CHAIN_COPIED}{self.rank:05d}"), outcome, fsync=False)
        if not self.leads or self.nodes is None:
            return outcome == b"ok"
        markers = [os.path.join(src, f"{CHAIN_COPIED}{r:05d}") for r in NodeSpread(self.nodes, False).ranks_on(
            self.nodes[self.rank])]
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(m) for m in markers) and time.monotonic() < deadline:
            time.sleep(0.05)
        missing = [m for m in markers if not os.path.exists(m)]
        failed = [m for m in markers if m not in missing and LOCAL.read_bytes(m) != b"ok"]
        if missing or failed:
            log.warning("AdaCheck: at exit, not every rank copied its online deltas of %s to %s (%d did not finish "
                        "within %.0fs, %d failed); the memory tier keeps them (%s)", tag, save_dir, len(missing),
                        timeout_s, len(failed), mem)
            return False
        return True

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
            if not commit.has_manifest(os.path.join(mem, tag), LOCAL):
                # its memory save failed (said when it did): the newest that committed is the job's state
                self._note_committed(durable)
                before = self.committed.get(durable)
                if self.rank == 0:
                    log.warning("AdaCheck: at exit, %s is not in the memory tier (its save failed); %s", tag,
                                f"persisting {before[1]}, the newest checkpoint there, instead" if before else
                                "no earlier checkpoint of this job is there either")
                if before is None:
                    if self.leads and not any(commit.has_manifest(os.path.join(mem, t), LOCAL) for t in LOCAL.list(mem)):
                        _remove_job_memory(mem)     # (no committed checkpoint there: nothing to keep)
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
                done = self._persist_chain(mem, tag, store, save_dir, after=copied)
            if done and self.leads and self.rank != 0:
                # (another node's memory: it goes once rank 0 has committed the copy in durable storage)
                deadline, dst = time.monotonic() + 120.0, store.join(save_dir, tag)
                while not commit.has_manifest(dst, store) and time.monotonic() < deadline:
                    time.sleep(0.1)
                done = commit.has_manifest(dst, store)
            if done and self.leads:
                _remove_job_memory(mem)
        self.newest.clear()
        self.committed.clear()
        self.owed.clear()
        self.memory.close()       # (its writer process, if any, stops)
