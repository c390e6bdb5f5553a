"""Copies between nodes: which ranks lead a node and which node keeps a copy of another's files
(:class:`NodeSpread`), the online deltas' copies (:class:`DeltaSpread`), and the packing and
checked receiving of files sent between ranks."""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..storage import commit
from ..online import deltas
from ..format.compression import ENCODING_KEY
from ..errors import FormatError
from ..format.safetensors_file import SafetensorsFile
from ..storage.backends import LOCAL
from ..storage.direct import SpareFiles
from .location import spares_of

log = logging.getLogger("adacheck")


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
        comm.transfer([(w, d) for _, w, d in moves], lambda i: file_as_tensor(os.path.join(ckpt_dir, moves[i][0])),
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

    exit_order = 0.5      # at exit: after the delta logs, which hand it their last steps

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
        self._outgoing, self._incoming = defaultdict(Reused), defaultdict(Reused)     # by move
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
            got = self.comm.transfer(self.moves, read, deliver, sizes=[0] * len(self.moves),    # one round
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
            self._buf = None        # freed before the larger one is made
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
        head = _block_head([(json_name, len(record)), (grad_name, size)]) + record    # the record's name sorts first
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


def file_as_tensor(path: str):
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
                f.truncate()        # a longer spare's rest
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
