"""Online gradient deltas: the per-step log between base checkpoints (framework-free).

Between two base (full) checkpoints, each optimizer step is stored as what the optimizer
consumed: the gradient of every tensor it stepped, plus JSON scalars (hyper-parameters at
the step, counters, scheduler / loss-scaler state, this rank's RNG).  On disk, inside the
base checkpoint's directory::

  deltas/chain.json                      the base: tag, step, generation, bytes, save seconds (rank 0)
  deltas/<step:010d>/rank<r>.safetensors the gradients rank r stored for that step
  deltas/<step:010d>/rank<r>.json        rank r's record of the step, written LAST
                                         (tmp + fsync + rename) after its tensors are durable

A step is **committed** when every rank of the base's world has a valid record for it
carrying the same chain ``nonce`` (a fresh random id per incarnation of the chain, so
records of a crashed run never combine with those of the run that recovered from it).
Recovery replays the committed steps that directly follow the base, in order, and stops
at the first gap.  The chain file and every record name the generation of the base they
follow: a tag saved again (a new generation) starts a chain of its own, and the steps of an
earlier save of that tag are never replayed on it (a chain file of another generation: no step
is committed; a record of another generation: the chain stops there).

Gradients are stored in the narrowest dtype that reproduces them bit-exactly: an fp32
gradient whose values are all exact bf16 values is stored as bf16 (proved per tensor by
reading the low halves of their bits); ``compact`` stores bf16 regardless and records the
largest rounding error, and with each step (``deviation``) how far a recovery to it is from
the recording run's state, measured by the recorder on a shadow of the optimizer state.
The hook only copies gradients into preallocated staging buffers (a GPU's fp32 gradient split
into the halves of its bits, the proof that it is bf16 counted by the device:
:meth:`DeltaLog._add_split`); a background thread proves, casts, hashes and writes them.  At most
``queue_depth`` steps wait for the writer: the next step blocks until one is free.  A copy
from a GPU is asynchronous: each slot records a CUDA event after its copies (per stream), and
the writer waits on those events, never on the whole device, before it reads the buffers.
A log still open when the interpreter exits is flushed and closed then
(:mod:`adacheck.checkpoint.lifecycle`): a script that ends without ``engine.destroy()`` keeps its last step.

Record format 2 binds each stored tensor's hash to what it claims to be (the step, the
gradient's key, stored dtype and shape: :func:`adacheck.format.hashing.bound_digest`); records of
format 1 (hashes of the bytes alone) still replay.  Every record is validated before any of
it is used: a record file that is present but malformed or inconsistent is an error naming
it, not the end of the chain (a step whose record is missing is simply not committed).

Nothing here calls torch.distributed: the integration agrees on the nonce and the plan.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..storage import commit

from ..format import jsontree

from ..checkpoint import lifecycle
from ..errors import ConfigError, FormatError, IntegrityError
from ..format.hashing import bound_digest, check_digest_format, hash_tensor, identity
from ..format.safetensors_file import SafetensorsFile
from ..storage.backends import LOCAL, PosixStorage, Storage, copy_file
from ..types import DTYPES, dtype_name, torch_dtype
from ..format.writer import BLOCK, SpareFiles

log = logging.getLogger("adacheck")

DELTAS = "deltas"
CHAIN = "chain.json"
RECORD_VERSION = 2
READABLE_RECORDS = (1, 2)
_STEP_DIR = re.compile(r"^\d{10}$")
GRAD = "grad/"      # the key prefix of a stored gradient in a delta file


def deltas_dir(ckpt_dir: str, store: Storage = LOCAL) -> str:
    return store.join(ckpt_dir, DELTAS)


def step_dir(ckpt_dir: str, step: int, store: Storage = LOCAL) -> str:
    return store.join(ckpt_dir, DELTAS, f"{step:010d}")


def bf16_exact(t: torch.Tensor, out: Optional[torch.Tensor] = None) -> Tuple[bool, Optional[torch.Tensor]]:
    """(t holds only exact bf16 values, t as bf16 or None): the bf16 copy reproduces t bit
    for bit.  A strided sample is checked first, so an inexact tensor (the common fp32 case)
    costs a few thousand elements instead of a full pass; True is always proved in full.

    An fp32 value is a bf16 value exactly when its low 16 bits are zero, and the bf16 value is
    then its high 16 bits (widening them back gives every bit again, NaN payloads included).
    On little-endian machines that is read straight from the bytes: one pass over the low
    halves and one copy of the high halves, no full-size temporaries (measured 5-6x faster
    than casting to bf16 and back, on 10M elements).  ``out``: a bf16 CPU tensor of t's size
    that receives the copy (the writer reuses one per gradient: a new 42 MB tensor's first
    touch of its pages cost 3.6x the copy itself, 31 ms against 8.6 ms)."""
    flat = t.reshape(-1)
    if t.dtype == torch.float32 and sys.byteorder == "little" and flat.is_contiguous() and flat.numel():
        halves = flat.view(torch.int16)
        low, high = halves[0::2], halves[1::2]
        if low.numel() > (1 << 16) and torch.count_nonzero(low[:: low.numel() // 4096 + 1]):
            return False, None
        if torch.count_nonzero(low):
            return False, None
        if out is None or out.dtype != torch.bfloat16 or out.numel() != flat.numel() or out.device != t.device:
            return True, high.contiguous().view(torch.bfloat16).view(t.shape)
        out.reshape(-1).view(torch.int16).copy_(high)
        return True, out.view(t.shape)
    if flat.numel() > (1 << 16):
        sample = flat[:: flat.numel() // 4096 + 1]
        if not torch.equal(sample.to(torch.bfloat16).to(t.dtype), sample):
            return False, None
    b = t.to(torch.bfloat16)
    back = b.to(t.dtype)
    ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]
    return bool(torch.equal(back.view(ints), t.view(ints))), b


def rounding_error(stored: torch.Tensor, g: torch.Tensor) -> float:
    """The largest distance between ``g`` and its rounded form ``stored``; elements kept as they
    were (infinities, NaNs) count 0, an element rounded to an infinity counts inf."""
    if not g.numel():
        return 0.0
    back = stored.float()
    kept = (back == g) | (back.isnan() & g.isnan())
    return float(torch.where(kept, 0.0, (back - g).abs()).max())


def compact_form(g: torch.Tensor) -> torch.Tensor:
    """A copy of ``g`` as ``compact`` stores it: fp32 as bf16 (rounded), other dtypes as they are."""
    return g.to(torch.bfloat16) if g.dtype == torch.float32 else g.clone()


# ----------------------------------------------------------------------------- the base rule
def auto_interval(base_bytes: int, base_seconds: float, delta_bytes: int, replay_seconds: float,
                  cap: int = 100000) -> int:
    """Deltas to take before the next base for ``base_interval: "auto"``.

    The rule: a new base is due once the deltas since the last one would cost more bytes
    than a base (``n * delta_bytes > base_bytes``) or more estimated replay time than
    writing a base (``n * replay_seconds > base_seconds``).  Returns the largest ``n`` that
    stays within both (at least 1, at most ``cap``).
    """
    if min(base_bytes, delta_bytes) < 0 or min(base_seconds, replay_seconds) < 0:
        raise ValueError("auto_interval needs non-negative sizes and times")
    n = cap
    if delta_bytes > 0:
        n = min(n, base_bytes // delta_bytes)
    if replay_seconds > 0:
        n = min(n, int(base_seconds / replay_seconds))
    return max(1, int(n))


# ----------------------------------------------------------------------------- writing
def tensor_identity(step: int, name: str, dtype: str, shape) -> bytes:
    """What a stored delta tensor claims to be (record format 2): its step, name (``grad/<key>``
    or an extra tensor's), stored dtype and shape."""
    return identity("delta", int(step), name, dtype, list(shape))


@dataclass
class _Slot:
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    keys: List[str] = field(default_factory=list)
    layout: tuple = ()      # what :func:`_arrange` laid out last
    # key -> the writer's bf16 copy of an exact fp32 gradient, reused from step to step
    bf16: Dict[str, torch.Tensor] = field(default_factory=dict)
    # fp32 gradients staged split (:meth:`DeltaLog.add`): key -> the low halves of their bits and
    # how many of those the device counted nonzero (buffers[key] holds the high halves, as bf16)
    low: Dict[str, torch.Tensor] = field(default_factory=dict)
    nonzero: Dict[str, torch.Tensor] = field(default_factory=dict)
    split: Dict[str, torch.Size] = field(default_factory=dict)    # this step's split keys -> shape
    # stream -> CUDA event recorded after this step's last copy into the buffers on that stream
    events: Dict[object, object] = field(default_factory=dict)


def _wait(events) -> None:
    """Block (the writer thread) until the device-to-host copies before ``events`` have landed."""
    for ev in events:
        ev.synchronize()


def _staged(t: torch.Tensor, events: Dict[object, object]) -> torch.Tensor:
    """``t`` copied to host memory for the writer thread: a GPU tensor into pinned memory without
    waiting (the copy's event goes into ``events``), a CPU one as a private copy."""
    t = t.detach()
    if not t.is_cuda:
        return t.to("cpu", copy=True).contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    _record(events, t.device)
    return out


def _record(events: Dict[object, object], device) -> None:
    stream = torch.cuda.current_stream(device)
    ev = torch.cuda.Event(blocking=True)     # (the writer sleeps while it waits, it does not spin on a core)
    ev.record(stream)
    events[stream] = ev


def _arrange(slot: _Slot) -> None:
    """Lay the slot's staging buffers of the step just written out back to back, in file order
    (sorted keys), in one block-aligned allocation: the next step staged into them goes to the
    device without another copy (:class:`~adacheck.format.writer.DirectFileWriter` writes the run
    straight from memory when it is stored as staged, e.g. inexact fp32 gradients).  Done again
    only when the staged keys, dtypes or shapes change.  Dtypes whose sizes would misalign a
    view are left in separate buffers."""
    keys = sorted(slot.keys)
    layout = tuple((k, slot.buffers[k].dtype, tuple(slot.buffers[k].shape)) for k in keys)
    if layout == slot.layout or not keys:
        return
    spans, n = [], 0
    for _, dt, shape in layout:
        if n % dt.itemsize:
            return
        spans.append((n, n + math.prod(shape) * dt.itemsize))
        n = spans[-1][1]
    pinned = slot.buffers[keys[0]].is_pinned()
    slot.buffers = {}                     # (written: free them before the new block)
    raw = torch.empty(n + BLOCK, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % BLOCK
    for (k, dt, shape), (a, b) in zip(layout, spans):
        slot.buffers[k] = raw[skip + a:skip + b].view(dt).view(shape)
    slot.layout = layout


_SPLIT_PIECE = 1 << 24      # values of a gradient split at once (DeltaLog._add_split)
_SPLIT_MIN = 1 << 20        # fewer values: a GPU gradient is staged whole (DeltaLog._splits)


def _background_priority() -> None:
    """Let the training threads win the CPU over this writer (Linux sets niceness per thread);
    when the writer falls behind, the staging slots apply back-pressure instead."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):   # not Linux, or not permitted: keep the default
        pass


class DeltaLog:
    """This rank's writer of one chain (the deltas of one base checkpoint).

    ``begin(step)`` reserves a staging slot (blocks while ``queue_depth`` steps wait),
    ``add(key, grad)`` copies one gradient into it, ``submit(step, record)`` hands the step
    to the background writer.  ``flush()`` waits for everything submitted.
    """
    exit_order = 0      # (closed at exit before a memory tier copies the chain: lifecycle)

    def __init__(self, ckpt_dir: str, rank: int, nonce: str, *, fsync: bool = True,
                 queue_depth: int = 2, compact: bool = False, on_error: str = "disable", store: Storage = LOCAL,
                 on_written: Optional[Callable[[str, int, bool], None]] = None, spares: Optional[str] = None,
                 split: Optional[bool] = None, reuse: Optional["DeltaLog"] = None,
                 generation: Optional[int] = None):
        self.ckpt_dir, self.rank, self.nonce, self.store = ckpt_dir, rank, nonce, store
        self.generation = generation     # the base's: every record names it (committed_steps)
        # stage fp32 gradients split into the high and low halves of their bits, the proof that
        # they are bf16 counted where they are (None: GPU gradients only; see add())
        self.split = None if split is None else bool(split) and sys.byteorder == "little"
        self._inexact: set = set()       # keys whose last step was not bf16 (the writer's hint to add())
        # (called with (ckpt_dir, step, written?) for every step submitted, in order, written or not)
        self.on_written = on_written
        self.fsync, self.compact, self.on_error = fsync, compact, on_error
        self.disabled = False
        self.error: Optional[BaseException] = None
        self.bytes_written = 0
        self.steps_written = 0
        self.write_seconds = 0.0
        self.write_cpu_seconds = 0.0     # CPU time of the writer thread (proving, hashing, writing)
        self.stage_seconds = 0.0         # training time spent copying gradients into staging
        self.stall_seconds = 0.0         # training time spent waiting for a free staging slot
        self.staged_bytes = 0            # gradient bytes copied into staging (as they arrive, before bf16 proofs)
        self.started = time.perf_counter()
        self.last_written: Optional[int] = None
        self._free: "queue.Queue[_Slot]" = queue.Queue()
        # ``reuse``: the closed log of the chain before, whose staging buffers (allocated, pinned,
        # their pages touched, laid out) and hints this one takes over: a new chain's first steps
        # would otherwise pay for all of that again on the training thread, at every base
        slots = reuse._take_slots() if reuse is not None else []
        for slot in (slots + [_Slot() for _ in range(queue_depth - len(slots))])[:queue_depth]:
            self._free.put(slot)
        if reuse is not None:
            self._inexact |= reuse._inexact
        self._jobs: "queue.Queue" = queue.Queue()
        self._slot: Optional[_Slot] = None
        self._slot_step: Optional[int] = None
        self._file_writer = store.tensor_writer()     # (the background thread's: O_DIRECT on POSIX)
        if spares is not None and self._file_writer is not None:     # (files to write over: the memory tier's)
            self._file_writer.spares = SpareFiles(spares)
        self._thread = threading.Thread(target=self._run, name=f"adacheck-deltas-r{rank}", daemon=True)
        self._thread.start()
        self._closed = False
        lifecycle.keep(self)      # flushed and joined at interpreter exit if still open

    def _take_slots(self) -> List[_Slot]:
        """The staging slots of this closed log, for the next chain's (once)."""
        if not self._closed:
            raise RuntimeError("DeltaLog: staging slots are handed over only once the log is closed")
        slots = [] if self._slot is None else [self._slot]
        self._slot = None
        while not self._free.empty():
            slots.append(self._free.get_nowait())
        return slots

    @property
    def files_reused(self) -> int:
        """Steps whose file was written over a spare (the memory tier's) instead of a new one."""
        return getattr(self._file_writer, "reused", 0)

    # -- hook side (training thread)
    def begin(self, step: int) -> None:
        if self.disabled or self._slot is not None:
            return
        self._check_error()
        t0 = time.perf_counter()
        self._slot = self._free.get()   # back-pressure: wait for the writer
        self.stall_seconds += time.perf_counter() - t0
        self._slot.keys = []
        self._slot.events = {}
        self._slot.split = {}
        self._slot_step = step

    def add(self, key: str, grad: torch.Tensor) -> None:
        """Copy ``grad`` into this step's staging buffer for ``key`` (the only per-step cost)."""
        if self.disabled:
            return
        s = self._slot
        if s is None:
            raise RuntimeError("DeltaLog.add before begin")
        t0 = time.perf_counter()
        g = grad.detach()
        pin = g.is_cuda and torch.cuda.is_available()
        if self._splits(key, g):
            self._add_split(s, key, g, pin)
        else:
            buf = s.buffers.get(key)
            s.low.pop(key, None)
            if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
                buf = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=pin)
                s.buffers[key] = buf
            buf.copy_(g, non_blocking=g.is_cuda)
        if g.is_cuda:      # the writer reads the buffers only once these copies have landed
            _record(s.events, g.device)
        s.keys.append(key)
        self.staged_bytes += g.numel() * g.element_size()
        self.stage_seconds += time.perf_counter() - t0

    def _splits(self, key: str, g: torch.Tensor) -> bool:
        """Whether ``g`` is staged split: an fp32 gradient that was bf16 at its last step, or has no
        last step; unless ``split`` says, on a GPU and of ``_SPLIT_MIN`` values or more (a split
        launches five or so kernels and copies instead of one copy: for a small gradient the
        launches cost the training thread more than the writer's proof of it costs the writer)."""
        if g.dtype != torch.float32 or not g.is_contiguous() or not g.numel() or key in self._inexact:
            return False
        if self.split is not None:
            return self.split
        return g.is_cuda and g.numel() >= _SPLIT_MIN and sys.byteorder == "little"

    @staticmethod
    def _add_split(s: _Slot, key: str, g: torch.Tensor, pin: bool) -> None:
        """Stage fp32 ``g`` as the high halves of its bits (buffers[key], bf16), the low halves
        (low[key]) and the count of nonzero low halves (nonzero[key]), all computed where ``g``
        is.  A bf16 gradient (a bf16 run's, upcast: every low half zero) is then proved and cast
        by the device, and the writer stores the high halves as they landed, with no pass of its
        own over them: on an H200 host proving and casting 84 MB took the writer more CPU than
        the training step's time.  An fp32 gradient that is not bf16 is put together again from
        its halves by the writer, and the next step stages it whole.  In pieces of
        ``_SPLIT_PIECE`` values: the device's temporaries (each half made contiguous before it is
        copied out, the count's) stay under 64 MB, whatever the gradient's size."""
        n = g.numel()
        halves = g.reshape(-1).view(torch.int16).view(n, 2)     # (little-endian: [low, high] per value)
        high, low, nz = s.buffers.get(key), s.low.get(key), s.nonzero.get(key)
        if high is None or high.dtype != torch.bfloat16 or high.shape != g.shape:
            high = s.buffers[key] = torch.empty(g.shape, dtype=torch.bfloat16, pin_memory=pin)
        if low is None or low.numel() != n:
            low = s.low[key] = torch.empty(n, dtype=torch.int16, pin_memory=pin)
        if nz is None:
            nz = s.nonzero[key] = torch.empty((), dtype=torch.int64, pin_memory=pin)
        flat_high, counts = high.view(-1).view(torch.int16), []
        for a in range(0, n, _SPLIT_PIECE):
            part = halves[a:a + _SPLIT_PIECE]
            flat_high[a:a + _SPLIT_PIECE].copy_(part[:, 1], non_blocking=g.is_cuda)
            low[a:a + _SPLIT_PIECE].copy_(part[:, 0], non_blocking=g.is_cuda)
            counts.append(torch.count_nonzero(part[:, 0]))
        nz.copy_(counts[0] if len(counts) == 1 else torch.stack(counts).sum(), non_blocking=g.is_cuda)
        s.split[key] = g.shape

    def discard(self) -> None:
        """Drop what ``begin`` staged (the step is covered by a base checkpoint instead)."""
        if self._slot is not None:
            self._free.put(self._slot)
            self._slot = None

    def submit(self, step: int, record: dict, rank_tensors: Optional[Dict[str, torch.Tensor]] = None,
               deviation: Optional[Dict[str, float]] = None) -> None:
        """Queue step ``step`` (``record``: JSON; ``rank_tensors``: small extra tensors;
        ``deviation``: compact mode's measured distance of a recovery to this step from the
        live state, by kind)."""
        if self.disabled:       # (the writer reports it as not written, after the steps queued before it)
            self._slot = None
            self._jobs.put((step, None, {}, {}, None, []))
            return
        self._check_error()
        slot, self._slot = self._slot, None
        if slot is not None and self._slot_step != step:
            raise RuntimeError(f"staged gradients of step {self._slot_step} submitted as step {step}")
        events = dict(slot.events) if slot is not None else {}
        extra = {k: _staged(t, events) for k, t in (rank_tensors or {}).items()}
        self._jobs.put((step, slot, record, extra, deviation, list(events.values())))

    def flush(self) -> None:
        self._jobs.join()
        self._check_error()

    def close(self) -> None:
        """Write everything submitted, then stop and join the writer thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        lifecycle.release(self)
        try:
            self.flush()
        finally:
            self._jobs.put(None)
            self._thread.join()

    def _check_error(self) -> None:
        if self.error is None or self.disabled:
            return
        e = self.error
        if self.on_error == "raise":
            raise e
        self.disabled = True
        warnings.warn(f"AdaCheck online mode disabled on rank {self.rank} after an error writing "
                      f"gradient deltas under {deltas_dir(self.ckpt_dir)}: {e}. Training goes on; "
                      "the last committed step and later base checkpoints stay recoverable "
                      "(set adacheck.online.on_error to \"raise\" to stop instead)")

    # -- writer side (background thread)
    def _run(self) -> None:
        _background_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            step, slot, record, extra, deviation, events = job
            written = False
            try:
                if self.error is None:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    _wait(events)
                    self._write(step, slot, record, extra, deviation)
                    written = True
                    if slot is not None:
                        _arrange(slot)
                    self.write_seconds += time.perf_counter() - t0
                    self.write_cpu_seconds += time.thread_time() - c0
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                self.error = e
            finally:
                if slot is not None:
                    self._free.put(slot)
                self._written(step, written)
                self._jobs.task_done()

    def _written(self, step: int, ok: bool) -> None:
        if self.on_written is not None:
            try:
                self.on_written(self.ckpt_dir, step, ok)
            except Exception as e:  # noqa: BLE001 - a follower's failure is its own to report
                log.warning("AdaCheck online: after step %d was written: %s", step, e)

    def _write(self, step: int, slot: Optional[_Slot], record: dict, extra: Dict[str, torch.Tensor],
               deviation: Optional[Dict[str, float]] = None) -> None:
        store = self.store
        d = step_dir(self.ckpt_dir, step, store)
        store.make_dirs(d)
        tensors, meta, extra_meta = {}, {}, {}
        for key in (slot.keys if slot is not None else []):
            g = slot.buffers[key]
            stored, err = g, None
            shape = slot.split.get(key)
            if shape is not None:       # staged split: the device counted the low halves
                if int(slot.nonzero[key]) == 0:
                    g = None            # (proved bf16: the high halves are the gradient)
                else:                   # not bf16: the fp32 values again, from their halves
                    g = torch.stack((slot.low[key], stored.reshape(-1).view(torch.int16)), 1) \
                        .view(torch.float32).view(shape)
                    stored = g
            if g is not None and g.dtype == torch.float32:
                exact, b = bf16_exact(g, slot.bf16.get(key))
                if exact:       # (kept for this slot's next step: the slot is reused only after this write)
                    stored = slot.bf16[key] = b
                else:           # (the next step is staged whole: see _splits)
                    self._inexact.add(key)
                if not exact and self.compact:
                    stored = b if b is not None else compact_form(g)
                    err = rounding_error(stored, g)
            stored = stored.contiguous()
            tensors[GRAD + key] = stored
            kept = dtype_name(stored.dtype)
            dtype = "float32" if shape is not None else dtype_name(g.dtype)
            meta[key] = {"dtype": dtype, "stored": kept, "shape": list(stored.shape),
                         "hash": bound_digest(tensor_identity(step, GRAD + key, kept, stored.shape), stored)}
            if err is not None:      # (JSON has no inf: an error that is not finite is "inf")
                meta[key]["max_abs_error"] = err if math.isfinite(err) else "inf"
        for name, t in extra.items():
            tensors[name] = t
            kept = dtype_name(t.dtype)
            extra_meta[name] = {"dtype": kept, "shape": list(t.shape),
                                "hash": bound_digest(tensor_identity(step, name, kept, t.shape), t)}
        fname = None
        size = 0
        if tensors:
            fname = f"rank{self.rank}.safetensors"
            size = store.write_tensors(store.join(d, fname), tensors, {"format": "adacheck-delta"}, fsync=self.fsync,
                                       writer=self._file_writer)
        rec = {"version": RECORD_VERSION, "step": step, "rank": self.rank, "nonce": self.nonce,
               "file": fname, "file_bytes": size, "tensors": meta, "extra": extra_meta,
               "lossy": any("max_abs_error" in v for v in meta.values()),
               "record": record}
        if self.generation is not None:
            rec["base_generation"] = self.generation
        if deviation is not None:     # JSON has no inf: a distance that is not finite is "inf"
            rec["deviation"] = {k: v if math.isfinite(v) else "inf" for k, v in deviation.items()}
        path = store.join(d, f"rank{self.rank}.json")
        text = json.dumps(rec, sort_keys=True, separators=(",", ":"), allow_nan=False)
        commit.atomic_write_text(path, text, fsync=self.fsync, store=store)
        self.bytes_written += size + len(text)
        self.steps_written += 1
        self.last_written = step


def write_chain(ckpt_dir: str, info: dict, fsync: bool = True, store: Storage = LOCAL) -> None:
    """Rank 0 notes what the chain's base cost (for the "auto" rule after a restart)."""
    store.make_dirs(deltas_dir(ckpt_dir, store))
    commit.atomic_write_text(store.join(deltas_dir(ckpt_dir, store), CHAIN),
                             json.dumps(info, sort_keys=True, allow_nan=False), fsync=fsync, store=store)


def copy_chain(src_dir: str, src_store: Storage, dst_dir: str, dst_store: Storage, rank: int,
               fsync: bool = True, after: Optional[int] = None) -> Optional[int]:
    """Copy rank ``rank``'s part of the delta chain of checkpoint ``src_dir`` to the same
    checkpoint at ``dst_dir`` (a memory-tier base persisted to durable storage), step by step:
    its gradients file, then its record, which commits the step for this rank (rank 0 copies
    the chain file first).  A step counts at the destination only once every rank's record is
    there, so a copy cut short leaves a shorter chain, never a wrong one.  ``after``: the last
    step copied before (only later ones are copied; None: from the start).  Returns the last
    step copied now or before."""
    if after is None and rank == 0 and read_chain(src_dir, src_store) is not None:
        dst_store.make_dirs(deltas_dir(dst_dir, dst_store))
        copy_file(src_store, src_store.join(deltas_dir(src_dir, src_store), CHAIN), dst_store,
                  dst_store.join(deltas_dir(dst_dir, dst_store), CHAIN), fsync=fsync)
    for s in step_dirs(src_dir, src_store):
        if after is not None and s <= after:
            continue
        src, dst = step_dir(src_dir, s, src_store), step_dir(dst_dir, s, dst_store)
        names = set(src_store.list(src))
        if f"rank{rank}.json" not in names:
            break          # (this rank's chain ends here, for now)
        dst_store.make_dirs(dst)
        for name in (f"rank{rank}.safetensors", f"rank{rank}.json"):
            if name in names:
                path = src_store.join(src, name)
                # (a local file is read with nobody writing over it: the memory tier gives a retired
                # chain's files away as spares, maybe while this copy falls behind)
                with SpareFiles.held(path) if isinstance(src_store, PosixStorage) else contextlib.nullcontext():
                    copy_file(src_store, path, dst_store, dst_store.join(dst, name), fsync=fsync)
        after = s
    return after


def read_chain(ckpt_dir: str, store: Storage = LOCAL) -> Optional[dict]:
    try:
        return json.loads(store.read_bytes(store.join(deltas_dir(ckpt_dir, store), CHAIN)).decode("utf-8"))
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- reading
@dataclass
class Step:
    """One committed step: every rank's record (rank -> dict)."""

    step: int
    records: Dict[int, dict]
    store: Storage = LOCAL      # where the step's files are

    @property
    def nonce(self) -> str:
        """The chain id of the run that recorded it (every record's: committed_steps checks)."""
        return next(iter(self.records.values()))["nonce"]

    def holder_of(self, key: str, prefer: int) -> int:
        """A rank whose file holds the gradient ``key`` (``prefer`` if it has it)."""
        if prefer in self.records and key in self.records[prefer]["tensors"]:
            return prefer
        for r in sorted(self.records):
            if key in self.records[r]["tensors"]:
                return r
        raise FormatError(f"delta step {self.step}: no rank stored the gradient {key!r}")

    @property
    def lossy(self) -> bool:
        return any(r.get("lossy") for r in self.records.values())

    @property
    def bytes(self) -> int:
        return sum(int(r.get("file_bytes", 0)) for r in self.records.values())

    def max_abs_error(self) -> float:
        return max([float(v.get("max_abs_error", 0.0)) for r in self.records.values() for v in r["tensors"].values()]
                   or [0.0])

    def deviation(self) -> Optional[Dict[str, float]]:
        """compact: how far a recovery to this step is from the recording run's state there
        (largest absolute difference over every rank's weights / optimizer state, measured while
        recording); None when no rank measured it."""
        got = [r["deviation"] for r in self.records.values() if isinstance(r.get("deviation"), dict)]
        if not got:
            return None
        return {k: max(float(d.get(k, "inf")) for d in got) for k in ("weights", "state")}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_tensor_meta(meta, where: str, recorded: bool) -> None:
    """One stored tensor's entry in a record: dtypes known, a shape of sizes, a digest (and for a
    gradient, ``recorded``: the dtype it had and the one it is stored in, bf16 only for fp32)."""
    if not isinstance(meta, dict):
        raise FormatError(f"{where} is not an object")
    if meta.get("dtype") not in DTYPES:
        raise FormatError(f"{where}.dtype {meta.get('dtype')!r} is not one of {sorted(DTYPES)}")
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(_int(n) and n >= 0 for n in shape):
        raise FormatError(f"{where}.shape {shape!r} is not a list of sizes")
    if not check_digest_format(meta.get("hash")):
        raise FormatError(f"{where}.hash {meta.get('hash')!r} is not an xxh3_128 digest")
    if recorded:
        kept = meta.get("stored")
        if kept != meta["dtype"] and not (meta["dtype"] == "float32" and kept == "bfloat16"):
            raise FormatError(f"{where}.stored {kept!r} is not {meta['dtype']!r} (or bfloat16 for float32)")
        err = meta.get("max_abs_error", 0.0)
        if err != "inf" and (isinstance(err, bool) or not isinstance(err, (int, float))):
            raise FormatError(f"{where}.max_abs_error {err!r} is not a number (or \"inf\")")


def check_record(rec, step: int, rank: int, where: str) -> dict:
    """``rec`` (a parsed rank<r>.json) if it is a valid record of ``rank`` at ``step``, else a
    FormatError naming the field: what a later reader relies on is checked here, once."""
    if not isinstance(rec, dict):
        raise FormatError(f"{where}: not a JSON object")
    if rec.get("version") not in READABLE_RECORDS:
        raise FormatError(f"{where}: record version {rec.get('version')!r} is not one this AdaCheck reads "
                          f"({', '.join(map(str, READABLE_RECORDS))})")
    if rec.get("step") != step or not _int(rec.get("step")) or rec.get("rank") != rank or not _int(rec.get("rank")):
        raise FormatError(f"{where}: the record says step {rec.get('step')!r} of rank {rec.get('rank')!r}, but it "
                          f"lies where step {step} of rank {rank} belongs (moved or copied delta files)")
    if not isinstance(rec.get("nonce"), str) or not rec["nonce"]:
        raise FormatError(f"{where}: nonce {rec.get('nonce')!r} is not a chain id")
    if "base_generation" in rec and (not _int(rec["base_generation"]) or rec["base_generation"] < 0):
        raise FormatError(f"{where}: base_generation {rec['base_generation']!r} is not a generation")
    if rec.get("file") not in (None, f"rank{rank}.safetensors"):
        raise FormatError(f"{where}: file {rec.get('file')!r} is not rank{rank}.safetensors in its step directory")
    if not _int(rec.get("file_bytes")) or rec["file_bytes"] < 0:
        raise FormatError(f"{where}: file_bytes {rec.get('file_bytes')!r} is not a size")
    for field_name, recorded in (("tensors", True), ("extra", False)):
        table = rec.get(field_name)
        if not isinstance(table, dict):
            raise FormatError(f"{where}: {field_name} is not an object")
        for key, meta in table.items():
            _check_tensor_meta(meta, f"{where}: {field_name}[{key!r}]", recorded)
    if (rec["tensors"] or rec["extra"]) and rec["file"] is None:
        raise FormatError(f"{where}: lists stored tensors but no file")
    if not isinstance(rec.get("lossy", False), bool):
        raise FormatError(f"{where}: lossy {rec.get('lossy')!r} is not true or false")
    tree = rec.get("record")
    if not isinstance(tree, dict):
        raise FormatError(f"{where}: record is not an object")
    missing = [n for n in jsontree.tensor_refs(tree) if not isinstance(n, str) or n not in rec["extra"]]
    if missing:
        raise FormatError(f"{where}: the record refers to tensors {missing[:4]} it does not store")
    dev = rec.get("deviation", {})
    if not isinstance(dev, dict) or not all(v == "inf" or (isinstance(v, (int, float)) and not isinstance(v, bool))
                                            for v in dev.values()):
        raise FormatError(f"{where}: deviation {dev!r} is not an object of numbers")
    return rec


def received_record(files: Dict[str, bytes], step: int, rank: int, where: str) -> dict:
    """The record of rank ``rank``'s step ``step`` that another node sent (``files``: name ->
    bytes), once the files are what a reader relies on: the names this rank's step has (nothing
    else, nowhere else), a valid record of that step and rank, and the gradients file it names
    (whose header :func:`file_check` checks as it is kept: ``tiers.receive_step``)."""
    json_name, file_name = f"rank{rank}.json", f"rank{rank}.safetensors"
    if not isinstance(files, dict) or set(files) - {json_name, file_name} or json_name not in files:
        raise FormatError(f"{where}: step {step} of rank {rank} came as {sorted(files)!r}, not {json_name} "
                          f"(and {file_name}): refused")
    try:
        rec = json.loads(bytes(files[json_name]).decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{where}: the record of step {step}, rank {rank} is not JSON: {e}") from None
    check_record(rec, step, rank, f"{where}: step {step}, rank {rank}")
    if (rec["file"] is None) != (file_name not in files):
        raise FormatError(f"{where}: step {step} of rank {rank} came {'with' if file_name in files else 'without'} "
                          f"{file_name}, its record says {rec['file']!r}: refused")
    return rec


def file_check(rec: dict, step: int, where: str) -> Callable[[str], None]:
    """A check of a received gradients file (``tiers.receive_file``): its header holds every
    tensor of the record ``rec`` with the record's stored dtype and shape (the hashes are checked
    when they are replayed)."""
    want = {GRAD + k: (m["stored"], m["shape"]) for k, m in rec["tensors"].items()}
    want.update({k: (m["dtype"], m["shape"]) for k, m in rec["extra"].items()})

    def check(path: str) -> None:
        held = SafetensorsFile(path, LOCAL).entries
        for name, (dname, shape) in want.items():
            if name not in held or held[name][0] != dname or list(held[name][1]) != list(shape):
                got = f"{held[name][0]}{list(held[name][1])}" if name in held else "nothing"
                raise FormatError(f"{where}: {rec['file']} of step {step} holds {got} as {name!r}, its record "
                                  f"says {dname}{list(shape)}: refused")
    return check


def _read_record(path: str, step: int, rank: int, store: Storage = LOCAL) -> Optional[dict]:
    """The valid record at ``path``; None when there is none (the step is not committed there);
    a FormatError when a file is there but is not a valid record of that step and rank."""
    try:
        text = store.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: cannot read the delta record: {e}") from e
    try:
        rec = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from e
    return check_record(rec, step, rank, path)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def step_dirs(ckpt_dir: str, store: Storage = LOCAL) -> List[int]:
    return sorted(int(n) for n in store.list(deltas_dir(ckpt_dir, store)) if _STEP_DIR.match(n))


def committed_steps(ckpt_dir: str, base_step: int, world: int, strict: bool = True,
                    store: Storage = LOCAL, ranks: Optional[Sequence[int]] = None,
                    generation: Optional[int] = None) -> Tuple[List[Step], str]:
    """The committed steps directly after ``base_step`` (in order, up to the first gap) and a
    one-line reason why the chain stops where it does.  A step is committed when the records of
    ``ranks`` (default: all ``world``) are there.  A record that is there but invalid is
    damage, not a gap: a FormatError naming it (``strict``), or where the chain stops, saying so.
    ``generation``: the base's (its manifest's); a chain file or a record of another generation
    belongs to an earlier save of the tag, and is not committed (those of versions that did not
    record the generation are not compared)."""
    out: List[Step] = []
    info = read_chain(ckpt_dir, store) if generation is not None else None
    recorded = info.get("base_generation") if isinstance(info, dict) else None
    if recorded is not None and recorded != generation:
        return out, (f"the delta log belongs to an earlier save of this tag (generation {recorded}; the base is "
                     f"generation {generation})")
    want = base_step + 1
    for s in step_dirs(ckpt_dir, store):
        if s < want:
            continue
        if s != want:
            return out, f"step {want} was never written"
        recs = {}
        for r in (range(world) if ranks is None else ranks):
            try:
                rec = _read_record(store.join(step_dir(ckpt_dir, s, store), f"rank{r}.json"), s, r, store)
            except FormatError as e:
                if strict:
                    raise FormatError(f"{e}. The delta log of {ckpt_dir} is damaged at step {s}: to recover "
                                      f"step {s - 1}, remove {step_dir(ckpt_dir, s, store)} and the step directories "
                                      "after it (or load with on_corrupt \"fallback\")") from None
                return out, f"step {s} is damaged: {e}"
            if rec is None:
                return out, f"step {s} is incomplete (rank {r} has no record)"
            if generation is not None and rec.get("base_generation", generation) != generation:
                return out, (f"step {s} was recorded on an earlier save of this tag (generation "
                             f"{rec['base_generation']}; the base is generation {generation})")
            recs[r] = rec
        if len({rec["nonce"] for rec in recs.values()}) != 1:
            return out, f"step {s} mixes records of different runs"
        out.append(Step(s, recs, store))
        want = s + 1
    return out, "end of the log"


def read_grad(ckpt_dir: str, step: Step, key: str, prefer_rank: int, verify: bool = True,
              files: Optional[dict] = None) -> torch.Tensor:
    """The gradient ``key`` of ``step`` in the dtype it was recorded in (hash-checked)."""
    meta, path = grad_meta(ckpt_dir, step, key, prefer_rank)
    rec = step.records[step.holder_of(key, prefer_rank)]
    t = _verified(ckpt_dir, step, rec, path, open_file(path, files, step.store), GRAD + key, meta["stored"], meta,
                  verify)
    return t.to(torch_dtype(meta["dtype"]))


def grad_meta(ckpt_dir: str, step: Step, key: str, prefer_rank: int) -> Tuple[dict, str]:
    """The record entry of gradient ``key`` of ``step`` (from ``prefer_rank``'s record if it stored
    it, else another rank's) and the file that holds it."""
    rec = step.records[step.holder_of(key, prefer_rank)]
    return rec["tensors"][key], step.store.join(step_dir(ckpt_dir, step.step, step.store), str(rec["file"]))


def _verified(ckpt_dir: str, step: Step, rec: dict, path: str, f: SafetensorsFile, name: str, kept: str,
              meta: dict, verify: bool) -> torch.Tensor:
    """Tensor ``name`` of a delta file, checked against its record: stored dtype and shape (always),
    hash (``verify``; format 2: bound to the step, name, dtype and shape)."""
    if name not in f.entries:
        raise FormatError(f"{path}: lacks {name!r}, which its record lists")
    dname, shape, _, _ = f.entries[name]
    if list(shape) != list(meta["shape"]) or dname != kept:
        raise FormatError(f"{path}: {name} is {dname}{list(shape)}, its record says {kept}{meta['shape']}")
    t = f.read(name)
    if verify:
        got = (bound_digest(tensor_identity(step.step, name, kept, shape), t) if rec["version"] >= 2
               else hash_tensor(t))
        if got != meta["hash"]:
            raise _damaged(ckpt_dir, step, path, name)
    return t


def _damaged(ckpt_dir: str, step: Step, path: str, what: str) -> IntegrityError:
    return IntegrityError(f"{path}: {what} of delta step {step.step} does not match its recorded hash "
                          f"(corrupted, or not what the record says it is); to recover step {step.step - 1} instead, remove "
                          f"{step_dir(ckpt_dir, step.step, step.store)} and the step directories after it")


def open_file(path: str, files: Optional[dict], store: Storage = LOCAL) -> SafetensorsFile:
    """The delta file at ``path``, its header validated (kept in ``files`` for the next use)."""
    f = files.get(path) if files is not None else None
    if f is None:
        f = SafetensorsFile(path, store)
        if files is not None:
            files[path] = f
    return f


def read_extra(ckpt_dir: str, step: Step, rank: int, verify: bool = True, files: Optional[dict] = None) -> dict:
    """This rank's record tree with its tensors (e.g. the RNG state) filled in."""
    rec = step.records[rank]
    tensors = {}
    if rec["extra"]:
        path = step.store.join(step_dir(ckpt_dir, step.step, step.store), str(rec["file"]))
        f = open_file(path, files, step.store)
        for name, meta in rec["extra"].items():
            tensors[name] = _verified(ckpt_dir, step, rec, path, f, name, meta["dtype"], meta, verify)
    return jsontree.decode(rec["record"], tensors.__getitem__)


def remove_steps_after(ckpt_dir: str, step: int, store: Storage = LOCAL) -> List[int]:
    """Delete the (uncommitted) step directories after ``step``; returns their steps."""
    gone = []
    for s in step_dirs(ckpt_dir, store):
        if s > step:
            store.remove_tree(step_dir(ckpt_dir, s, store))
            gone.append(s)
    if gone:
        store.sync_dir(deltas_dir(ckpt_dir, store))
    return gone


def summary(ckpt_dir: str, base_step: int, world: int, store: Storage = LOCAL,
            generation: Optional[int] = None) -> dict:
    """What ``adacheck inspect`` shows about a base's delta log (damage is where it stops);
    ``generation``: the base's (:func:`committed_steps`)."""
    steps, why = committed_steps(ckpt_dir, base_step, world, strict=False, store=store, generation=generation)
    devs = {s.step: d for s, d in ((s, s.deviation()) for s in steps) if d is not None}
    elems = stored_elements(steps)
    total = sum(elems.values())
    return {"committed": len(steps), "first": steps[0].step if steps else None,
            "last": steps[-1].step if steps else None, "bytes": sum(s.bytes for s in steps),
            "stops": why, "lossy": any(s.lossy for s in steps),
            "max_abs_error": max([s.max_abs_error() for s in steps] or [0.0]),
            # per committed step, compact only: a recovery to it deviates by this much
            "deviation": devs,
            "max_deviation": {k: max(d[k] for d in devs.values()) for k in ("weights", "state")} if devs else None,
            "on_disk": len(step_dirs(ckpt_dir, store)),
            # gradient elements per stored dtype, and the share stored in bf16 (2 bytes each)
            "stored_elements": elems,
            "bf16_share": elems.get("bfloat16", 0) / total if total else None}


def stored_elements(steps: List[Step]) -> Dict[str, int]:
    """Gradient elements of ``steps`` (every rank's records) per dtype they are stored in."""
    out: Dict[str, int] = {}
    for st in steps:
        for r in st.records.values():
            for m in r["tensors"].values():
                out[m["stored"]] = out.get(m["stored"], 0) + math.prod(m["shape"])
    return out


def reach(ckpt_dir: str, base_step: int, world: int, step: Optional[int] = None,
          store: Storage = LOCAL, generation: Optional[int] = None) -> Tuple[int, int]:
    """(committed online steps to replay, the step a load ends at) for the base checkpoint
    ``ckpt_dir`` at ``base_step`` (of ``generation``) saved by ``world`` ranks: all its committed
    deltas, or those up to ``step`` (which must be the base's step or one of them)."""
    dl = summary(ckpt_dir, base_step, world, store, generation) if step_dirs(ckpt_dir, store) else {"committed": 0}
    pending, last = dl["committed"], (dl["last"] if dl["committed"] else base_step)
    if step is not None and step != last:
        if step == base_step:
            pending, last = 0, base_step
        elif pending and base_step < step < last:
            pending, last = step - base_step, step
        else:
            raise ConfigError(f"{ckpt_dir} holds step {base_step} and committed online steps {dl['first']}..{last}: "
                              f"step {step} is not among them" if pending else
                              f"{ckpt_dir} holds only step {base_step}, not {step}")
    return pending, last


def base_for_step(save_dir: str, step: int, store: Storage = LOCAL) -> str:
    """The tag of the newest complete checkpoint in ``save_dir`` from which ``step`` is reachable
    (it is that step, or its committed online deltas reach it)."""
    found = []
    for t, m, _ in commit.list_checkpoints(save_dir, store):
        if m is None or m.step is None or m.step > step:
            continue
        _, last = reach(store.join(save_dir, t), m.step, int(m.topology.get("world_size", 1)), store=store,
                        generation=m.framework.get("generation"))
        if last >= step:
            found.append((m.step, t))
    if not found:
        raise ConfigError(f"no checkpoint in {save_dir} holds step {step} or reaches it with committed online "
                          "deltas (adacheck inspect shows each base's steps)")
    return max(found)[1]
