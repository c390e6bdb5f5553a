"""Reading a manifest: :func:`parse` validates every field before anything uses it, and a manifest
in parts is read as it is used (:class:`PartedTensors`: the parts a reader needs, each checked
against the hash the root records; :class:`RankFiles`: each rank's own tables).  The names,
constants and writing of manifests are in :mod:`.manifest`.

Guarantees of a parsed Manifest: the text matches its own checksum (from version 2: an edit
that changes what it says is an IntegrityError); file names are plain names inside the
checkpoint directory, or ``<tag>/<name>`` inside an earlier checkpoint of the same save
directory; every tensor has a known dtype and kind; every stored box fits its shape and the
distinct boxes tile the tensor exactly; derivations point at a stored tensor of the same shape;
hashes are well-formed; object trees refer only to stored tensors.  A part, rank file or meta
file is checked against what the root binds it by before anything of it is used."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Tuple

from .boxes import check_tiling
from ..errors import FormatError, IntegrityError
from .hashing import check_digest_format, hash_buffer, owner_of
from .jsontree import tensor_refs
from ..types import KINDS, DTYPES, Box, Derivation, Manifest, StoredBox, TensorEntry
from .manifest import (BOUND_SINCE, CHECKSUM, FORMAT, META_FORMAT, PAGED_PART_FORMAT, PAGED_SINCE, PARTED_SINCE, PART_FORMAT, RANKED_SINCE, RANK_FORMAT, RANK_OBJECT, READABLE_VERSIONS, TAG_RE, FILE_RE, checksum, meta_name, part_name, rank_file_name, shard_file_of, split_file, writer_of)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _inside(box: Box, bound: Box) -> bool:
    """``box`` lies inside ``bound`` (an empty box: within its far corner)."""
    end = tuple(o + n for o, n in zip(bound.offsets, bound.lengths))
    return box.intersect(bound) == box or (box.numel == 0 and box.fits(end))


def _rows(rows, ndim: int, bound: Optional[Box], where: str) -> None:
    """Raise unless ``rows`` is a list of [offsets, lengths, start, size, hash] of ``ndim`` dimensions,
    each inside ``bound`` (the row that points at them, if any)."""
    for row in rows if isinstance(rows, list) else [rows]:
        if not (isinstance(row, list) and len(row) == 5 and all(
                isinstance(v, list) and len(v) == ndim and all(_count(x) for x in v) for v in row[:2])
                and _count(row[2]) and _count(row[3]) and isinstance(row[4], str) and check_digest_format(row[4])
                and (bound is None or _inside(Box(row[0], row[1]), bound))):
            raise FormatError(f"{where} has a row that is not [offsets, lengths, start, size, hash] inside its "
                              f"page's bounds: {row!r}")


def _need(d, key, types, where):
    if not isinstance(d, dict) or key not in d:
        raise FormatError(f"manifest: {where} lacks the field {key!r}")
    v = d[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in (
            types if isinstance(types, tuple) else (types,))):
        raise FormatError(f"manifest: {where}.{key} has type {type(v).__name__}, expected {types}")
    return v


def _tensors(raw_tensors: dict, version: int, files: dict, tag: str, where: str,
             referenced: Optional[set] = None, whole: bool = True) -> Dict[str, TensorEntry]:
    """The tensor table (or one part of it), validated; ``referenced``: the references to earlier
    checkpoints a part may hold (those its index lists), None: any; ``whole=False``: entries cut
    down to some of their boxes (a rank file), which need not tile their tensors."""
    tensors = {}
    for name, t in raw_tensors.items():
        w = f"tensors[{name}]"
        kind = _need(t, "kind", str, w)
        dtype = _need(t, "dtype", str, w)
        if kind not in KINDS:
            raise FormatError(f"manifest: {w}.kind {kind!r} is not one of {KINDS}")
        if dtype not in DTYPES:
            raise FormatError(f"manifest: {w}.dtype {dtype!r} is not one of {sorted(DTYPES)}")
        shape = _need(t, "shape", list, w)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise FormatError(f"manifest: {w}.shape {shape!r} is not a list of sizes")
        shape = tuple(shape)
        if "derived" in t:
            dv = _need(t, "derived", dict, w)
            dboxes = []
            if version >= BOUND_SINCE:      # the digests of what it derives to (format 2)
                for i, b in enumerate(_need(dv, "boxes", list, w + ".derived")):
                    wb = f"{w}.derived.boxes[{i}]"
                    digest = _need(b, "hash", str, wb)
                    if not check_digest_format(digest):
                        raise FormatError(f"manifest: {wb}.hash {digest!r} is not an xxh3_128 digest")
                    dboxes.append((Box(tuple(_need(b, "offsets", list, wb)), tuple(_need(b, "lengths", list, wb))),
                                   digest))
                check_tiling(name, shape, [b for b, _ in dboxes], whole)
            entry = TensorEntry(name, kind, dtype, shape,
                                derived=Derivation(_need(dv, "source", str, w + ".derived"),
                                                   _need(dv, "op", str, w + ".derived"), tuple(dboxes)))
        else:
            boxes = []
            for i, b in enumerate(_need(t, "boxes", list, w)):
                wb = f"{w}.boxes[{i}]"
                box = Box(tuple(_need(b, "offsets", list, wb)), tuple(_need(b, "lengths", list, wb)))
                fname = _need(b, "file", str, wb)
                ref_tag, plain = split_file(fname)
                if ref_tag is None and fname not in files:
                    raise FormatError(f"manifest: {wb} refers to file {fname!r} that the "
                                      "manifest does not list")
                if ref_tag is not None and (not TAG_RE.match(ref_tag) or ref_tag in ("latest", tag)
                                            or not FILE_RE.match(plain)
                                            or (referenced is not None and fname not in referenced)):
                    raise FormatError(f"manifest: {wb} refers to {fname!r}, which is not "
                                      "'<earlier tag>/<shard>.safetensors' in the save directory")
                digest = _need(b, "hash", str, wb)
                if not check_digest_format(digest):
                    raise FormatError(f"manifest: {wb}.hash {digest!r} is not an xxh3_128 digest")
                holders = _need(b, "holders", list, wb)
                if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in holders):
                    raise FormatError(f"manifest: {wb}.holders {holders!r} is not a list of ranks")
                boxes.append(StoredBox(box, fname, _need(b, "key", str, wb), digest, tuple(holders)))
            check_tiling(name, shape, [b.box for b in boxes], whole)
            entry = TensorEntry(name, kind, dtype, shape, boxes=tuple(boxes))
        tensors[name] = entry
    return tensors


def _check_sources(tensors: Dict[str, TensorEntry], lookup: Callable[[str], Optional[TensorEntry]]) -> None:
    for name, e in tensors.items():
        if e.derived is not None:
            src = lookup(e.derived.source)
            if src is None or src.derived is not None or src.shape != e.shape:
                raise FormatError(f"manifest: {name} is derived from {e.derived.source!r}, which is "
                                  "missing, itself derived, or of another shape")


def _index(d: dict, version: int, where: str) -> dict:
    index = _need(d, "index", dict, where)
    generation = _need(index, "generation", int, where + ".index")
    parts = _need(index, "parts", int, where + ".index")
    count = _need(index, "tensors", int, where + ".index")
    ranks = 0
    referenced = _need(index, "referenced", list, where + ".index")
    if version >= RANKED_SINCE:     # the parts check themselves
        hashes = [None] * parts
        ranks = _need(index, "ranks", int, where + ".index")
        writers = _need(index, "writers", list, where + ".index")
        if not all(isinstance(w, list) and len(w) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in w) and 0 <= w[0] < w[1] <= ranks
                   for w in writers):
            raise FormatError(f"{where}: index.writers is not a list of [first, end) ranges of ranks: {writers!r}")
        nfiles = sum(b - a for a, b in writers)
        if not check_digest_format(_need(index, "meta", str, where + ".index")):
            raise FormatError(f"{where}: index.meta {index['meta']!r} is not an xxh3_128 digest")
        if ranks < 1 or nfiles < 0:
            raise FormatError(f"{where}: index does not describe its rank files ({ranks} ranks, {nfiles} files)")
    else:
        hashes = _need(index, "hashes", list, where + ".index")
    if generation < 0 or parts < 1 or len(hashes) != parts or count < 0 or ranks < 0:
        raise FormatError(f"{where}: index does not describe its parts (generation {generation}, "
                          f"{parts} parts, {len(hashes)} hashes, {count} tensors)")
    for h in hashes:
        if h is not None and not (isinstance(h, str) and check_digest_format(h)):
            raise FormatError(f"{where}: index hash {h!r} is not an xxh3_128 digest")
    _check_references(referenced, where + ": index.referenced")
    return index


def _check_references(referenced, where: str) -> None:
    for r in referenced:
        ref_tag, plain = split_file(r) if isinstance(r, str) else (None, None)
        if ref_tag is None or not TAG_RE.match(ref_tag) or not FILE_RE.match(plain):
            raise FormatError(f"{where} holds {r!r}, not '<earlier tag>/<shard>.safetensors'")


class _WrittenFiles:
    """The shard files a format 5 checkpoint's boxes may name in its own directory: those its
    writers wrote in its generation (``manifest.file_name``); their rank files give their sizes."""

    def __init__(self, generation: int, writers: list):
        self.generation, self.writers = generation, writers

    def __contains__(self, fname) -> bool:
        written = shard_file_of(fname)
        return (written is not None and written[1] == self.generation
                and any(a <= written[0] < b for a, b in self.writers))


def _read_checked(open_part, name: str, where: str, what: str, digest: Optional[str] = None) -> bytes:
    """The bytes of file ``name`` of a manifest in parts (``what``: "part", "rank file", ...), with
    ``digest``: checked against it, the hash the manifest binds it by."""
    if open_part is None:
        raise FormatError(f"{where}: the manifest is in parts ({name}, ...), and nothing was given to read "
                          "them with (read the manifest with adacheck.storage.manifest_files.read_manifest)")
    try:
        data = open_part(name)
    except FileNotFoundError:
        raise FormatError(f"{where}: its {what} {name} is missing: the checkpoint is incomplete or damaged") from None
    except OSError as e:
        raise FormatError(f"{where}: cannot read its {what} {name}: {e}") from e
    if digest is not None and hash_buffer(data) != digest:
        raise IntegrityError(f"{where}: its {what} {name} does not match the hash the manifest binds it by: it was "
                             "edited or damaged after AdaCheck wrote it, so nothing it says can be trusted. Restore "
                             "it from a copy, or load an older checkpoint (adacheck ls lists them)")
    return data


def _load_checked(data: bytes, where: str, expect: dict, self_checked: bool) -> dict:
    """A part or rank file's JSON, that it is the file ``expect`` says (format, tag, number...) and
    (``self_checked``, format 5 and rank files) that it matches its own checksum."""
    try:
        d = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(d, dict) or any(d.get(k) != v for k, v in expect.items()):
        raise FormatError(f"{where}: not " + ", ".join(f"{k} {v!r}" for k, v in expect.items()))
    if self_checked and d.get(CHECKSUM) != checksum(d):
        raise IntegrityError(f"{where}: does not match its checksum: it was edited or damaged after AdaCheck "
                             "wrote it, so nothing it says can be trusted. Restore it from a copy, or load an "
                             "older checkpoint (adacheck ls lists them)")
    return d


class PartedTensors(Mapping):
    """The tensor table of a manifest in parts: a part is read (``open_part(name)`` -> bytes),
    checked (format 4: against its hash in the index; 5: against its own checksum) and validated
    the first time one of its tensors is asked for; iterating reads them all.  ``bytes_read``:
    the part bytes read so far."""

    def __init__(self, index: dict, files, tag: str, version: int,
                 open_part: Optional[Callable[[str], bytes]], where: str):
        self.index, self.files, self.tag, self.version, self.where = index, files, tag, version, where
        self.open_part = open_part
        self.loaded: Dict[int, Dict[str, TensorEntry]] = {}
        self.referenced = set(index["referenced"])
        self.bytes_read = self.meta_bytes_read = 0
        self._meta: Optional[Dict[str, list]] = None
        self.paged = version >= PAGED_SINCE
        self._headers: Dict[int, Tuple[dict, int]] = {}     # format 6: part -> (its header's index, base)
        self._sizes: Dict[tuple, int] = {}                  # (part, start) -> a checked page's size
        self._parsed: Dict[tuple, list] = {}                # (part, start) -> its boxes or rows (raw)
        self._entries: Dict[tuple, dict] = {}               # (part, tensor) -> its entry (raw)
        self._regions: Dict[tuple, TensorEntry] = {}

    def meta(self) -> Optional[Dict[str, list]]:
        """Format 5: what its meta file says of each tensor but a rank's own objects ([kind, dtype,
        shape, source, op], :func:`tensor_meta`), read and checked against its hash in the index the
        first time it is asked for; None for format 4."""
        if self.version < RANKED_SINCE:
            return None
        if self._meta is None:
            name = meta_name(self.index["generation"])
            data = _read_checked(self.open_part, name, self.where, "meta file", self.index["meta"])
            self.meta_bytes_read += len(data)
            where = f"{self.where} meta file {name}"
            d = _load_checked(data, where, {"format": META_FORMAT, "tag": self.tag,
                                            "generation": self.index["generation"]}, False)
            meta = _need(d, "meta", dict, where)
            for n, row in meta.items():
                if not (isinstance(row, list) and len(row) == 5 and row[0] in KINDS and row[1] in DTYPES
                        and isinstance(row[2], list)
                        and all(_count(x) for x in row[2])
                        and (row[3] is None) == (row[4] is None)
                        and all(isinstance(x, (str, type(None))) for x in row[3:]) and not RANK_OBJECT.match(n)):
                    raise FormatError(f"{where}: meta[{n!r}] is not [kind, dtype, shape, source, op]: {row!r}")
            if len(meta) > self.index["tensors"]:
                raise FormatError(f"{where}: lists {len(meta)} tensors, more than the index's {self.index['tensors']}")
            self._meta = meta
        return self._meta

    def part(self, i: int) -> Dict[str, TensorEntry]:
        if i in self.loaded:
            return self.loaded[i]
        ranked = self.version >= RANKED_SINCE
        digest = None if ranked else self.index["hashes"][i]
        if digest is None and not ranked:
            self.loaded[i] = {}
            return self.loaded[i]
        name = part_name(self.index["generation"], i)
        data = _read_checked(self.open_part, name, self.where, "part", digest)
        self.bytes_read += len(data)
        where = f"{self.where} part {name}"
        if self.paged:      # the header's entries, each with the boxes of all its pages
            end = data.find(b"\n")
            head, base = self._header_of(i, data[:end] if end >= 0 else data, end + 1)
            body = data[base:]
            raw = {}
            for n in head:
                t = self._entry(i, n, body)
                raw[n] = self._with_boxes(t, self._boxes(i, n, t["pages"], t["depth"], None, body))
            if sum(n for k, n in self._sizes.items() if k[0] == i) != len(body):
                raise FormatError(f"{where}: its pages do not fill the file after its header")
        else:
            expect = {"format": PART_FORMAT, "tag": self.tag, "part": i}
            d = _load_checked(data, where, dict(expect, generation=self.index["generation"]) if ranked else expect,
                              ranked)
            raw = _need(d, "tensors", dict, where)
        tensors = _tensors(raw, self.version, self.files, self.tag, where, referenced=self.referenced)
        strays = [n for n in tensors if owner_of(n, self.index["parts"]) != i]
        if strays:
            raise FormatError(f"{where}: lists {strays[0]!r}, which belongs to another part")
        self.loaded[i] = tensors
        _check_sources(tensors, self.get)
        return tensors

    def __getitem__(self, name: str) -> TensorEntry:
        return self.part(owner_of(name, self.index["parts"]))[name]

    def region(self, name: str, box: Box) -> TensorEntry:
        """Tensor ``name``'s entry cut down to its boxes that meet ``box``: format 6 reads the
        header of its part and the pages whose rows meet ``box`` (once each), earlier formats the part."""
        i = owner_of(name, self.index["parts"])
        if not self.paged or i in self.loaded:
            e = self.part(i)[name]
            if e.derived is not None:
                return replace(e, derived=replace(e.derived, boxes=tuple(
                    (b, h) for b, h in e.derived.boxes if b.intersect(box) is not None)))
            return replace(e, boxes=tuple(sb for sb in e.boxes if sb.box.intersect(box) is not None))
        self._header(i)
        t = self._entry(i, name)
        boxes = self._boxes(i, name, t["pages"], t["depth"], box)
        key = (name, tuple(id(b) for b in boxes))
        if key not in self._regions:
            where = f"{self.where} part {part_name(self.index['generation'], i)}"
            self._regions[key] = _tensors({name: self._with_boxes(t, boxes)}, self.version, self.files,
                                          self.tag, where, referenced=self.referenced, whole=False)[name]
        return self._regions[key]

    def _header(self, i: int) -> dict:
        """Format 6: part ``i``'s header's entries (read in growing ranges up to its newline)."""
        if i not in self._headers:
            name, data, size = part_name(self.index["generation"], i), b"", 1024
            while True:
                more = self._read_range(name, len(data), size)
                data += more
                end = data.find(b"\n")
                if end >= 0 or len(more) < size:
                    break
                size *= 2
            self._header_of(i, data[:end] if end >= 0 else data, end + 1)
        return self._headers[i][0]

    def _header_of(self, i: int, data: bytes, base: int) -> Tuple[dict, int]:
        """Part ``i``'s header from its bytes, checked and validated (kept), and where its pages start."""
        name = part_name(self.index["generation"], i)
        where = f"{self.where} part {name}"
        if base <= 0:
            raise FormatError(f"{where}: no header line (a paged part starts with one)")
        d = _load_checked(data, where, {"format": PAGED_PART_FORMAT, "tag": self.tag, "part": i,
                                        "generation": self.index["generation"]}, True)
        head = _need(d, "tensors", dict, where)
        for n, at in head.items():
            if not (isinstance(at, list) and len(at) == 3 and _count(at[0]) and _count(at[1])
                    and isinstance(at[2], str) and check_digest_format(at[2])):
                raise FormatError(f"{where}: tensors[{n!r}] is not [start, size, hash]: {at!r}")
            if owner_of(n, self.index["parts"]) != i:
                raise FormatError(f"{where}: lists {n!r}, which belongs to another part")
        self._headers[i] = (head, base)
        return self._headers[i]

    def _entry(self, i: int, name: str, body: Optional[bytes] = None) -> dict:
        """Tensor ``name``'s entry in part ``i`` (its header read), checked against the hash the header
        binds it by and validated (kept); KeyError if the part does not list it."""
        if (i, name) not in self._entries:
            start, size, digest = self._headers[i][0][name]
            what = f"{self.where} part {part_name(self.index['generation'], i)}: the entry of {name}"
            try:
                t = json.loads(self._bytes(i, start, size, digest, what, body), parse_constant=_no_constant)
            except (ValueError, RecursionError) as e:
                raise FormatError(f"{what} is not valid JSON ({e})") from None
            if not isinstance(t, dict):
                raise FormatError(f"{what} is not a JSON object")
            _rows(_need(t, "pages", list, what), len(_need(t, "shape", list, what)), None, what)
            if not _count(t.get("depth")):
                raise FormatError(f"{what}: its depth is not a count: {t.get('depth')!r}")
            self._entries[i, name] = t
        return self._entries[i, name]

    def _bytes(self, i: int, start: int, size: int, digest: str, what: str, body: Optional[bytes]) -> bytes:
        """Bytes ``[start, start + size)`` after part ``i``'s header (from ``body`` if given), checked
        against ``digest`` (kept, for the check that its pages fill the part)."""
        data = body[start:start + size] if body is not None else \
            self._read_range(part_name(self.index["generation"], i), self._headers[i][1] + start, size)
        if len(data) != size or hash_buffer(data) != digest:
            raise IntegrityError(f"{what} (bytes {start}-{start + size} after its header) does not match the hash "
                                 "that binds it: it was edited or damaged after AdaCheck wrote it, so nothing it says "
                                 "can be trusted. Restore it from a copy, or load an older checkpoint (adacheck ls "
                                 "lists them)")
        self._sizes[i, start] = size
        return data

    def _boxes(self, i: int, name: str, rows: list, depth: int, box: Optional[Box],
               body: Optional[bytes] = None) -> list:
        """The boxes (raw) of ``name`` under ``rows`` of part ``i`` that lie in pages meeting ``box``
        (None: all), its pages read (from ``body``, the part's bytes after its header, if given) and
        checked once each."""
        out = []
        for row in rows:
            bound = Box(row[0], row[1])
            if box is not None and bound.intersect(box) is None:
                continue
            items = self._page(i, name, row, depth, body)
            out += items if depth == 0 else self._boxes(i, name, items, depth - 1, box, body)
        return out

    def _page(self, i: int, name: str, row: list, depth: int, body: Optional[bytes]) -> list:
        """The page ``row`` points at: its boxes (``depth`` 0) or rows, checked against the hash ``row``
        binds it by, each inside ``row``'s bounds (kept)."""
        if (i, row[2]) not in self._parsed:
            what = f"{self.where} part {part_name(self.index['generation'], i)}: a page of {name}"
            data = self._bytes(i, row[2], row[3], row[4], what, body)
            bound = Box(row[0], row[1])
            try:
                items = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
            except (ValueError, RecursionError) as e:
                raise FormatError(f"{what} is not valid JSON ({e})") from None
            if depth > 0:
                _rows(items, bound.ndim, bound, what)
            else:
                try:
                    inside = isinstance(items, list) and all(
                        isinstance(b, dict) and _inside(Box(b.get("offsets"), b.get("lengths")), bound) for b in items)
                except (TypeError, FormatError):
                    inside = False
                if not inside:
                    raise FormatError(f"{what} is not a list of boxes inside {row[:2]}")
            self._parsed[i, row[2]] = items
        return self._parsed[i, row[2]]

    @staticmethod
    def _with_boxes(head: dict, boxes: list) -> dict:
        """A format 6 entry as format 5 writes it, with ``boxes``."""
        raw = {k: v for k, v in head.items() if k not in ("pages", "depth")}
        if "derived" in raw:
            raw["derived"] = dict(raw["derived"], boxes=boxes) if isinstance(raw["derived"], dict) else raw["derived"]
        else:
            raw["boxes"] = boxes
        return raw

    def _read_range(self, name: str, start: int, size: int) -> bytes:
        """Bytes ``[start, start + size)`` of file ``name`` (fewer at its end), counted."""
        ranged = getattr(self.open_part, "read_range", None)
        try:
            data = ranged(name, start, size) if ranged is not None else \
                _read_checked(self.open_part, name, self.where, "part")[start:start + size]
        except FileNotFoundError:
            raise FormatError(f"{self.where}: its part {name} is missing: the checkpoint is incomplete or damaged") \
                from None
        except OSError as e:
            raise FormatError(f"{self.where}: cannot read its part {name}: {e}") from e
        self.bytes_read += len(data)
        return data

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self.part(owner_of(name, self.index["parts"]))

    def __iter__(self):
        names = [n for i in range(self.index["parts"]) for n in self.part(i)]
        if len(names) != self.index["tensors"]:
            raise FormatError(f"{self.where}: its parts list {len(names)} tensors, its index {self.index['tensors']}")
        return iter(sorted(names))

    def __len__(self) -> int:
        return self.index["tensors"]


@dataclass(frozen=True)
class RankFile:
    """What one saving rank's file says: the entries of the tensors it held, cut down to the boxes
    that meet its own (holders: the rank itself where it held a copy's bytes), its layout, its
    objects, the files it wrote ({name: {"writer", "nbytes"}}) and its node."""
    tensors: Dict[str, TensorEntry]
    layout: dict
    objects: dict
    files: Dict[str, dict]
    node: Optional[str]


class RankFiles:
    """The rank files of a format 5 manifest, each read, checked against its checksum and
    validated the first time it is asked for (``get(rank)``); ``bytes_read``: what was read."""

    def __init__(self, index: dict, files, tag: str, version: int, open_part: Optional[Callable[[str], bytes]],
                 where: str):
        self.index, self.files, self.tag, self.version, self.where = index, files, tag, version, where
        self.open_part = open_part
        self.count = index.get("ranks", 0)
        self.loaded: Dict[int, RankFile] = {}
        self.bytes_read = 0

    def get(self, rank: int) -> RankFile:
        if rank in self.loaded:
            return self.loaded[rank]
        if not (isinstance(rank, int) and 0 <= rank < self.count):
            raise IndexError(f"{self.where}: no rank {rank} among its {self.count} saving ranks")
        gen = self.index["generation"]
        name = rank_file_name(gen, rank)
        data = _read_checked(self.open_part, name, self.where, "rank file")
        self.bytes_read += len(data)
        where = f"{self.where} rank file {name}"
        d = _load_checked(data, where, {"format": RANK_FORMAT, "tag": self.tag, "generation": gen, "rank": rank}, True)
        tensors = _tensors(_need(d, "tensors", dict, where), self.version, self.files, self.tag, where,
                           referenced=set(self.index["referenced"]), whole=False)
        for name_, e in tensors.items():
            if e.derived is None and any(set(sb.holders) - {rank} for sb in e.boxes):
                raise FormatError(f"{where}: {name_} names holders other than rank {rank}")
        files = _need(d, "files", dict, where)
        for fname, info in files.items():
            if fname not in self.files or _need(info, "writer", int, f"{where}.files[{fname}]") != rank:
                raise FormatError(f"{where}: lists {fname!r}, which is not a file rank {rank} writes")
            _need(info, "nbytes", int, f"{where}.files[{fname}]")
        node = d.get("node")
        got = RankFile(tensors, _need(d, "layout", dict, where), _need(d, "objects", dict, where), files,
                       node if isinstance(node, str) else None)
        self.loaded[rank] = got
        return got


class RankTable(Sequence):
    """One per-rank table of a format 5 manifest (``field``: "layout" or "objects"), each rank's
    entry read from its rank file when asked for; compares equal to the list it stands for."""

    def __init__(self, ranks: RankFiles, field_: str):
        self.ranks, self.field = ranks, field_

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[r] for r in range(self.ranks.count)[rank]]
        if rank < 0:
            rank += self.ranks.count
        return getattr(self.ranks.get(rank), self.field)

    def __len__(self) -> int:
        return self.ranks.count

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, RankTable)) and list(self) == list(other)


class FileTable(Mapping):
    """The shard files of a format 5 checkpoint ({name: {"writer", "nbytes"}}), each from the rank
    file of the rank that wrote it; iterating reads every rank file."""

    def __init__(self, ranks: RankFiles, count: int):
        self.ranks, self.count = ranks, count

    def __getitem__(self, fname: str) -> dict:
        if fname not in self.ranks.files:
            raise KeyError(fname)
        return self.ranks.get(writer_of(fname)).files[fname]

    def __contains__(self, fname) -> bool:
        try:
            self[fname]
            return True
        except KeyError:
            return False

    def __iter__(self):
        names = [f for r in range(self.ranks.count) for f in self.ranks.get(r).files]
        if len(names) != self.count:
            raise FormatError(f"{self.ranks.where}: its rank files list {len(names)} shard files, its index "
                              f"{self.count}")
        return iter(names)

    def __len__(self) -> int:
        return self.count

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)


def ranked_tables(index: dict, tag: str, version: int, open_part: Optional[Callable[[str], bytes]], where: str):
    """A format 5 manifest's tables, each part or rank file read when first asked for: (tensors,
    rank files, shard files, each rank's objects, layout)."""
    written = _WrittenFiles(index["generation"], index["writers"])
    ranks = RankFiles(index, written, tag, version, open_part, where)
    return (PartedTensors(index, written, tag, version, open_part, where), ranks,
            FileTable(ranks, sum(b - a for a, b in index["writers"])), RankTable(ranks, "objects"),
            {"ranks": RankTable(ranks, "layout")})


def parse(text: str, where: str = "manifest.json", open_part: Optional[Callable[[str], bytes]] = None) -> Manifest:
    """The manifest ``text``, validated; ``open_part(name)``: the bytes of a part or rank file of a
    manifest in parts (formats 4-6), read when a tensor (a rank's table) of it is first asked for."""
    try:
        d = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise FormatError(f"{where}: not an AdaCheck manifest (field 'format' != {FORMAT!r})")
    version = _need(d, "format_version", int, where)
    if version not in READABLE_VERSIONS:
        raise FormatError(f"{where}: format_version {version} is not supported by this AdaCheck "
                          f"(reads {', '.join(map(str, READABLE_VERSIONS))}); upgrade AdaCheck to read it")
    if version >= BOUND_SINCE:
        recorded = d.get(CHECKSUM)
        if recorded != checksum(d):
            raise IntegrityError(
                f"{where}: the manifest does not match its checksum (recorded {recorded!r}): it was edited "
                "or damaged after AdaCheck wrote it, so nothing it says can be trusted. Restore it from a "
                "copy, or load an older checkpoint (adacheck ls lists them)")
    tag = _need(d, "tag", str, where)
    step = d.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise FormatError(f"{where}: step must be an integer or null, got {step!r}")
    index = ranks = None
    if version >= RANKED_SINCE:
        index = _index(d, version, where)
        tensors, ranks, files, rank_objects, layout = ranked_tables(index, tag, version, open_part, where)
    else:
        files = _need(d, "files", dict, where)
        for fname, info in files.items():
            if not FILE_RE.match(fname):
                raise FormatError(f"{where}: shard file name {fname!r} is not a plain "
                                  "'*.safetensors' name inside the checkpoint directory")
            _need(info, "nbytes", int, f"files[{fname}]")
            _need(info, "writer", int, f"files[{fname}]")
        if version >= PARTED_SINCE and "index" in d:
            index = _index(d, version, where)
            tensors = PartedTensors(index, files, tag, version, open_part, where)
        else:
            tensors = _tensors(_need(d, "tensors", dict, where), version, files, tag, where)
            _check_sources(tensors, tensors.get)
        rank_objects, layout = d.get("rank_objects", []), d.get("layout", {})
        if not isinstance(rank_objects, list):
            raise FormatError(f"{where}: rank_objects must be a list")
        rank_objects = tuple(rank_objects)
    objects = d.get("objects", {})
    # in parts: checked when the objects are read, CheckpointReader.objects; here it would read parts
    for ref in tensor_refs(objects) + tensor_refs(list(rank_objects)) if index is None else ():
        if not isinstance(ref, str) or ref not in tensors:
            raise FormatError(f"{where}: saved objects refer to tensor {ref!r} that is not stored")
    stats = d.get("stats", {})
    if not isinstance(layout, dict) or not isinstance(stats, dict):
        raise FormatError(f"{where}: layout and stats must be JSON objects")
    return Manifest(format_version=version, tag=tag, step=step,
                    framework=_need(d, "framework", dict, where),
                    topology=_need(d, "topology", dict, where), tensors=tensors,
                    objects=objects, rank_objects=rank_objects,
                    layout=layout, files=files, stats=stats, index=index, ranks=ranks)
