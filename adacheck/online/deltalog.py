"""The writing side of online deltas: :class:`DeltaLog` stores, per optimizer step, what the
optimizer consumed (gradients, in the compact form where it is exact) into the step's delta file,
staged off the training thread, and its record last; the file layout and the reading side are
in :mod:`.deltas`."""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..storage import commit
from ..checkpoint import lifecycle
from ..format.hashing import bound_digest
from ..storage.backends import LOCAL, Storage
from ..types import dtype_name
from ..format.writer import BLOCK
from ..storage.direct import SpareFiles, tensor_writer, write_tensors
from .deltas import GRAD, RECORD_VERSION, deltas_dir, step_dir, tensor_identity

log = logging.getLogger("adacheck")


def bf16_exact(t: torch.Tensor, out: Optional[torch.Tensor] = None) -> Tuple[bool, Optional[torch.Tensor]]:
    """(t holds only exact bf16 values, t as bf16 or None): the bf16 copy reproduces t bit
    for bit.  A strided sample is checked first, so an inexact tensor (the common fp32 case)
    costs a few thousand elements instead of a full pass; True is always proved in full.

    An fp32 value is a bf16 value exactly when its low 16 bits are zero, and the bf16 value is
    then its high 16 bits (widening them back gives every bit again, NaN payloads included).
    On little-endian machines that is read straight from the bytes: one pass over the low
    halves and one copy of the high halves, no full-size temporaries (faster than casting to
    bf16 and back).  ``out``: a bf16 CPU tensor of t's size that receives the copy (the writer
    reuses one per gradient: the first touch of a new tensor's pages costs more than the copy)."""
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


# ----------------------------------------------------------------------------- writing


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
    ev = torch.cuda.Event(blocking=True)     # the writer sleeps while it waits, it does not spin on a core
    ev.record(stream)
    events[stream] = ev


def _arrange(slot: _Slot) -> None:
    """Lay the slot's staging buffers of the step just written out back to back, in file order
    (sorted keys), in one block-aligned allocation: the next step staged into them goes to the
    device without another copy (:class:`~adacheck.storage.direct.DirectFileWriter` writes the run
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
    slot.buffers = {}                     # written: free them before the new block
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
    exit_order = 0      # closed at exit before a memory tier copies the chain: lifecycle

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
        # called with (ckpt_dir, step, written?) for every step submitted, in order, written or not
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
        self._file_writer = tensor_writer(store)     # the background thread's: O_DIRECT on POSIX
        if spares is not None and self._file_writer is not None:     # files to write over: the memory tier's
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
        own over them (on the host, proving and casting can take the writer longer than the
        training step).  An fp32 gradient that is not bf16 is put together again from
        its halves by the writer, and the next step stages it whole.  In pieces of
        ``_SPLIT_PIECE`` values: the device's temporaries (each half made contiguous before it is
        copied out, the count's) stay under 64 MB, whatever the gradient's size."""
        n = g.numel()
        halves = g.reshape(-1).view(torch.int16).view(n, 2)     # little-endian: [low, high] per value
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
        if self.disabled:       # the writer reports it as not written, after the steps queued before it
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
                    g = None            # proved bf16: the high halves are the gradient
                else:                   # not bf16: the fp32 values again, from their halves
                    g = torch.stack((slot.low[key], stored.reshape(-1).view(torch.int16)), 1) \
                        .view(torch.float32).view(shape)
                    stored = g
            if g is not None and g.dtype == torch.float32:
                exact, b = bf16_exact(g, slot.bf16.get(key))
                if exact:       # kept for this slot's next step: the slot is reused only after this write
                    stored = slot.bf16[key] = b
                else:           # the next step is staged whole: see _splits
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
            if err is not None:      # JSON has no inf: an error that is not finite is "inf"
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
            size = write_tensors(store, store.join(d, fname), tensors, {"format": "adacheck-delta"}, fsync=self.fsync,
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
