"""The metadata files of one checkpoint, through a storage: its ``manifest.json`` (read, written,
present), and the parts, meta and rank files of a manifest in parts (their bytes are
:mod:`adacheck.format.manifest`'s).  What a save directory holds around them (``latest``, the
generations, retention) is :mod:`adacheck.storage.commit`'s."""
from __future__ import annotations

from typing import Tuple

from ..errors import FormatError, IntegrityError, NotFoundError
from ..format.hashing import hash_buffer
from ..format.manifest import (MANIFEST_NAME, dumps, meta_bytes, meta_name, part_bytes, part_name, rank_file_bytes,
                               rank_file_name, tensor_meta)
from ..format.manifest_read import parse
from ..types import Manifest
from .backends import LOCAL, Storage


def manifest_text(ckpt_dir: str, store: Storage = LOCAL) -> Tuple[str, str]:
    """(path, text) of the checkpoint's ``manifest.json``, not parsed: a NotFoundError where there is
    none, a FormatError where it cannot be read."""
    path = store.join(ckpt_dir, MANIFEST_NAME)
    try:
        return path, store.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        raise NotFoundError(f"{ckpt_dir} has no {MANIFEST_NAME}: it is not a complete AdaCheck "
                            "checkpoint (an interrupted save, or another format)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: cannot read manifest: {e}") from e


def read_manifest(ckpt_dir: str, store: Storage = LOCAL) -> Manifest:
    path, text = manifest_text(ckpt_dir, store)
    return parse(text, where=path, open_part=PartFiles(store, ckpt_dir))


class PartFiles:
    """Reads the parts of a manifest in parts from its checkpoint directory (picklable: a
    manifest goes from an asynchronous save's writer process to the rank)."""

    def __init__(self, store: Storage, ckpt_dir: str):
        self.store, self.ckpt_dir = store, ckpt_dir

    def __call__(self, name: str) -> bytes:
        return self.store.read_bytes(self.store.join(self.ckpt_dir, name))

    def read_range(self, name: str, start: int, size: int) -> bytes:
        """Bytes ``[start, start + size)`` of file ``name`` (fewer at its end): a page of a part."""
        return self.store.read_range(self.store.join(self.ckpt_dir, name), start, size)


def write_part(ckpt_dir: str, generation: int, part: int, tag: str, tensors, fsync: bool = True,
               store: Storage = LOCAL) -> None:
    """Part ``part`` of a manifest in parts (format 6: paged), written whole before the manifest: until
    that is committed, nothing reads it (an interrupted save's parts are garbage, removed like
    its shard files)."""
    store.write_atomic(store.join(ckpt_dir, part_name(generation, part)),
                       part_bytes(tag, part, tensors, generation, paged=True), fsync=fsync)


def write_meta(ckpt_dir: str, generation: int, tag: str, meta: dict, fsync: bool = True,
               store: Storage = LOCAL) -> str:
    """A format 5 manifest's meta file, written before the manifest; returns its hash (for the index)."""
    data = meta_bytes(tag, generation, meta)
    store.write_atomic(store.join(ckpt_dir, meta_name(generation)), data, fsync=fsync)
    return hash_buffer(data)


def write_rank_file(ckpt_dir: str, generation: int, rank: int, tag: str, held: dict, tables: dict,
                    fsync: bool = True, store: Storage = LOCAL) -> None:
    """Rank ``rank``'s file of a manifest in parts (format 5: ``held``, the entries of the boxes it
    held, as JSON; ``tables``, its layout, objects, files and node), written before the manifest
    like a part."""
    store.write_atomic(store.join(ckpt_dir, rank_file_name(generation, rank)),
                       rank_file_bytes(tag, generation, rank, held, tables), fsync=fsync)


def check_rank_files(m: Manifest) -> int:
    """Every rank file of ``m`` says what its tensor table says (each held entry's kind, dtype,
    shape and derivation, and each of its boxes with its file, key and hash, is the table's, and
    the rank among its holders), and so does its index's ``meta``; an IntegrityError names the
    first that does not.  Returns the rank files checked."""
    if m.ranks is None:
        return 0
    if tensor_meta({n: m.tensors[n] for n in m.tensors}) != m.tensors.meta():
        raise IntegrityError(f"{m.ranks.where}: what its index says of the tensors (meta) is not what its tensor "
                             "table says: the manifest was edited. Restore it from a copy, or load an older checkpoint")
    for rank in range(m.ranks.count):
        for name, e in m.ranks.get(rank).tensors.items():
            whole = m.tensors.get(name)
            same = (whole is not None and (e.kind, e.dtype, e.shape) == (whole.kind, whole.dtype, whole.shape)
                    and (e.derived is None) == (whole.derived is None))
            if same and e.derived is not None:
                same = ((e.derived.source, e.derived.op) == (whole.derived.source, whole.derived.op)
                        and set(e.derived.boxes) <= set(whole.derived.boxes))
            elif same:
                table = {(sb.box, sb.file, sb.key, sb.hash): set(sb.holders) for sb in whole.boxes}
                same = all((sb.box, sb.file, sb.key, sb.hash) in table
                           and set(sb.holders) <= table[(sb.box, sb.file, sb.key, sb.hash)] for sb in e.boxes)
            if not same:
                raise IntegrityError(f"{m.ranks.where}: rank {rank}'s file says of {name} what the tensor table "
                                     "does not: the file was edited or damaged. Restore it from a copy, or load an "
                                     "older checkpoint")
    return m.ranks.count


def has_manifest(ckpt_dir: str, store: Storage = LOCAL) -> bool:
    return store.is_file(store.join(ckpt_dir, MANIFEST_NAME))


def write_manifest(ckpt_dir: str, manifest: Manifest, store: Storage = LOCAL) -> None:
    write_manifest_bytes(ckpt_dir, dumps(manifest).encode("utf-8"), store)


def write_manifest_bytes(ckpt_dir: str, raw: bytes, store: Storage = LOCAL) -> None:
    """A manifest already serialized (by rank 0, written by another rank: each node's leader in a
    memory-tier save in parts across nodes; a memory checkpoint's copy in durable storage)."""
    store.write_atomic(store.join(ckpt_dir, MANIFEST_NAME), raw)
