"""Streaming safetensors writer (the bytes of a file; the O_DIRECT path that writes the same
bytes is :mod:`adacheck.storage.direct`).

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
from ..types import DTYPES, dtype_name


def header_bytes(items: List[Tuple[str, torch.Tensor]], metadata: Dict[str, str], data_align: int = 8) -> bytes:
    """The JSON header, padded with spaces (as the format allows) so that the tensor data
    starts at a multiple of ``data_align`` bytes into the file."""
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
    raw += b" " * (-(8 + len(raw)) % data_align)
    return raw


def write_safetensors_to(out, specs: List[Tuple[str, torch.dtype, tuple]], produce: Callable[[str], torch.Tensor],
                         metadata: Dict[str, str] | None = None, data_align: int = 8) -> int:
    """Write a safetensors file into ``out`` (anything with ``write(bytes)``: a file, a storage's
    FileWriter) with tensors made one at a time: ``specs`` gives each key's dtype and shape (for
    the header), ``produce(key)`` the tensor when its bytes are due.  Peak memory is one tensor.
    Keys are written sorted; returns the number of bytes written."""
    specs = sorted(specs, key=lambda s: s[0])
    header = header_bytes([(k, torch.empty(shape, dtype=dt, device="meta")) for k, dt, shape in specs],
                     metadata or {}, data_align)
    size = 8 + len(header)
    out.write(struct.pack("<Q", len(header)))
    out.write(header)
    for key, dt, shape in specs:
        t = produce(key)
        if t.dtype != dt or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{key}: produced {t.dtype}{list(t.shape)}, header says {dt}{list(shape)}")
        buf = tensor_bytes(t.detach().to("cpu").contiguous())
        out.write(buf)
        size += len(buf)
        del t, buf   # before the next produce(): one tensor at a time
    return size


def write_safetensors_streaming(path: str, specs: List[Tuple[str, torch.dtype, tuple]],
                                produce: Callable[[str], torch.Tensor],
                                metadata: Dict[str, str] | None = None, fsync: bool = True,
                                data_align: int = 8) -> int:
    """:func:`write_safetensors_to` a local file at ``path`` (written in place), fsynced."""
    with open(path, "wb") as f:
        size = write_safetensors_to(f, specs, produce, metadata, data_align)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return size


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor],
                      metadata: Dict[str, str] | None = None, fsync: bool = True, data_align: int = 8) -> int:
    """Write ``tensors`` (CPU, contiguous) to ``path``; return the file size in bytes."""
    check_cpu(tensors)
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    return write_safetensors_streaming(path, specs, tensors.__getitem__, metadata, fsync, data_align)


def check_cpu(tensors: Dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{key}: write_safetensors needs contiguous CPU tensors")


BLOCK = 4096           # O_DIRECT: file offsets, lengths and memory addresses in multiples of this
_ALIGN_DATA_FROM = 1 << 20   # files with at least this many tensor bytes start their data on a block


def data_alignment(tensors: Dict[str, torch.Tensor]) -> int:
    """Where :class:`~adacheck.storage.direct.DirectFileWriter` starts the tensor data: on a block boundary (the header
    padded with up to 4 KiB of spaces) when the tensors hold at least 1 MiB, so that tensor
    memory can go to the device directly; a multiple of 8 otherwise.  A function of the
    tensors alone, so the same tensors give the same bytes on every filesystem."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    return BLOCK if data >= _ALIGN_DATA_FROM else 8
