"""The one place that hashes tensor bytes: xxh3-128, streamed in chunks.

The digest is written as ``"xxh3_128:<32 hex digits>"`` so that the algorithm can change
without ambiguity.

A stored box's digest (format 2) covers what the box claims to be as well as its bytes:
:func:`bound_digest` hashes an *identity* (the logical tensor's name, dtype and shape, and the
box's offsets and lengths) ahead of the bytes, so a manifest edit that moves a box to another
place or tensor (swapped offsets, swapped names) no longer matches its bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Optional, Sequence

import torch
import xxhash

ALGORITHM = "xxh3_128"
_CHUNK = 64 << 20  # bytes handed to the hasher at once


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` have the same shape, dtype and bytes (NaN payloads and signed zeros
    included): the proof that a weight is its master's cast, which lets a save store the cast
    as a derivation instead of its bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = (t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
    # compared as the widest integers that tile both (one comparison per 8 bytes, not per byte)
    for wide, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if x.numel() % size == 0 and x.data_ptr() % size == 0 and y.data_ptr() % size == 0:
            return bool(torch.equal(x.view(wide), y.view(wide)))
    return bool(torch.equal(x, y))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without copying."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def hash_buffer(buf, identity: bytes = b"") -> str:
    h = xxhash.xxh3_128()
    if identity:
        h.update(identity)
    view = memoryview(buf).cast("B")
    for i in range(0, len(view), _CHUNK):
        h.update(view[i:i + _CHUNK])
    return f"{ALGORITHM}:{h.hexdigest()}"


def _cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().to("cpu").contiguous()
    return t.detach()


def hash_tensor(t: torch.Tensor) -> str:
    """Hash of the tensor's row-major bytes alone (copied to a contiguous CPU tensor if needed);
    format 1 checkpoints recorded these."""
    return hash_buffer(tensor_bytes(_cpu(t)))


_IDENTITY_TAG = b"adacheck-identity-v1\n"


def identity(*fields) -> bytes:
    """The bytes :func:`bound_digest` puts ahead of a tensor's: a tag, the length, then the
    fields as compact JSON (names, dtype names, shapes, offsets: strings and integer lists)."""
    text = json.dumps(list(fields), separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return _IDENTITY_TAG + len(text).to_bytes(8, "little") + text


def box_identity(name: str, dtype: str, shape: Sequence[int], offsets: Sequence[int],
                 lengths: Sequence[int]) -> bytes:
    """The identity of box (``offsets``, ``lengths``) of logical tensor ``name``."""
    return identity("box", name, dtype, list(shape), list(offsets), list(lengths))


def bound_digest(ident: bytes, t: torch.Tensor) -> str:
    """Hash of ``ident`` (see :func:`identity`) followed by the tensor's row-major bytes: equal
    only for equal bytes claimed to be the same thing."""
    return hash_buffer(tensor_bytes(_cpu(t)), ident)


THREADS: Optional[int] = None      # set: overrides hash_threads() (tests take each path this way)
_LOCAL_RANKS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")   # torchrun, deepspeed, Open MPI
_POOL: Dict[str, object] = {}


def hash_threads() -> int:
    """How many threads this rank hashes on, at most 4: the cores it may run on (its CPU
    affinity), divided among the node's ranks when none is bound to cores of its own (the
    launcher's count of ranks on this node).  One: a rank hashes in its own thread, right after
    the read or copy that brought the bytes (still in cache), not on threads that would compete
    for the cores the node's other ranks read and write with.  More: beside them."""
    if THREADS is not None:
        return THREADS
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if cores >= (os.cpu_count() or 1):         # not bound: the node's ranks share every core
        for var in _LOCAL_RANKS:
            try:
                cores //= max(1, int(os.environ[var]))
                break
            except (KeyError, ValueError):
                continue
    return max(1, min(4, cores))


def in_background(fn: Callable, *args) -> Future:
    """``fn(*args)`` on this process's hashing threads (:func:`hash_threads`; xxh3 releases the GIL,
    so hashes run beside the caller's reads and beside each other).  A forked child starts its own
    threads: its parent's do not exist in it.  Once the interpreter is ending (a save committed
    by the exit hook), no thread takes new work: ``fn`` runs here, at once."""
    if _POOL.get("pid") != os.getpid():
        _POOL.update(pid=os.getpid(), pool=ThreadPoolExecutor(hash_threads(), thread_name_prefix="adacheck-hash"))
    try:
        return _POOL["pool"].submit(fn, *args)
    except RuntimeError:         # "cannot schedule new futures after (interpreter) shutdown"
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:
            done.set_exception(e)
        return done


def check_digest_format(digest) -> bool:
    if not isinstance(digest, str) or not digest.startswith(ALGORITHM + ":"):
        return False
    hexpart = digest[len(ALGORITHM) + 1:]
    return len(hexpart) == 32 and all(c in "0123456789abcdef" for c in hexpart)


def owner_of(name: str, n: int) -> int:
    """Which of ``n`` owners a name belongs to: the rank that decides about a tensor when a save's
    decisions are partitioned (adacheck.plan.partition), the part of a manifest that lists it.  A
    stable hash of the name: the same on every rank, every run and every Python."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "big") % n
