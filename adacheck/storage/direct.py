"""Local files written without the page cache (``O_DIRECT``), and spare files written over:
the online deltas' I/O path on POSIX filesystems.

:func:`write_tensors` writes a safetensors file through a storage backend, with a reusable
:class:`DirectFileWriter` where the backend is a local filesystem (:func:`tensor_writer`); both
paths give the same bytes (:func:`~adacheck.format.writer.data_alignment`)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from typing import Dict, List, Optional, Tuple

import torch

from ..format.hashing import tensor_bytes
from ..format.writer import (BLOCK, check_cpu, data_alignment, header_bytes, write_safetensors,
                             write_safetensors_to)
from .backends import PosixStorage, Storage

_DIRECT_CHUNK = 16 << 20


def tensor_writer(store: Storage) -> "Optional[DirectFileWriter]":
    """A writer for repeated :func:`write_tensors` calls from one thread on ``store``: a
    :class:`DirectFileWriter` on a local filesystem, else None."""
    return DirectFileWriter() if isinstance(store, PosixStorage) else None


def write_tensors(store: Storage, path: str, tensors: Dict[str, torch.Tensor], metadata: Optional[dict] = None,
                  fsync: bool = True, writer: "Optional[DirectFileWriter]" = None) -> int:
    """A safetensors file of ``tensors`` (CPU, contiguous) at ``path`` on ``store``, committed
    (a reader sees the whole file or none); returns its size.  ``writer``: from :func:`tensor_writer`."""
    if writer is not None and isinstance(store, PosixStorage):
        tmp = path + store.TMP_SUFFIX
        size = writer.write(tmp, tensors, metadata, fsync=fsync)
        os.replace(tmp, path)
        return size
    fw = store.open_writer(path, fsync=fsync)
    try:
        write_safetensors_to(fw, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], tensors.__getitem__,
                             metadata, data_alignment(tensors))
        return fw.commit()
    except BaseException:
        fw.abort()
        raise


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
        check_cpu(tensors)
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
        header = header_bytes(items, metadata, align)
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
            os.ftruncate(fd, size)      # the padding of the last block; a longer spare's rest
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
            except FileNotFoundError:      # another writer took it first
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:        # a reader still holds it: a new file instead
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
