"""Where checkpoint bytes live: the one interface between AdaCheck and files or objects.

Everything AdaCheck writes, reads, lists, renames, deletes or fsyncs goes through a
:class:`Storage`: shard files, manifests, ``latest``, delta files and records, retention and
garbage collection.  Paths are full path strings of the storage (``/``-separated), as the user
gave them: a local directory, or for fsspec a path of that filesystem (``bucket/prefix/...``).

Commit semantics, the part that differs between backends:

- a large file is written through :meth:`Storage.open_writer`; nothing is visible under its
  final name as a *complete* file until :meth:`FileWriter.commit`, and :meth:`FileWriter.abort`
  leaves nothing behind.  POSIX writes ``<name>.tmp``, fsyncs and renames; an object store
  uploads the object and it exists once the upload completes (there is no rename);
- a small metadata file (a manifest, ``latest``, a delta record) is written whole with
  :meth:`Storage.write_atomic`: a reader sees the old content or the new, never a torn one;
- publishing is ordering: data first, then the manifest once every rank's data is confirmed,
  then ``latest``.  Loaders open a checkpoint only through its manifest, so on every backend an
  interrupted save is invisible.

Backends: :class:`PosixStorage` (local and shared POSIX filesystems: fsync, atomic rename,
``O_DIRECT`` for delta files) and :class:`FsspecStorage` (any fsspec filesystem; the tests use
fsspec's in-memory one).  :func:`open_storage` picks one for a path.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
import datetime
import errno
import functools
import mmap
import os
import shutil
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Pattern, Tuple

from ..errors import AdaCheckError, ConfigError, StorageError


class FileWriter(ABC):
    """A file being written: ``write`` its bytes in order, then ``commit`` (durable and visible
    under its final name) or ``abort`` (nothing of it left behind; after a successful commit,
    abort does nothing)."""

    @abstractmethod
    def write(self, data) -> None:
        raise NotImplementedError

    @abstractmethod
    def commit(self) -> int:
        """Make the file durable under its final name; returns its size in bytes."""
        raise NotImplementedError

    @abstractmethod
    def abort(self) -> None:
        raise NotImplementedError


class Storage(ABC):
    """The operations AdaCheck needs of a place to keep checkpoints (see the module docstring).

    A backend implements the abstract methods: reading ``exists``, ``is_dir``, ``list``, ``size``,
    ``mtime``, ``read_into``, ``read_bytes``; writing ``make_dirs``, ``open_writer`` (a
    :class:`FileWriter`), ``remove``, ``remove_tree``, ``remove_dir``, ``sync_dir``.  The rest
    (``write_atomic``, ``file_state``, ``read_range``, ...) is built on them,
    and a backend may do better.  ``renames``: whether files are written under a
    temporary name first (POSIX) or appear whole when their upload completes (object stores).
    ``maps``: whether a load maps the files (:meth:`map`: a read of bytes another rank of the
    node read too comes from the page cache), or downloads every byte it reads.
    """

    renames = True
    maps = False
    TMP_SUFFIX = ".tmp"

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def parent(self, path: str) -> str:
        return os.path.dirname(os.path.normpath(path))

    def basename(self, path: str) -> str:
        return os.path.basename(os.path.normpath(path))

    def canonical(self, path: str) -> str:
        """One spelling per place (to compare and remember directories)."""
        return os.path.abspath(path)

    @abstractmethod
    def exists(self, path: str) -> bool:
        raise NotImplementedError

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        raise NotImplementedError

    def is_file(self, path: str) -> bool:
        return self.exists(path) and not self.is_dir(path)

    @abstractmethod
    def list(self, path: str) -> List[str]:
        """Names directly under ``path`` (sorted); [] when there is nothing there."""
        raise NotImplementedError

    @abstractmethod
    def size(self, path: str) -> int:
        raise NotImplementedError

    def size_if_file(self, path: str) -> Optional[int]:
        """The size of the file at ``path``, or None when there is none (one query, where
        ``is_file`` then ``size`` would cost two: a round trip each on an object store)."""
        try:
            return self.size(path)
        except FileNotFoundError:
            return None

    def file_state(self, path: str) -> Optional[Tuple[int, Optional[str]]]:
        """The size of the file at ``path`` and the storage's tag of its content, or None when there
        is no file (one query).  The tag is what the storage itself says of the bytes it holds, and
        it changes whenever the object is written again: an object store's ETag (S3: a hash of the
        bytes).  None where the storage keeps no such tag (POSIX: a file is published by a rename
        of its writer's own temporary)."""
        size = self.size_if_file(path)
        return None if size is None else (size, None)

    @abstractmethod
    def mtime(self, path: str) -> float:
        raise NotImplementedError

    def files_under(self, path: str) -> Optional[Dict[str, Tuple[int, Optional[float], Optional[str]]]]:
        """Every file under ``path``, at any depth, by its path relative to ``path`` ("/"-separated):
        (size, modification time or None, content tag as :meth:`file_state` gives it), from one
        listing; None where that is no cheaper than asking file by file (POSIX)."""
        return None

    @abstractmethod
    def read_into(self, path: str, offset: int, buffer) -> int:
        """Read up to ``len(buffer)`` bytes at ``offset`` into ``buffer``; returns how many."""
        raise NotImplementedError

    @abstractmethod
    def read_bytes(self, path: str, limit: Optional[int] = None) -> bytes:
        """The file's bytes (the first ``limit`` of them if given); FileNotFoundError if none."""
        raise NotImplementedError

    def read_range(self, path: str, start: int, size: int) -> bytes:
        """Bytes ``[start, start + size)`` of the file (fewer at its end), in one request."""
        buffer = bytearray(size)
        return bytes(buffer[:self.read_into(path, start, memoryview(buffer))])

    @abstractmethod
    def make_dirs(self, path: str) -> None:
        raise NotImplementedError

    @abstractmethod
    def open_writer(self, path: str, fsync: bool = True) -> FileWriter:
        raise NotImplementedError

    def write_atomic(self, path: str, data: bytes, fsync: bool = True) -> None:
        """Small metadata, whole: through :meth:`open_writer` (its commit is the atomic step)."""
        fw = self.open_writer(path, fsync=fsync)
        try:
            fw.write(data)
            fw.commit()
        except BaseException:
            fw.abort()
            raise

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete a file; nothing happens if it is not there."""
        raise NotImplementedError

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        raise NotImplementedError

    @abstractmethod
    def remove_dir(self, path: str) -> bool:
        """Remove ``path`` if it is an empty directory (object stores have none); returns whether
        nothing is left there."""
        raise NotImplementedError

    @abstractmethod
    def sync_dir(self, path: str) -> None:
        """Make the directory's entries (creations, renames, deletions) durable."""
        raise NotImplementedError

    def abort_uploads(self, path: str, names: Pattern[str]) -> int:
        """Abort the unfinished uploads under ``path`` whose names relative to it match ``names``,
        which a killed writer left (S3 multipart uploads: invisible, but stored and billed until
        aborted); returns how many.  Others' uploads there (another job's, at the bucket's root
        too) are not touched."""
        return 0

    def map(self, path: str):
        """The file at ``path`` mapped into memory, private and copy-on-write (an ``mmap``: its
        bytes come in as they are touched, nothing is copied first), or None where this storage
        has no local file to map (a load then reads it).  Map only files no one writes again:
        a committed shard file."""
        return None

    def forget(self, path: str) -> None:
        """Drop what this storage keeps of the file ``path`` (or of the files under it): a reader
        that opens it reads what is stored now (another process may have written it again)."""

    def describe(self) -> str:
        return type(self).__name__


def _timestamp(value) -> Optional[float]:
    """A listing's modification time as seconds since the epoch (None: not one it can read)."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


WRITE_BEHIND = 8 << 20      # with fsync, writeback of a file is started after each this many bytes


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    """Linux's sync_file_range (None where there is none): starts the writeback of a file's range
    without waiting for it, so that the fsync at the end of a large file waits for less."""
    try:
        import ctypes
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


class _PosixWriter(FileWriter):
    def __init__(self, path: str, fsync: bool):
        self.final, self.tmp, self.fsync = path, path + Storage.TMP_SUFFIX, fsync
        self.f = open(self.tmp, "wb")
        self.size = self.started = 0     # bytes written; bytes whose writeback was started
        self.behind = fsync and _sync_file_range() is not None
        self.renamed = self.committed = False

    def write(self, data) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            raise _named(e, self.tmp) from e
        self.size += memoryview(data).nbytes
        if self.behind and self.size - self.started >= WRITE_BEHIND:
            self._write_behind()

    def _write_behind(self) -> None:
        """Start the writeback of what was written since the last call (SYNC_FILE_RANGE_WRITE: no
        waiting); the fsync at the commit is what makes the file durable, with or without this."""
        self.f.flush()
        if _sync_file_range()(self.f.fileno(), self.started, self.size - self.started, 2) != 0:
            self.behind = False       # the filesystem does not take it: the fsync alone, as before
        self.started = self.size

    def commit(self) -> int:
        try:
            self.f.flush()
            if self.fsync:
                os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.final)
            self.renamed = True
            if self.fsync:
                _fsync_dir(os.path.dirname(os.path.abspath(self.final)))
        except OSError as e:
            raise _named(e, self.tmp) from e
        self.committed = True
        return self.size

    def abort(self) -> None:
        if self.committed:
            return
        try:
            self.f.close()
        except OSError:
            pass
        for p in (self.tmp,) + ((self.final,) if self.renamed else ()):   # only what this writer made
            try:
                os.remove(p)
            except FileNotFoundError:
                pass


def _named(e: OSError, path: str) -> OSError:
    """write()/fsync() errors carry no path: name the file."""
    return e if e.filename is not None else OSError(e.errno, e.strerror, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PosixStorage(Storage):
    """A local or shared POSIX filesystem: files are written under ``<name>.tmp``, fsynced and
    renamed (``fsync`` off: renamed without fsync); the directory is fsynced after a rename.
    Delta files go through :class:`~adacheck.storage.direct.DirectFileWriter` (``O_DIRECT``)."""

    renames = True
    maps = True

    def exists(self, path):
        return os.path.exists(path)

    def is_dir(self, path):
        return os.path.isdir(path)

    def is_file(self, path):
        return os.path.isfile(path)

    def list(self, path):
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, path):
        return os.path.getsize(path)

    def mtime(self, path):
        return os.path.getmtime(path)

    def read_into(self, path, offset, buffer):
        with open(path, "rb") as f:
            f.seek(offset)
            return f.readinto(buffer)

    def read_bytes(self, path, limit=None):
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    def map(self, path):
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        except (OSError, ValueError):       # a filesystem that cannot map: read instead
            return None

    def make_dirs(self, path):
        os.makedirs(path, exist_ok=True)

    def open_writer(self, path, fsync=True):
        return _PosixWriter(path, fsync)

    def remove(self, path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path):
        shutil.rmtree(path, ignore_errors=True)

    def remove_dir(self, path):
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise

    def sync_dir(self, path):
        _fsync_dir(path)

    def describe(self):
        return "local filesystem"


class _FsspecWriter(FileWriter):
    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self.f = fs.open(path, "wb")
        self.size = 0
        self.committed = False

    def write(self, data) -> None:
        self.f.write(memoryview(data).cast("B"))
        self.size += memoryview(data).nbytes

    def commit(self) -> int:
        self.f.close()          # an object store completes the upload: the object appears whole
        self.committed = True
        return self.size

    def abort(self) -> None:
        if self.committed:
            return
        discard = getattr(self.f, "discard", None)
        try:
            if discard is not None:
                discard()       # an upload in flight is dropped
            else:
                self.f.close()
        finally:
            try:
                self.fs.rm(self.path)
            except FileNotFoundError:
                pass


class FsspecStorage(Storage):
    """Any fsspec filesystem (``fsspec.filesystem(protocol, **storage_options)``).  Objects
    appear whole when written (``renames`` is False): shard objects are written under their
    final names, then the manifest, then ``latest``; nothing needs an fsync or a directory.

    Other ranks write into the same prefix, so no answer comes from fsspec's listings cache:
    every query drops what the filesystem remembers of that path first.

    Reads of less than ``BLOCK`` bytes are served from whole blocks fetched once (the last
    ``BLOCKS_KEPT`` of them): a checkpoint's boxes are read in file order, and a request per box
    costs a round trip each (on a local S3 server, 68 ranged reads of a 128 MB file took 7.7 s,
    the whole file 0.7 s).  Blocks serve one reader of a file: opening a file for reading
    (``forget``), or writing or removing it through this storage, drops its blocks, so a file
    another process deleted and wrote again is read anew."""

    renames = False
    BLOCK = 64 << 20
    BLOCKS_KEPT = 2

    def __init__(self, fs, protocol: str = ""):
        self.fs, self.protocol = fs, protocol
        self._blocks: "OrderedDict[Tuple[str, int], bytes]" = OrderedDict()
        self._lock = threading.Lock()      # a background writer and a reader may share this storage

    def __getstate__(self):
        """Picklable without its lock and read blocks (a manifest in parts that a writer process
        sends to its rank reads its parts through it)."""
        return {"fs": self.fs, "protocol": self.protocol}

    def __setstate__(self, state):
        self.__init__(state["fs"], state["protocol"])

    def forget(self, path):
        with self._lock:
            for key in [k for k in self._blocks if k[0] == path or k[0].startswith(path.rstrip("/") + "/")]:
                del self._blocks[key]

    def _block(self, path: str, index: int) -> bytes:
        key = (path, index)
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
                return data
        data = self.fs.cat_file(path, start=index * self.BLOCK, end=(index + 1) * self.BLOCK)
        with self._lock:
            self._blocks[key] = data
            while len(self._blocks) > self.BLOCKS_KEPT:
                self._blocks.popitem(last=False)
        return data

    def _fresh(self, path: str) -> str:
        self.fs.invalidate_cache(path)
        return path

    def join(self, *parts):
        return "/".join([parts[0].rstrip("/")] + [p.strip("/") for p in parts[1:]])

    def parent(self, path):
        return path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else ""

    def basename(self, path):
        return path.rstrip("/").rsplit("/", 1)[-1]

    def canonical(self, path):
        return f"{self.protocol}://" + self.fs._strip_protocol(path).rstrip("/")

    def exists(self, path):
        return self.fs.exists(self._fresh(path))

    def is_dir(self, path):
        return self.fs.isdir(self._fresh(path))

    def is_file(self, path):
        return self.fs.isfile(self._fresh(path))

    def list(self, path):
        try:
            return sorted({self.basename(p) for p in self.fs.ls(self._fresh(path), detail=False)} - {""})
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, path):
        return self.fs.size(self._fresh(path))

    CONTENT_TAGS = ("ETag", "etag", "md5Hash")     # S3; Azure and GCS; GCS

    def file_state(self, path):
        try:
            info = self.fs.info(self._fresh(path))
        except FileNotFoundError:
            return None
        if info.get("type") != "file":
            return None
        tag = next((str(info[k]) for k in self.CONTENT_TAGS if info.get(k)), None)
        return int(info["size"]), tag

    def mtime(self, path):
        return self.fs.modified(self._fresh(path)).timestamp()

    MTIMES = ("LastModified", "mtime", "updated", "last_modified", "created")     # S3; local; GCS; Azure; memory

    def files_under(self, path):
        """One listing of the whole tree (an object store: a request per 1,000 objects)."""
        root = self.fs._strip_protocol(path).rstrip("/")
        try:
            found = self.fs.find(self._fresh(path), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for p, info in found.items():
            if info.get("type", "file") != "file" or not p.startswith(root + "/"):
                continue
            tag = next((str(info[k]) for k in self.CONTENT_TAGS if info.get(k)), None)
            out[p[len(root) + 1:]] = (int(info["size"]), _timestamp(next((info[k] for k in self.MTIMES
                                                                          if info.get(k) is not None), None)), tag)
        return out

    def read_into(self, path, offset, buffer):
        view = memoryview(buffer).cast("B")
        if len(view) >= self.BLOCK:
            data = self.fs.cat_file(path, start=offset, end=offset + len(view))
            view[:len(data)] = data
            return len(data)
        done = 0
        while done < len(view):
            index, at = divmod(offset + done, self.BLOCK)
            block = self._block(path, index)
            piece = block[at:at + len(view) - done]
            if not piece:
                break         # end of the file
            view[done:done + len(piece)] = piece
            done += len(piece)
        return done

    def read_bytes(self, path, limit=None):
        return self.fs.cat_file(path) if limit is None else self.fs.cat_file(path, start=0, end=limit)

    def read_range(self, path, start, size):
        return self.fs.cat_file(path, start=start, end=start + size)    # not a whole block

    def make_dirs(self, path):
        self.fs.makedirs(path, exist_ok=True)

    def open_writer(self, path, fsync=True):
        self.forget(path)
        return _FsspecWriter(self.fs, path)

    def write_atomic(self, path, data, fsync=True):
        self.forget(path)
        self.fs.pipe_file(path, bytes(data))

    def remove(self, path):
        self.forget(path)
        try:
            self.fs.rm(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path):
        self.forget(path)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def remove_dir(self, path):
        if self.list(path):
            return False
        try:
            self.fs.rmdir(path)
        except (FileNotFoundError, OSError, NotImplementedError):
            pass
        return True

    def sync_dir(self, path):
        pass

    def abort_uploads(self, path, names):
        lister, abort = getattr(self.fs, "list_multipart_uploads", None), getattr(self.fs, "abort_mpu", None)
        if lister is None or abort is None:
            return 0     # a filesystem without multipart uploads
        bucket, _, prefix = self.fs._strip_protocol(path).partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        stale = [u for u in lister(bucket) if u["Key"].startswith(prefix) and names.match(u["Key"][len(prefix):])]
        for u in stale:
            abort(bucket, u["Key"], u["UploadId"])
        return len(stale)

    def describe(self):
        return f"fsspec {self.protocol or type(self.fs).__name__}"


def _named_errors(cls, methods):
    """Errors of the backend (an unreachable server, a refused request) become StorageError naming
    the operation and the path; FileNotFoundError stays what it is (the callers ask for it)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except (FileNotFoundError, AdaCheckError):
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with what was being done
                path = args[0] if args and isinstance(args[0], str) else getattr(self, "path", "")
                where = self.describe() if isinstance(self, Storage) else "fsspec"
                raise StorageError(f"{where}: {fn.__name__} {path} failed: {type(e).__name__}: {e}") from e
        return call
    for name in methods:
        setattr(cls, name, wrap(getattr(cls, name)))


_named_errors(FsspecStorage, ("exists", "is_dir", "is_file", "list", "size", "mtime", "read_into", "read_bytes",
                              "make_dirs", "open_writer", "write_atomic", "remove", "remove_tree", "remove_dir",
                              "abort_uploads"))
_named_errors(_FsspecWriter, ("write", "commit", "abort"))

LOCAL = PosixStorage()


def is_url(path) -> bool:
    """Whether a checkpoint path names an fsspec filesystem (``protocol://...``)."""
    return "://" in str(path)


def url_protocol(path: str) -> str:
    return path.split("://", 1)[0]


def storage_path(path: str) -> str:
    """A URL as its storage names it: ``file://`` URLs are local paths, others stay whole."""
    protocol, rest = path.split("://", 1)
    return rest if protocol == "file" else path


def open_storage(path: str, options: Optional[dict] = None) -> Tuple[Storage, str]:
    """The storage a checkpoint path lives on, and the path as that storage names it: a URL
    ``protocol://...`` goes to fsspec with ``options`` (its storage_options), ``file://...`` and
    anything without a protocol is a local POSIX path."""
    if not is_url(path):
        if options:
            raise ConfigError(f"storage_options were given for the local path {path!r}; they apply to "
                              "fsspec URLs (s3://bucket/prefix, ...) only")
        return LOCAL, path
    protocol = url_protocol(path)
    if protocol == "file":
        return LOCAL, storage_path(path)
    try:
        import fsspec
        fs = fsspec.filesystem(protocol, **(options or {}))
    except (ImportError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot open storage for {path!r}: {e}") from e
    return FsspecStorage(fs, protocol), path


def copy_file(src_store: Storage, src: str, dst_store: Storage, dst: str, fsync: bool = True,
              block: int = 64 << 20) -> int:
    """Copy one file between storages (e.g. the memory tier to the checkpoint directory) with the
    destination's commit protocol: nothing is visible under ``dst`` before the whole file is;
    returns its size."""
    size = src_store.size(src)
    buf = bytearray(min(block, max(size, 1)))
    writer = dst_store.open_writer(dst, fsync=fsync)
    try:
        offset = 0
        while offset < size:
            n = src_store.read_into(src, offset, memoryview(buf)[:min(len(buf), size - offset)])
            if n <= 0:
                raise OSError(f"{src}: ended at byte {offset} of {size} while it was copied to {dst}")
            writer.write(memoryview(buf)[:n])
            offset += n
        return writer.commit()
    except BaseException:
        writer.abort()
        raise
