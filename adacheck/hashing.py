"""The one place that hashes tensor bytes: xxh3-128, streamed in chunks.

The digest is written as ``"xxh3_128:<32 hex digits>"`` so that the algorithm can change
without ambiguity.
"""
from __future__ import annotations

import torch
import xxhash

ALGORITHM = "xxh3_128"
_CHUNK = 64 << 20  # bytes handed to the hasher at once


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without copying."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def hash_buffer(buf) -> str:
    h = xxhash.xxh3_128()
    view = memoryview(buf).cast("B")
    for i in range(0, len(view), _CHUNK):
        h.update(view[i:i + _CHUNK])
    return f"{ALGORITHM}:{h.hexdigest()}"


def hash_tensor(t: torch.Tensor) -> str:
    """Hash of the tensor's row-major bytes (copied to a contiguous CPU tensor if needed)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().to("cpu").contiguous()
    return hash_buffer(tensor_bytes(t.detach()))


def check_digest_format(digest) -> bool:
    if not isinstance(digest, str) or not digest.startswith(ALGORITHM + ":"):
        return False
    hexpart = digest[len(ALGORITHM) + 1:]
    return len(hexpart) == 32 and all(c in "0123456789abcdef" for c in hexpart)
