"""Manifest (de)serialisation.  Parsing validates every field before anything uses it.

Guarantees of a parsed Manifest: the text matches its own checksum (format 2: any edit
that changes what it says is an IntegrityError); file names are plain names inside the
checkpoint directory, or ``<tag>/<name>`` inside an earlier checkpoint of the same save
directory; every tensor has a known dtype and kind; every stored box fits its shape and
the distinct boxes tile the tensor exactly; derivations point at a stored tensor of
the same shape; hashes are well-formed; object trees refer only to stored tensors.

Format versions: 2 (written now) records each box's hash over its identity and bytes
(:func:`adacheck.hashing.bound_digest`) and a ``checksum`` of the manifest; 1 (still read,
with a warning from the reader) recorded hashes of the bytes alone and no checksum.
"""
from __future__ import annotations

import json
import re

from .boxes import check_tiling
from .errors import FormatError, IntegrityError
from .hashing import check_digest_format, hash_buffer
from .jsontree import tensor_refs
from .types import KINDS, DTYPES, Box, Derivation, Manifest, StoredBox, TensorEntry

FORMAT = "adacheck"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2, 3)
COMPRESSED_SINCE = 3   # format versions from here on may hold encoded (compressed) shard files
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
    """{(tag, file)} this checkpoint needs, with tag None for its own directory."""
    return {split_file(b.file) for e in m.tensors.values() for b in e.boxes}


def to_json(m: Manifest) -> dict:
    tensors = {}
    for name in sorted(m.tensors):
        e = m.tensors[name]
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
        tensors[name] = d
    return {
        "format": FORMAT, "format_version": m.format_version, "tag": m.tag, "step": m.step,
        "framework": m.framework, "topology": m.topology, "files": m.files,
        "stats": m.stats, "objects": m.objects, "rank_objects": list(m.rank_objects),
        "layout": m.layout, "tensors": tensors,
    }


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


def parse(text: str, where: str = "manifest.json") -> Manifest:
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
    raw_tensors = _need(d, "tensors", dict, where)
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
                check_tiling(name, shape, [b for b, _ in dboxes])
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
                                            or not _FILE_RE.match(plain)):
                    raise FormatError(f"manifest: {wb} refers to {fname!r}, which is not "
                                      "'<earlier tag>/<shard>.safetensors' in the save directory")
                digest = _need(b, "hash", str, wb)
                if not check_digest_format(digest):
                    raise FormatError(f"manifest: {wb}.hash {digest!r} is not an xxh3_128 digest")
                holders = _need(b, "holders", list, wb)
                if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in holders):
                    raise FormatError(f"manifest: {wb}.holders {holders!r} is not a list of ranks")
                boxes.append(StoredBox(box, fname, _need(b, "key", str, wb), digest, tuple(holders)))
            check_tiling(name, shape, [b.box for b in boxes])
            entry = TensorEntry(name, kind, dtype, shape, boxes=tuple(boxes))
        tensors[name] = entry
    for name, e in tensors.items():
        if e.derived is not None:
            src = tensors.get(e.derived.source)
            if src is None or src.derived is not None or src.shape != e.shape:
                raise FormatError(f"manifest: {name} is derived from {e.derived.source!r}, which is "
                                  "missing, itself derived, or of another shape")
    objects = d.get("objects", {})
    rank_objects = d.get("rank_objects", [])
    if not isinstance(rank_objects, list):
        raise FormatError(f"{where}: rank_objects must be a list")
    for ref in tensor_refs(objects) + tensor_refs(rank_objects):
        if not isinstance(ref, str) or ref not in tensors:
            raise FormatError(f"{where}: saved objects refer to tensor {ref!r} that is not stored")
    layout, stats = d.get("layout", {}), d.get("stats", {})
    if not isinstance(layout, dict) or not isinstance(stats, dict):
        raise FormatError(f"{where}: layout and stats must be JSON objects")
    return Manifest(format_version=version, tag=tag, step=step,
                    framework=_need(d, "framework", dict, where),
                    topology=_need(d, "topology", dict, where), tensors=tensors,
                    objects=objects, rank_objects=tuple(rank_objects),
                    layout=layout, files=files, stats=stats)
