"""Streaming safetensors writer.

Writes the standard safetensors layout (u64 little-endian header length, JSON header
padded with spaces to 8 bytes, then the tensor bytes back to back) without building the
whole file in memory, and fsyncs it.  Output is deterministic: keys sorted, compact JSON.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Dict, List, Tuple

import torch

from .hashing import tensor_bytes
from .types import DTYPES, dtype_name


def _header(items: List[Tuple[str, torch.Tensor]], metadata: Dict[str, str]) -> bytes:
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, t in items:
        name = dtype_name(t.dtype)
        nbytes = t.numel() * DTYPES[name][2]
        header[key] = {"dtype": DTYPES[name][1], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw


def write_safetensors_streaming(path: str, specs: List[Tuple[str, torch.dtype, tuple]],
                                produce: Callable[[str], torch.Tensor],
                                metadata: Dict[str, str] | None = None, fsync: bool = True) -> int:
    """Write a safetensors file whose tensors are made one at a time: ``specs`` gives each
    key's dtype and shape (for the header), ``produce(key)`` the tensor when its bytes are due.
    Peak memory is one tensor.  Keys are written sorted; returns the file size."""
    specs = sorted(specs, key=lambda s: s[0])
    header = _header([(k, torch.empty(shape, dtype=dt, device="meta")) for k, dt, shape in specs],
                     metadata or {})
    size = 8 + len(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for key, dt, shape in specs:
            t = produce(key)
            if t.dtype != dt or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: produced {t.dtype}{list(t.shape)}, header says {dt}{list(shape)}")
            buf = tensor_bytes(t.detach().to("cpu").contiguous())
            f.write(buf)
            size += len(buf)
            del t, buf   # before the next produce(): one tensor at a time
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return size


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor],
                      metadata: Dict[str, str] | None = None, fsync: bool = True) -> int:
    """Write ``tensors`` (CPU, contiguous) to ``path``; return the file size in bytes."""
    for key, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{key}: write_safetensors needs contiguous CPU tensors")
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    return write_safetensors_streaming(path, specs, tensors.__getitem__, metadata, fsync)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
