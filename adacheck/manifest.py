"""Manifest (de)serialisation.  Parsing validates every field before anything uses it.

Guarantees of a parsed Manifest: the text matches its own checksum (format 2: any edit
that changes what it says is an IntegrityError); file names are plain names inside the
checkpoint directory, or ``<tag>/<name>`` inside an earlier checkpoint of the same save
directory; every tensor has a known dtype and kind; every stored box fits its shape and
the distinct boxes tile the tensor exactly; derivations point at a stored tensor of
the same shape; hashes are well-formed; object trees refer only to stored tensors.

Format versions: 2 (written now) records each box's hash over its identity and bytes
(:func:`adacheck.hashing.bound_digest`) and a ``checksum`` of the manifest; 1 (still read,
with a warning from the reader) recorded hashes of the bytes alone and no checksum; 3 as 2, and
shard files may be encoded (compressed); 4 (written by the partitioned exchange) keeps the
tensor table in parts: ``manifest-g<generation>-part-<i>.json``, part i listing the tensors
whose name's ``owner_of`` is i, each bound to the manifest by its xxh3-128 in ``index``; a part
is read, checked against its hash and validated only when a tensor of it is asked for
(:class:`PartedTensors`), so a reader reads the parts it uses.  A format 4 manifest whose index
holds ``ranks`` (N) has a rank file per saving rank, ``manifest-g<generation>-rank-<r>.json``:
where the boxes rank r held are stored (the entries of its tensors cut down to the boxes that
meet its own), bound to the checkpoint by tag, generation and rank and to itself by a checksum,
so a rank that loads the layout it saved reads its own file, not the parts of its tensors
(:func:`parse_rank_file`; a rank file is an index of what the parts say, checked against them
by ``adacheck verify``).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Callable, Dict, Optional

from .boxes import check_tiling
from .errors import FormatError, IntegrityError
from .hashing import check_digest_format, hash_buffer, owner_of
from .jsontree import tensor_refs
from .types import KINDS, DTYPES, Box, Derivation, Manifest, StoredBox, TensorEntry

FORMAT = "adacheck"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2, 3, 4)
COMPRESSED_SINCE = 3   # format versions from here on may hold encoded (compressed) shard files
PARTED_SINCE = 4       # format versions from here on may keep the tensor table in parts (``index``)
PART_FORMAT = "adacheck-manifest-part"
RANK_FORMAT = "adacheck-manifest-rank"
PART_PATTERN = r"manifest-g\d+-(?:part|rank)-\d{5,}\.json"     # the names part_name and rank_file_name give
BOUND_SINCE = 2        # format versions from here on bind box hashes to their identity
CHECKSUM = "checksum"
MANIFEST_NAME = "manifest.json"
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")
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
        return {(None, f) for f in m.files} | {split_file(r) for r in m.index["referenced"]}
    return {split_file(b.file) for e in m.tensors.values() for b in e.boxes}


def part_name(generation: int, part: int) -> str:
    return f"manifest-g{generation}-part-{part:05d}.json"


def rank_file_name(generation: int, rank: int) -> str:
    return f"manifest-g{generation}-rank-{rank:05d}.json"


def part_names(m: Manifest):
    """The part files and rank files of a manifest in parts (none for one in one file)."""
    if m.index is None:
        return []
    g = m.index["generation"]
    return ([part_name(g, i) for i, h in enumerate(m.index["hashes"]) if h is not None]
            + [rank_file_name(g, r) for r in range(m.index.get("ranks", 0))])


def rank_file_bytes(tag: str, generation: int, rank: int, tensors: dict) -> bytes:
    """The text of rank ``rank``'s file of checkpoint ``tag`` (``tensors``: its held entries, as
    :func:`tensors_json` gives them), with the checksum of everything else in it."""
    d = {"format": RANK_FORMAT, "tag": tag, "generation": generation, "rank": rank, "tensors": tensors}
    d[CHECKSUM] = checksum(d)
    return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")


def part_bytes(tag: str, part: int, tensors: Dict[str, TensorEntry]) -> bytes:
    """The text of part ``part`` of checkpoint ``tag``'s tensor table (its hash goes in the index)."""
    return json.dumps({"format": PART_FORMAT, "tag": tag, "part": part, "tensors": tensors_json(tensors)},
                      separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")


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
        "framework": m.framework, "topology": m.topology, "files": m.files,
        "stats": m.stats, "objects": m.objects, "rank_objects": list(m.rank_objects),
        "layout": m.layout,
    }
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


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


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
                                            or not _FILE_RE.match(plain)
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


def _index(d: dict, where: str) -> dict:
    index = _need(d, "index", dict, where)
    generation = _need(index, "generation", int, where + ".index")
    parts = _need(index, "parts", int, where + ".index")
    hashes = _need(index, "hashes", list, where + ".index")
    count = _need(index, "tensors", int, where + ".index")
    referenced = _need(index, "referenced", list, where + ".index")
    ranks = _need(index, "ranks", int, where + ".index") if "ranks" in index else 0
    if generation < 0 or parts < 1 or len(hashes) != parts or count < 0 or ranks < 0:
        raise FormatError(f"{where}: index does not describe its parts (generation {generation}, "
                          f"{parts} parts, {len(hashes)} hashes, {count} tensors)")
    for h in hashes:
        if h is not None and not (isinstance(h, str) and check_digest_format(h)):
            raise FormatError(f"{where}: index hash {h!r} is not an xxh3_128 digest")
    for r in referenced:
        ref_tag, plain = split_file(r) if isinstance(r, str) else (None, None)
        if ref_tag is None or not TAG_RE.match(ref_tag) or not _FILE_RE.match(plain):
            raise FormatError(f"{where}: index.referenced holds {r!r}, not '<earlier tag>/<shard>.safetensors'")
    return index


class PartedTensors(Mapping):
    """The tensor table of a manifest in parts: a part is read (``open_part(name)`` -> bytes),
    checked against its hash in the index and validated the first time one of its tensors is
    asked for; iterating reads them all.  ``bytes_read``: the part bytes read so far."""

    def __init__(self, index: dict, files: dict, tag: str, version: int,
                 open_part: Optional[Callable[[str], bytes]], where: str):
        self.index, self.files, self.tag, self.version, self.where = index, files, tag, version, where
        self.open_part = open_part
        self.referenced = set(index["referenced"])
        self.loaded: Dict[int, Dict[str, TensorEntry]] = {}
        self.bytes_read = 0

    def part(self, i: int) -> Dict[str, TensorEntry]:
        if i in self.loaded:
            return self.loaded[i]
        digest = self.index["hashes"][i]
        if digest is None:
            self.loaded[i] = {}
            return self.loaded[i]
        name = part_name(self.index["generation"], i)
        if self.open_part is None:
            raise FormatError(f"{self.where}: the tensor table is in parts ({name}, ...), and nothing was "
                              "given to read them with (read the manifest with adacheck.commit.read_manifest)")
        try:
            data = self.open_part(name)
        except FileNotFoundError:
            raise FormatError(f"{self.where}: its part {name} is missing: the checkpoint is incomplete or "
                              "damaged") from None
        except OSError as e:
            raise FormatError(f"{self.where}: cannot read its part {name}: {e}") from e
        if hash_buffer(data) != digest:
            raise IntegrityError(f"{self.where}: its part {name} does not match the hash the manifest binds it "
                                 "by: it was edited or damaged after AdaCheck wrote it, so nothing it says can be "
                                 "trusted. Restore it from a copy, or load an older checkpoint (adacheck ls "
                                 "lists them)")
        self.bytes_read += len(data)
        where = f"{self.where} part {name}"
        try:
            d = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(d, dict) or d.get("format") != PART_FORMAT or d.get("tag") != self.tag or d.get("part") != i:
            raise FormatError(f"{where}: not part {i} of checkpoint {self.tag!r}")
        tensors = _tensors(_need(d, "tensors", dict, where), self.version, self.files, self.tag, where,
                           referenced=self.referenced)
        strays = [n for n in tensors if owner_of(n, self.index["parts"]) != i]
        if strays:
            raise FormatError(f"{where}: lists {strays[0]!r}, which belongs to another part")
        self.loaded[i] = tensors
        _check_sources(tensors, self.get)
        return tensors

    def __getitem__(self, name: str) -> TensorEntry:
        return self.part(owner_of(name, self.index["parts"]))[name]

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self.part(owner_of(name, self.index["parts"]))

    def __iter__(self):
        names = [n for i in range(self.index["parts"]) for n in self.part(i)]
        if len(names) != self.index["tensors"]:
            raise FormatError(f"{self.where}: its parts list {len(names)} tensors, its index {self.index['tensors']}")
        return iter(sorted(names))

    def __len__(self) -> int:
        return self.index["tensors"]


def parse_rank_file(data: bytes, m: Manifest, rank: int, where: str) -> Dict[str, TensorEntry]:
    """Rank ``rank``'s file of the manifest in parts ``m`` (its bytes ``data``), validated: the
    entries of the tensors that rank held, each cut down to the boxes that meet its own."""
    try:
        d = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: not valid JSON ({e})") from e
    if (not isinstance(d, dict) or d.get("format") != RANK_FORMAT or d.get("tag") != m.tag
            or d.get("rank") != rank or d.get("generation") != m.index["generation"]):
        raise FormatError(f"{where}: not rank {rank}'s file of checkpoint {m.tag!r} (generation "
                          f"{m.index['generation']})")
    if d.get(CHECKSUM) != checksum(d):
        raise IntegrityError(f"{where}: does not match its checksum: it was edited or damaged after AdaCheck "
                             "wrote it, so nothing it says can be trusted. Restore it from a copy, or load an "
                             "older checkpoint (adacheck ls lists them)")
    return _tensors(_need(d, "tensors", dict, where), m.format_version, m.files, m.tag, where,
                    referenced=set(m.index["referenced"]), whole=False)


def parse(text: str, where: str = "manifest.json", open_part: Optional[Callable[[str], bytes]] = None) -> Manifest:
    """The manifest ``text``, validated; ``open_part(name)``: the bytes of a part of a manifest in
    parts (format 4), read when a tensor of it is first asked for."""
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
    files = _need(d, "files", dict, where)
    for fname, info in files.items():
        if not _FILE_RE.match(fname):
            raise FormatError(f"{where}: shard file name {fname!r} is not a plain "
                              "'*.safetensors' name inside the checkpoint directory")
        _need(info, "nbytes", int, f"files[{fname}]")
        _need(info, "writer", int, f"files[{fname}]")
    index = None
    if version >= PARTED_SINCE and "index" in d:
        index = _index(d, where)
        tensors = PartedTensors(index, files, tag, version, open_part, where)
    else:
        tensors = _tensors(_need(d, "tensors", dict, where), version, files, tag, where)
        _check_sources(tensors, tensors.get)
    objects = d.get("objects", {})
    rank_objects = d.get("rank_objects", [])
    if not isinstance(rank_objects, list):
        raise FormatError(f"{where}: rank_objects must be a list")
    for ref in tensor_refs(objects) + ([] if index is not None else tensor_refs(rank_objects)):
        if not isinstance(ref, str) or ref not in tensors:
            raise FormatError(f"{where}: saved objects refer to tensor {ref!r} that is not stored")
    layout, stats = d.get("layout", {}), d.get("stats", {})
    if not isinstance(layout, dict) or not isinstance(stats, dict):
        raise FormatError(f"{where}: layout and stats must be JSON objects")
    return Manifest(format_version=version, tag=tag, step=step,
                    framework=_need(d, "framework", dict, where),
                    topology=_need(d, "topology", dict, where), tensors=tensors,
                    objects=objects, rank_objects=tuple(rank_objects),
                    layout=layout, files=files, stats=stats, index=index)
