"""Manifest (de)serialisation.  Parsing validates every field before anything uses it.

Guarantees of a parsed Manifest: file names are plain names inside the checkpoint
directory, or ``<tag>/<name>`` inside an earlier checkpoint of the same save directory; every tensor has a known dtype and kind; every stored box fits its shape and
the distinct boxes tile the tensor exactly; derivations point at a stored tensor of
the same shape; hashes are well-formed; object trees refer only to stored tensors.
"""
from __future__ import annotations

import json
import re

from .boxes import check_tiling
from .errors import FormatError
from .hashing import check_digest_format
from .jsontree import tensor_refs
from .types import KINDS, DTYPES, Box, Derivation, Manifest, StoredBox, TensorEntry

FORMAT = "adacheck"
FORMAT_VERSION = 1
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


def dumps(m: Manifest) -> str:
    return json.dumps(to_json(m), sort_keys=True, indent=1, allow_nan=False) + "\n"


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
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{where}: not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise FormatError(f"{where}: not an AdaCheck manifest (field 'format' != {FORMAT!r})")
    version = _need(d, "format_version", int, where)
    if version != FORMAT_VERSION:
        raise FormatError(f"{where}: format_version {version} is not supported by this AdaCheck "
                          f"(supports {FORMAT_VERSION}); upgrade AdaCheck to read it")
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
            entry = TensorEntry(name, kind, dtype, shape,
                                derived=Derivation(_need(dv, "source", str, w + ".derived"),
                                                   _need(dv, "op", str, w + ".derived")))
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
                boxes.append(StoredBox(box, fname, _need(b, "key", str, wb), digest,
                                       tuple(int(h) for h in holders)))
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
        if ref not in tensors:
            raise FormatError(f"{where}: saved objects refer to tensor {ref!r} that is not stored")
    return Manifest(format_version=version, tag=tag, step=step,
                    framework=_need(d, "framework", dict, where),
                    topology=_need(d, "topology", dict, where), tensors=tensors,
                    objects=objects, rank_objects=tuple(rank_objects),
                    layout=d.get("layout", {}), files=files, stats=d.get("stats", {}))
