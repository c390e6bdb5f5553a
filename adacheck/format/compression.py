"""Opt-in lossless compression of stored boxes (``"compression": "zstd"``), for storage where
bandwidth is the limit.

A box is stored as its *byte planes*: for a dtype of k bytes, all first bytes of its elements,
then all second bytes, and so on (the exponent bytes of floating-point values, which repeat
a lot, end up next to each other), compressed with zstandard.  In a shard file the box is a
``U8`` tensor of the compressed bytes, and the file's ``__metadata__`` names the encoding
(:data:`ENCODING_KEY`); the manifest still records the box's dtype, shape and the hash of its
*uncompressed* bytes, so deduplication and references are the same as without compression, and
a load verifies what it decoded.  Checkpoints that use it are format 3 (older AdaCheck versions
refuse them by their format version instead of misreading them).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..errors import ConfigError, IntegrityError

ENCODING_KEY = "adacheck_encoding"
ZSTD_PLANES = "zstd-byteplanes-1"
CHOICES = (None, "zstd")
LEVEL = 3       # zstandard's default: fast to write, most of the ratio of the higher levels


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise ConfigError("compression \"zstd\" needs the zstandard package: pip install zstandard "
                          "(or adacheck[zstd])") from None
    return zstandard


def check(compression: Optional[str]) -> Optional[str]:
    """The encoding for a config's ``compression`` (None: none); ConfigError if it is unknown or
    its package is missing."""
    if compression not in CHOICES:
        raise ConfigError(f"adacheck.format.compression must be null or \"zstd\", got {compression!r}")
    if compression is None:
        return None
    _zstd()
    return ZSTD_PLANES


def planes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous CPU tensor ``t`` as byte planes (1-D uint8)."""
    flat = t.reshape(-1).view(torch.uint8)
    k = t.element_size()
    return flat if k == 1 else flat.view(-1, k).t().contiguous().reshape(-1)


def unplanes(data: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    k = torch.empty((), dtype=dtype).element_size()
    rows = data if k == 1 else data.view(k, -1).t().contiguous().reshape(-1)
    return rows.view(dtype).reshape(shape)


class Encoder:
    """Compresses boxes for one writer (a zstandard context is not shared between threads)."""

    def __init__(self, encoding: str):
        if encoding != ZSTD_PLANES:
            raise ConfigError(f"unknown encoding {encoding!r}")
        self.encoding = encoding
        self.context = _zstd().ZstdCompressor(level=LEVEL)

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        data = self.context.compress(memoryview(planes(t.detach().contiguous()).numpy()))
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def encode_all(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {k: self.encode(t) for k, t in tensors.items()}


def decode(encoding: str, data: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...], where: str) -> torch.Tensor:
    """The box stored as ``data`` (uint8, 1-D) in ``encoding``; IntegrityError if it does not
    decode to exactly the bytes of ``shape`` x ``dtype``."""
    if encoding != ZSTD_PLANES:
        raise IntegrityError(f"{where}: unknown encoding {encoding!r} (written by a newer AdaCheck?)")
    nbytes = torch.empty((), dtype=dtype).element_size()
    for n in shape:
        nbytes *= n
    try:
        raw = _zstd().ZstdDecompressor().decompress(memoryview(data.numpy()), max_output_size=nbytes)
    except Exception as e:  # noqa: BLE001 - any failure to decode is damage
        raise IntegrityError(f"{where}: the compressed box does not decode ({type(e).__name__}: {e}); "
                             "the file is corrupt") from None
    if len(raw) != nbytes:
        raise IntegrityError(f"{where}: the compressed box decodes to {len(raw)} bytes, {nbytes} expected; "
                             "the file is corrupt")
    return unplanes(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dtype, tuple(shape))
