"""The manifest's names, constants and serialisation: what a checkpoint's ``manifest.json`` (and,
for a manifest in parts, its part, rank and meta files) holds and how it is written.  Reading and
validating one is :mod:`.manifest_read`.

Which format version a save writes:

=======  ==================================================================================
version  written by
=======  ==================================================================================
2        a ring save (``FORMAT_VERSION``): one ``manifest.json``; each box's hash bound to its
         identity (:func:`~adacheck.format.hashing.bound_digest`); the text's own ``checksum``
3        the same with ``compression`` (``COMPRESSED_SINCE``): shard files may be encoded
6        a partitioned save (``PAGED_SINCE``): the root holds an ``index``; the tensor table is
         in parts ``manifest-g<gen>-part-<i>.json`` (part i: the tensors whose ``owner_of`` is
         i), each tensor's boxes in pages under a tree of rows; each rank's tables (layout,
         objects, its file, its node, the entries it held) in ``manifest-g<gen>-rank-<r>.json``;
         what each tensor is in ``manifest-g<gen>-meta.json``.  Parts, pages, rank files and
         the meta file are bound to the root by hashes or checksums.
=======  ==================================================================================

Every version in ``READABLE_VERSIONS`` loads: 1 (hashes of the bytes alone, no checksum; read
with a warning), 4 (parts without rank files) and 5 (rank files, parts without pages) too."""
from __future__ import annotations

import json
import re
from typing import Dict, Optional, Tuple

from .hashing import hash_buffer
from ..types import Derivation, Manifest, TensorEntry

FORMAT = "adacheck"
FORMAT_VERSION = 2     # a ring save without compression (the table above)
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
COMPRESSED_SINCE = 3   # format versions from here on may hold encoded (compressed) shard files
PARTED_SINCE = 4       # format versions from here on may keep the tensor table in parts (``index``)
RANKED_SINCE = 5       # from here on a manifest in parts keeps its per-rank tables in rank files
PAGED_SINCE = 6        # from here on its parts keep each tensor's boxes in pages (read by region)
PART_FORMAT = "adacheck-manifest-part"
PAGED_PART_FORMAT = "adacheck-manifest-paged-part"
PAGE_BOXES = 16        # boxes per page of a paged part
PAGE_ROWS = 16         # rows per page of rows, and at most in its header, per tensor
RANK_FORMAT = "adacheck-manifest-rank"
META_FORMAT = "adacheck-manifest-meta"
# the names part_name, rank_file_name and meta_name give
PART_PATTERN = r"manifest-g\d+-(?:(?:part|rank)-\d{5,}|meta)\.json"
BOUND_SINCE = 2        # format versions from here on bind box hashes to their identity
CHECKSUM = "checksum"
MANIFEST_NAME = "manifest.json"
FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")
RANK_OBJECT = re.compile(r"^rank\d+/")     # the tensors of a rank's own objects, checkpoint._object_shards
JOB_OBJECTS = "object/"                     # and of the job's objects, saved by rank 0
# file_name's names: five digits of rank, more from rank 100,000 on
SHARD_PATTERN = r"rank(\d{5,})-g(\d+)\.safetensors"
_WRITER_FILE = re.compile("^" + SHARD_PATTERN + "$")
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")


def split_file(ref: str):
    """``file`` -> (None, file) in this checkpoint; ``<tag>/<file>`` -> (tag, file) in the
    sibling checkpoint ``tag`` of the same save directory (a box unchanged since then)."""
    tag, sep, name = ref.rpartition("/")
    return (tag if sep else None), name


def referenced_files(m: Manifest):
    """{(tag, file)} this checkpoint needs, with tag None for its own directory (a manifest in
    parts: its own files and the references its index lists, no part read)."""
    if m.index is not None:
        own = (m.files if m.format_version < RANKED_SINCE else
               [file_name(w, m.index["generation"]) for a, b in m.index["writers"] for w in range(a, b)])
        return {(None, f) for f in own} | {split_file(r) for r in m.index["referenced"]}
    return {split_file(b.file) for e in m.tensors.values() for b in e.boxes}


def file_name(rank: int, generation: int) -> str:
    """The shard file rank ``rank`` writes in a save of file generation ``generation``."""
    return f"rank{rank:05d}-g{generation}.safetensors"


def own_files(generation: int, rank: int) -> list:
    """The names of the files ``rank`` writes in a save in parts (format 5): its shard file (if it
    writes one), its part of the tensor table and its rank file; rank 0 the meta file too."""
    return [file_name(rank, generation), part_name(generation, rank), rank_file_name(generation, rank)] + (
        [meta_name(generation)] if rank == 0 else [])


def part_name(generation: int, part: int) -> str:
    return f"manifest-g{generation}-part-{part:05d}.json"


def rank_file_name(generation: int, rank: int) -> str:
    return f"manifest-g{generation}-rank-{rank:05d}.json"


def meta_name(generation: int) -> str:
    return f"manifest-g{generation}-meta.json"


def meta_bytes(tag: str, generation: int, meta: Dict[str, list]) -> bytes:
    """The text of a format 5 manifest's meta file (:func:`tensor_meta`); its hash goes in the index."""
    return json.dumps({"format": META_FORMAT, "tag": tag, "generation": generation, "meta": meta},
                      sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")


def part_names(m: Manifest):
    """The part files and rank files of a manifest in parts (none for one in one file)."""
    if m.index is None:
        return []
    g = m.index["generation"]
    parts = (range(m.index["parts"]) if "hashes" not in m.index
             else [i for i, h in enumerate(m.index["hashes"]) if h is not None])
    return ([part_name(g, i) for i in parts] + [rank_file_name(g, r) for r in range(m.index.get("ranks", 0))]
            + ([meta_name(g)] if m.format_version >= RANKED_SINCE else []))


def _checked_bytes(d: dict) -> bytes:
    """``d`` as compact canonical JSON with the checksum of the rest of it (a part or rank file of
    format 5, which binds itself rather than being bound by a hash in the index)."""
    d[CHECKSUM] = checksum(d)
    return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")


def rank_file_bytes(tag: str, generation: int, rank: int, tensors: dict, tables: Optional[dict] = None) -> bytes:
    """The text of rank ``rank``'s file of checkpoint ``tag`` (``tensors``: its held entries, as
    :func:`tensors_json` gives them; ``tables``, format 5: its ``layout``, ``objects``, ``files``
    and ``node``), with the checksum of everything else in it."""
    return _checked_bytes(dict({"format": RANK_FORMAT, "tag": tag, "generation": generation, "rank": rank,
                                "tensors": tensors}, **(tables or {})))


def part_bytes(tag: str, part: int, tensors: Dict[str, TensorEntry], generation: Optional[int] = None,
               paged: bool = False) -> bytes:
    """The text of part ``part`` of checkpoint ``tag``'s tensor table: format 4 (its hash goes in the
    index), with ``generation`` format 5 (with a checksum), and with ``paged`` too format 6
    (:func:`paged_part_bytes`)."""
    if paged:
        return paged_part_bytes(tag, part, tensors, generation)
    d = {"format": PART_FORMAT, "tag": tag, "part": part, "tensors": tensors_json(tensors)}
    if generation is None:
        return json.dumps(d, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")
    return _checked_bytes(dict(d, generation=generation))


def _compact(v) -> bytes:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")


def _take_boxes(d: dict) -> list:
    """The boxes of a tensor entry as :func:`tensors_json` writes it (its stored boxes, or a derived
    tensor's), taken out of it."""
    return d["derived"].pop("boxes", []) if "derived" in d else d.pop("boxes")


def paged_part_bytes(tag: str, part: int, tensors: Dict[str, TensorEntry], generation: int) -> bytes:
    """Format 6's part: one line of header, then pages.  The header (canonical JSON with its checksum)
    gives each tensor ``[start, size, hash]`` of its entry: where its bytes start after the header's
    newline, how many, and their xxh3-128.  The entry (a JSON object and a newline) is format 5's
    with, in place of its boxes, ``pages`` and ``depth``: its boxes, sorted by offsets (so that a page
    covers a compact region), go PAGE_BOXES to a page; with more than PAGE_ROWS pages, the rows of
    PAGE_ROWS pages go to a page of rows, and so on up (``depth``: the levels of pages of rows below
    the entry).  A row is ``[offsets, lengths, start, size, hash]``: the box bounding what its page
    lists, and where the page is, as above; a page is the JSON list of its boxes (as format 5 writes
    them) or rows, and a newline.  A reader that needs a region of a tensor reads the header, the
    tensor's entry and, level by level, the pages whose rows meet the region: what it reads grows
    with the logarithm of the tensor's number of boxes, not with it, nor with the other tensors of
    the part beyond their names."""
    head, pages, pos = {}, [], 0

    def page(items: list, bounds: list) -> list:
        nonlocal pos
        data = _compact(items) + b"\n"
        lo = [min(b[0][k] for b in bounds) for k in range(len(bounds[0][0]))]
        hi = [max(b[0][k] + b[1][k] for b in bounds) for k in range(len(bounds[0][0]))]
        row = [lo, [h - o for o, h in zip(lo, hi)], pos, len(data), hash_buffer(data)]
        pages.append(data)
        pos += len(data)
        return row

    for name, d in tensors_json(tensors).items():
        boxes = sorted(_take_boxes(d), key=lambda b: (b["offsets"], b["lengths"], b.get("file", ""), b.get("key", "")))
        rows = [page(boxes[i:i + PAGE_BOXES], [(b["offsets"], b["lengths"]) for b in boxes[i:i + PAGE_BOXES]])
                for i in range(0, len(boxes), PAGE_BOXES)]
        depth = 0
        while len(rows) > PAGE_ROWS:
            rows = [page(rows[i:i + PAGE_ROWS], [r[:2] for r in rows[i:i + PAGE_ROWS]])
                    for i in range(0, len(rows), PAGE_ROWS)]
            depth += 1
        entry = _compact(dict(d, pages=rows, depth=depth)) + b"\n"
        head[name] = [pos, len(entry), hash_buffer(entry)]
        pages.append(entry)
        pos += len(entry)
    header = {"format": PAGED_PART_FORMAT, "tag": tag, "part": part, "generation": generation, "tensors": head}
    return _checked_bytes(header) + b"\n" + b"".join(pages)


def tensor_meta(tensors: Dict[str, TensorEntry]) -> Dict[str, list]:
    """What a format 5 index says of each tensor but a rank's own objects' (which grow with the
    job): [kind, dtype, shape, derivation's source or null, its op or null]; enough to know a
    tensor is there and what it is, without reading its part."""
    return {n: [e.kind, e.dtype, list(e.shape), e.derived.source if e.derived else None,
                e.derived.op if e.derived else None]
            for n, e in sorted(tensors.items()) if not RANK_OBJECT.match(n)}


def meta_entry(name: str, meta: list) -> TensorEntry:
    """The entry a format 5 index's ``meta`` row stands for, without boxes (no part read)."""
    kind, dtype, shape, source, op = meta
    return TensorEntry(name, kind, dtype, tuple(shape),
                       derived=Derivation(source, op, ()) if source is not None else None)


def tensors_json(tensors) -> dict:
    out = {}
    for name in sorted(tensors):
        e = tensors[name]
        d = {"kind": e.kind, "dtype": e.dtype, "shape": list(e.shape)}
        if e.derived is not None:
            d["derived"] = {"source": e.derived.source, "op": e.derived.op}
            if e.derived.boxes:
                d["derived"]["boxes"] = [{"offsets": list(b.offsets), "lengths": list(b.lengths), "hash": h}
                                         for b, h in e.derived.boxes]
        else:
            d["boxes"] = [{"offsets": list(b.box.offsets), "lengths": list(b.box.lengths),
                           "file": b.file, "key": b.key, "hash": b.hash,
                           "holders": list(b.holders)} for b in e.boxes]
        out[name] = d
    return out


def to_json(m: Manifest) -> dict:
    d = {
        "format": FORMAT, "format_version": m.format_version, "tag": m.tag, "step": m.step,
        "framework": m.framework, "topology": m.topology, "stats": m.stats, "objects": m.objects,
    }
    if m.format_version < RANKED_SINCE:    # format 5: in the rank files
        d.update(files=m.files, rank_objects=list(m.rank_objects), layout=m.layout)
    if m.index is not None:
        d["index"] = m.index
    else:
        d["tensors"] = tensors_json(m.tensors)
    return d


def checksum(d: dict) -> str:
    """The xxh3-128 of the manifest's canonical JSON (sorted keys, compact), ``checksum`` left
    out: formatting does not count, every value does."""
    body = {k: v for k, v in d.items() if k != CHECKSUM}
    return hash_buffer(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False,
                                  ensure_ascii=False).encode("utf-8"))


def dumps(m: Manifest) -> str:
    d = to_json(m)
    if m.format_version >= BOUND_SINCE:
        d[CHECKSUM] = checksum(d)
    return json.dumps(d, sort_keys=True, indent=1, allow_nan=False) + "\n"


def shard_file_of(fname: str) -> Optional[Tuple[int, int]]:
    """(writing rank, generation) of a shard file's name (:func:`file_name`); None for other names."""
    m = _WRITER_FILE.match(fname) if isinstance(fname, str) else None
    return (int(m.group(1)), int(m.group(2))) if m is not None else None


def writer_of(fname: str) -> Optional[int]:
    """The rank that wrote a shard file (:func:`file_name`), from its name; None for other files."""
    written = shard_file_of(fname)
    return written[0] if written is not None else None


