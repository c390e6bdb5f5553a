"""Copies from the memory tier to durable storage: a checkpoint's files, each rank its own
(:func:`persist_checkpoint`), and the online deltas of its chain as they are written
(:class:`ChainCopy`)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

from ..storage import commit
from ..storage import manifest_files
from ..online import deltas
from ..format.manifest import RANKED_SINCE, own_files, part_name, part_names
from ..format.manifest_read import parse
from ..storage.backends import LOCAL, Storage, copy_file
from .location import PERSIST_TIMEOUT_S
from .location import CHAIN_COPIED
from .peers import NodeSpread

log = logging.getLogger("adacheck")


def _marker(rank: int) -> str:
    return f".persisted-rank{rank:05d}"


def _copied_by(manifest, rank: int) -> List[str]:
    """The files of a committed memory checkpoint that ``rank`` copies to durable storage: the shard
    file it wrote and, for a manifest in parts (format 5), its part of the tensor table and its rank
    file (rank 0: the meta file too), so that no rank copies more than its own."""
    if manifest.index is None or manifest.format_version < RANKED_SINCE:     # format 4: no rank files
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
                     open_part=manifest_files.PartFiles(LOCAL, src_dir))
    dst = dst_store.join(dst_dir, tag)
    dst_store.make_dirs(dst)
    copiers = _copiers(manifest)
    told = {}       # file -> (its size, its content tag as it showed once copied)
    for fname in _copied_by(manifest, rank):
        path = dst_store.join(dst, fname)
        size = copy_file(LOCAL, LOCAL.join(src_dir, fname), dst_store, path, fsync=fsync)
        if fname in manifest.files:       # a shard file: its size as its writer committed it
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
    manifest_files.write_manifest_bytes(dst, manifest_bytes, dst_store)
    for r in copiers:
        dst_store.remove(dst_store.join(dst, _marker(r)))
    if update_latest:
        fence(dst_store, dst_dir, f"publishing {tag!r} ('latest') from the memory tier")
        commit.write_latest(dst_dir, tag, dst_store)
    commit.leave_readme(dst_dir, dst_store)
    # (only this tag's earlier generations and what retention retired: another rank may already be
    # copying the next checkpoint into a directory that has no manifest yet)
    commit.tidy_after(dst_dir, tag, keep_last, dst_store, only_touched=True)
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
    for t, summary in commit.summaries(save_dir, store):
        if summary is not None:
            step = summary.step if summary.step is not None else -1
            if best is None or step > best[1]:
                best = (t, step)
    return best


def held_in(mem: str) -> Tuple[int, int]:
    """(complete checkpoints, bytes of every file) in a memory location."""
    count = sum(1 for _, summary in commit.summaries(mem, LOCAL) if summary is not None) if os.path.isdir(mem) else 0
    size = 0
    for d, _, fs in os.walk(mem):
        for f in fs:
            try:
                size += os.path.getsize(os.path.join(d, f))
            except FileNotFoundError:
                pass        # renamed meanwhile by a rank's writer: a step's temporary, a spare taken
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
                # on to the next base once its first step continues the chain: the bridged step is here
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


def persist_chain(rank: int, nodes: Optional[Sequence[str]], fsync: bool, mem: str, tag: str, store: Storage,
                  save_dir: str, after: Optional[int] = None, timeout_s: float = 120.0) -> bool:
    """At a clean exit, after its base: this rank's online deltas of the newest memory checkpoint
    go to durable storage with it (so the job's last steps outlive its memory files), and a
    marker says how that went.  On a node's lowest rank: whether every rank of the node copied
    its part (it waits for their markers); only then may the memory files go."""
    src = os.path.join(mem, tag)
    if not os.path.isdir(deltas.deltas_dir(src)):
        return True
    outcome = b"ok"
    try:
        last = deltas.copy_chain(src, LOCAL, store.join(save_dir, tag), store, rank, fsync=fsync,
                                 after=after)
        if last is not None:
            log.info("AdaCheck: rank %d's online deltas of %s are in %s up to step %d (at exit)", rank, tag,
                     save_dir, last)
    except Exception as e:  # noqa: BLE001 - the interpreter is exiting: the memory copy stays
        outcome = b"failed"
        log.warning("AdaCheck: at exit, rank %d's online deltas of %s could not be copied to %s (%s); they stay "
                    "in the memory tier (%s)", rank, tag, save_dir, e, mem)
    LOCAL.write_atomic(os.path.join(src, f"{CHAIN_COPIED}{rank:05d}"), outcome, fsync=False)
    if nodes is None:
        return outcome == b"ok"
    markers = [os.path.join(src, f"{CHAIN_COPIED}{r:05d}") for r in NodeSpread(nodes, False).ranks_on(
        nodes[rank])]
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
