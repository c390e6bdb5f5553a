"""Streaming safetensors writer.

Writes the standard safetensors layout (u64 little-endian header length, JSON header
padded with spaces to 8 bytes, then the tensor bytes back to back) without building the
whole file in memory, and fsyncs it.  Output is deterministic: keys sorted, compact JSON.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import struct
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .hashing import tensor_bytes
from ..types import DTYPES, dtype_name


def _header(items: List[Tuple[str, torch.Tensor]], metadata: Dict[str, str], data_align: int = 8) -> bytes:
    """The JSON header, padded with spaces (as the format allows) so that the tensor data
    starts at a multiple of ``data_align`` bytes into the file."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, t in items:
        name = dtype_name(t.dtype)
        nbytes = t.numel() * DTYPES[name][2]
        header[key] = {"dtype": DTYPES[name][1], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % data_align)
    return raw


def write_safetensors_to(out, specs: List[Tuple[str, torch.dtype, tuple]], produce: Callable[[str], torch.Tensor],
                         metadata: Dict[str, str] | None = None, data_align: int = 8) -> int:
    """Write a safetensors file into ``out`` (anything with ``write(bytes)``: a file, a storage's
    FileWriter) with tensors made one at a time: ``specs`` gives each key's dtype and shape (for
    the header), ``produce(key)`` the tensor when its bytes are due.  Peak memory is one tensor.
    Keys are written sorted; returns the number of bytes written."""
    specs = sorted(specs, key=lambda s: s[0])
    header = _header([(k, torch.empty(shape, dtype=dt, device="meta")) for k, dt, shape in specs],
                     metadata or {}, data_align)
    size = 8 + len(header)
    out.write(struct.pack("<Q", len(header)))
    out.write(header)
    for key, dt, shape in specs:
        t = produce(key)
        if t.dtype != dt or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{key}: produced {t.dtype}{list(t.shape)}, header says {dt}{list(shape)}")
        buf = tensor_bytes(t.detach().to("cpu").contiguous())
        out.write(buf)
        size += len(buf)
        del t, buf   # before the next produce(): one tensor at a time
    return size


def write_safetensors_streaming(path: str, specs: List[Tuple[str, torch.dtype, tuple]],
                                produce: Callable[[str], torch.Tensor],
                                metadata: Dict[str, str] | None = None, fsync: bool = True,
                                data_align: int = 8) -> int:
    """:func:`write_safetensors_to` a local file at ``path`` (written in place), fsynced."""
    with open(path, "wb") as f:
        size = write_safetensors_to(f, specs, produce, metadata, data_align)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return size


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor],
                      metadata: Dict[str, str] | None = None, fsync: bool = True, data_align: int = 8) -> int:
    """Write ``tensors`` (CPU, contiguous) to ``path``; return the file size in bytes."""
    _check_cpu(tensors)
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    return write_safetensors_streaming(path, specs, tensors.__getitem__, metadata, fsync, data_align)


def _check_cpu(tensors: Dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{key}: write_safetensors needs contiguous CPU tensors")


BLOCK = 4096           # O_DIRECT: file offsets, lengths and memory addresses in multiples of this
_DIRECT_CHUNK = 16 << 20
_ALIGN_DATA_FROM = 1 << 20   # files with at least this many tensor bytes start their data on a block


def data_alignment(tensors: Dict[str, torch.Tensor]) -> int:
    """Where :class:`DirectFileWriter` starts the tensor data: on a block boundary (the header
    padded with up to 4 KiB of spaces) when the tensors hold at least 1 MiB, so that tensor
    memory can go to the device directly; a multiple of 8 otherwise.  A function of the
    tensors alone, so the same tensors give the same bytes on every filesystem."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    return BLOCK if data >= _ALIGN_DATA_FROM else 8


def _runs(items: List[Tuple[str, torch.Tensor]]) -> List[Tuple[int, memoryview]]:
    """The tensors' bytes in file order as (address, bytes), neighbours that lie back to back
    in one storage (views of one staging block) joined into one run."""
    runs: List[list] = []          # [storage, first byte, end byte, the run's only tensor or None]
    for _, t in items:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        st = t.untyped_storage()
        at = t.data_ptr() - st.data_ptr()
        if runs and runs[-1][0].data_ptr() == st.data_ptr() and runs[-1][2] == at:
            runs[-1][2:] = [at + n, None]
        else:
            runs.append([st, at, at + n, t])
    out = []
    for st, a, b, t in runs:
        if t is None:
            t = torch.empty(0, dtype=torch.uint8).set_(st, a, (b - a,))
        out.append((t.data_ptr(), tensor_bytes(t)))
    return out


class DirectFileWriter:
    """Writes safetensors files (one step's gradient deltas) with ``O_DIRECT``, without the page
    cache.  A buffered write of the same bytes cost the writing thread about 8x more CPU here
    (80 vs 10 ms for 42 MB: the copy into the page cache and its writeback), which a job whose
    training keeps every core busy pays at every step.  Tensor bytes at a block-aligned address
    (a staging block laid out in file order, :func:`data_alignment`) go to the device straight
    from their memory; the rest (the header, unaligned pieces, the tail of each run) is copied
    through a reusable aligned buffer of 16 MiB.  Where the filesystem refuses ``O_DIRECT``
    (some tmpfs and network filesystems) it writes as :func:`write_safetensors` does, from then
    on; both give the same bytes.  One writer per thread."""

    def __init__(self, spares: "SpareFiles | None" = None) -> None:
        self.direct = hasattr(os, "O_DIRECT")
        self._chunk: memoryview | None = None
        self._raw: torch.Tensor | None = None
        self.copied = 0          # bytes that went through the buffer (the rest went straight)
        self.spares = spares     # files to write over instead of new ones (the memory tier's)
        self.reused = 0          # files written over

    def _buffer(self) -> memoryview:
        if self._chunk is None:
            self._raw = torch.empty(_DIRECT_CHUNK + BLOCK, dtype=torch.uint8)
            skip = -self._raw.data_ptr() % BLOCK
            self._chunk = memoryview(self._raw[skip:skip + _DIRECT_CHUNK].numpy())
        return self._chunk

    def write(self, path: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str] | None = None,
              fsync: bool = True) -> int:
        """As :func:`write_safetensors` with ``data_align=data_alignment(tensors)`` (the same
        bytes); returns the file size."""
        _check_cpu(tensors)
        align = data_alignment(tensors)
        if self.direct:
            # a spare file is written over (its pages kept: on tmpfs a new file's cost several times
            # the CPU of the copy itself), then cut to this file's size
            lock = self.spares.take(path) if self.spares is not None else None
            reuse = lock is not None
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | (0 if reuse else os.O_TRUNC), 0o644)
            except OSError as e:
                if lock is not None:
                    os.close(lock)
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
            else:
                try:
                    size = self._write(fd, tensors, metadata or {}, fsync, align, reuse)
                    self.reused += reuse
                    return size
                except _NoDirect:
                    self.direct = False     # took the open, not the direct writes: write it again
                finally:
                    os.close(fd)
                    if lock is not None:
                        os.close(lock)
        return write_safetensors(path, tensors, metadata, fsync, align)

    def _write(self, fd: int, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str], fsync: bool,
               align: int, reuse: bool = False) -> int:
        items = sorted(tensors.items())
        header = _header(items, metadata, align)
        chunk = self._buffer()
        fill = written = 0

        def put(view: memoryview) -> None:
            nonlocal written
            done = 0
            while done < len(view):
                try:
                    done += os.write(fd, view[done:])
                except OSError as e:
                    if e.errno == errno.EINVAL:     # alignment refused (a larger block, say)
                        raise _NoDirect() from e
                    raise
            written += len(view)

        head = struct.pack("<Q", len(header)) + header
        for addr, piece in [(None, memoryview(head))] + _runs(items):
            at = 0
            while at < len(piece):
                straight = (len(piece) - at) // BLOCK * BLOCK
                if straight and not fill % BLOCK and addr is not None and (addr + at) % BLOCK == 0:
                    if fill:
                        put(chunk[:fill])               # whole blocks: the header, say
                        fill = 0
                    put(piece[at:at + straight])        # from the tensor's own memory
                    at += straight
                    continue
                take = min(len(piece) - at, _DIRECT_CHUNK - fill)
                chunk[fill:fill + take] = piece[at:at + take]
                self.copied += take
                fill, at = fill + take, at + take
                if fill == _DIRECT_CHUNK:
                    put(chunk)
                    fill = 0
        size = written + fill
        if fill:
            padded = -(-fill // BLOCK) * BLOCK
            chunk[fill:padded] = bytes(padded - fill)
            put(chunk[:padded])
        if fill or reuse:
            os.ftruncate(fd, size)      # (the padding of the last block; a longer spare's rest)
        if fsync:
            os.fsync(fd)                # the size and the file's metadata
        return size


class _NoDirect(Exception):
    pass


class SpareFiles:
    """A directory of files no checkpoint needs any more, kept to be written over: the memory
    tier's delta files of retired checkpoints (:class:`~adacheck.tiers.MemoryTier`).  Writing over
    a file's pages on tmpfs cost about a quarter of the CPU of writing a new file here (42 MB: 8
    against 30-68 ms), so a chain that takes them costs training far less.  Several writers (the
    ranks of a node) may take from it at once: each take is a rename.  A reader that may still
    read such a file (a copy to durable storage that fell behind) reads it under :func:`held`; a
    file it holds is not written over."""

    def __init__(self, directory: str):
        self.dir = directory

    def take(self, path: str) -> Optional[int]:
        """Move one spare file to ``path``, to be written over: an open descriptor holding it
        exclusively (close it once written), or None when there is none free."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return None
        for name in names:
            try:
                os.replace(os.path.join(self.dir, name), path)
            except FileNotFoundError:      # (another writer took it first)
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:        # (a reader still holds it: a new file instead)
                os.close(fd)
                os.remove(path)
                return None
        return None

    @staticmethod
    @contextlib.contextmanager
    def held(path: str):
        """Read the file at ``path`` with nobody writing over it meanwhile (a FileNotFoundError
        when it was given away as a spare: its content is no longer that file's)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(f"{path} was given away as a spare file while it was read")
            yield
        finally:
            os.close(fd)

    def refill(self, paths: List[str]) -> int:
        """The spares become ``paths`` (moved here); what was left from before is deleted (it was
        not needed for a whole chain).  Returns how many were kept."""
        for name in os.listdir(self.dir) if os.path.isdir(self.dir) else ():
            try:
                os.remove(os.path.join(self.dir, name))
            except FileNotFoundError:
                pass
        if not paths:
            return 0
        os.makedirs(self.dir, exist_ok=True)
        kept = 0
        for i, p in enumerate(paths):
            try:
                os.replace(p, os.path.join(self.dir, f"{os.getpid()}-{i}"))
                kept += 1
            except FileNotFoundError:
                pass
        return kept
