"""Frozen, self-validating value types of the data model.

A *logical tensor* is a piece of training state with a layout-independent name
(``master/layers.0.weight``).  A rank holds *boxes* of it: an offset and a length per
dimension of the global shape.  Everything else (deduplication, resharding,
conversion) is arithmetic on boxes.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import torch

from .errors import FormatError

# name in the manifest -> (torch dtype, safetensors code, itemsize)
DTYPES = {
    "float64": (torch.float64, "F64", 8),
    "float32": (torch.float32, "F32", 4),
    "float16": (torch.float16, "F16", 2),
    "bfloat16": (torch.bfloat16, "BF16", 2),
    "int64": (torch.int64, "I64", 8),
    "int32": (torch.int32, "I32", 4),
    "int16": (torch.int16, "I16", 2),
    "int8": (torch.int8, "I8", 1),
    "uint8": (torch.uint8, "U8", 1),
    "bool": (torch.bool, "BOOL", 1),
}
_BY_TORCH = {v[0]: k for k, v in DTYPES.items()}
SAFETENSORS_CODE_TO_NAME = {v[1]: k for k, v in DTYPES.items()}

class Kind(str, Enum):
    """What a logical tensor is: reported per kind, and the rules of derivation depend on it.
    A ``str`` too, so that it compares with and is written as its value ("model", ...)."""
    MODEL = "model"      # a model weight as the framework runs it (may be derived from a master)
    MASTER = "master"    # an optimizer's fp32 master weight
    OPTIM = "optim"      # an optimizer state tensor (``exp_avg``, ...)
    BUFFER = "buffer"    # a module buffer
    OBJECT = "object"    # a tensor inside a saved object tree
    RNG = "rng"          # a random number generator's state

    def __str__(self) -> str:
        return self.value


KINDS = tuple(k.value for k in Kind)


def dtype_name(dt: torch.dtype) -> str:
    try:
        return _BY_TORCH[dt]
    except KeyError:
        raise FormatError(f"unsupported tensor dtype {dt}; supported: {sorted(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name][0]
    except KeyError:
        raise FormatError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def itemsize(name: str) -> int:
    return DTYPES[name][2]


def _int_tuple(values, what: str) -> tuple:
    if not isinstance(values, (tuple, list)):
        raise FormatError(f"{what} must be a list of integers, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FormatError(f"{what} must hold non-negative integers, got {values!r}")
        out.append(v)
    return tuple(out)


@functools.lru_cache(maxsize=1 << 20)
def _box_key(offsets: tuple, lengths: tuple) -> str:
    # a job saves the same boxes at every checkpoint: their keys are made once
    if not lengths:
        return "scalar"
    return "_".join(f"{o}+{n}" for o, n in zip(offsets, lengths))


@dataclass(frozen=True, order=True)
class Box:
    """A hyper-rectangle of a tensor: ``offsets[d] <= i[d] < offsets[d] + lengths[d]``."""

    offsets: tuple
    lengths: tuple

    def __post_init__(self):
        object.__setattr__(self, "offsets", _int_tuple(self.offsets, "box offsets"))
        object.__setattr__(self, "lengths", _int_tuple(self.lengths, "box lengths"))
        if len(self.offsets) != len(self.lengths):
            raise FormatError(f"box offsets {self.offsets} and lengths {self.lengths} differ in rank")

    @staticmethod
    def full(shape) -> "Box":
        shape = tuple(shape)
        return Box((0,) * len(shape), shape)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    def fits(self, shape) -> bool:
        return len(shape) == self.ndim and all(
            o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape))

    def slices(self, origin: Optional["Box"] = None) -> tuple:
        """Index of this box inside a tensor that holds ``origin`` (default: the whole)."""
        base = origin.offsets if origin is not None else (0,) * self.ndim
        return tuple(slice(o - b, o - b + n) for o, n, b in zip(self.offsets, self.lengths, base))

    def intersect(self, other: "Box") -> Optional["Box"]:
        offs, lens = [], []
        for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            offs.append(lo)
            lens.append(hi - lo)
        return Box(tuple(offs), tuple(lens))

    def shifted(self, by) -> "Box":
        """This box moved by the offsets ``by``: a box of a sub-box ``Box(by, ...)`` of a tensor
        (say one rank's slice) as a box of the whole tensor."""
        return Box(tuple(o + b for o, b in zip(self.offsets, by)), self.lengths)

    def key(self) -> str:
        """Stable text form, used in shard-file keys."""
        return _box_key(self.offsets, self.lengths)


@dataclass(frozen=True)
class Derivation:
    """This tensor equals ``source`` cast to its own dtype, proven at save time.  ``boxes``
    (format 2): the boxes its holders held, each with the digest of its derived bytes bound to
    this tensor's identity, so a load verifies what it derives like what it reads."""

    source: str
    op: str = "cast"
    boxes: tuple = ()          # (Box, digest), ...

    def __post_init__(self):
        if self.op != "cast":
            raise FormatError(f"unknown derivation op {self.op!r}; supported: 'cast'")


@dataclass(frozen=True)
class ShardMeta:
    """What one rank holds of one logical tensor (metadata only; exchanged between ranks)."""

    name: str
    kind: str
    dtype: str
    shape: tuple
    box: Box
    hash: str
    derive: Optional[str] = None     # name of the tensor this one may be a cast of
    derive_ok: bool = False          # this rank proved the cast on the part it can see
    replicated: bool = True          # declared: other holders of the same box hold the same bytes

    def __post_init__(self):
        object.__setattr__(self, "shape", _int_tuple(self.shape, f"shape of {self.name}"))
        if self.kind not in KINDS:
            raise FormatError(f"{self.name}: unknown kind {self.kind!r}; expected one of {KINDS}")
        if self.dtype not in DTYPES:
            raise FormatError(f"{self.name}: unknown dtype {self.dtype!r}")
        if not self.box.fits(self.shape):
            raise FormatError(f"{self.name}: box {self.box} outside shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dtype)


STRUCT_FIELDS = ("name", "kind", "dtype", "shape", "derive", "derive_ok", "replicated")   # all but the hash


def meta_row(m: ShardMeta) -> list:
    """A shard's structure (everything but its hash) as a JSON-able row; see ``meta_of_row``."""
    return [getattr(m, f) for f in STRUCT_FIELDS] + [list(m.box.offsets), list(m.box.lengths)]


def meta_of_row(row: list, digest: str) -> ShardMeta:
    return ShardMeta(**dict(zip(STRUCT_FIELDS, row[:-2])), hash=digest, box=Box(tuple(row[-2]), tuple(row[-1])))


@dataclass(frozen=True)
class StoredBox:
    """One stored copy of a box: where its bytes are and what they hash to."""

    box: Box
    file: str
    key: str
    hash: str
    holders: tuple = ()   # ranks that held these exact bytes when saved


@dataclass(frozen=True)
class TensorEntry:
    name: str
    kind: str
    dtype: str
    shape: tuple
    boxes: tuple = ()                       # tuple[StoredBox]
    derived: Optional[Derivation] = None    # set: no boxes, rebuild from the source

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class Manifest:
    format_version: int
    tag: str
    step: Optional[int]
    framework: dict
    topology: dict
    tensors: dict                      # name -> TensorEntry
    objects: dict                      # JSON tree (global framework state)
    rank_objects: tuple                # per saving rank: JSON tree
    layout: dict                       # framework description of what each rank held
    files: dict = field(default_factory=dict)   # file -> {"nbytes": int, "writer": rank}
    stats: dict = field(default_factory=dict)
    index: Optional[dict] = None       # in parts (formats 4, 5): {"generation", "parts", "tensors", "ranks", ...}
    ranks: Optional[object] = field(default=None, compare=False, repr=False)   # in parts: manifest_read.RankFiles
