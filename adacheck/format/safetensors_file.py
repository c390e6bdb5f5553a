"""Strict safetensors reading: every byte from disk is treated as hostile.

The header is validated completely before any tensor is read (sizes, dtypes, offsets
contiguous and inside the file); a tensor read is one ``readinto`` into its final buffer.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Dict, Optional

import torch

from ..errors import FormatError
from ..storage.backends import LOCAL, Storage
from ..types import DTYPES, SAFETENSORS_CODE_TO_NAME

MAX_HEADER = 256 << 20


class SafetensorsFile:
    """A validated safetensors file; ``read(key)`` returns a fresh CPU tensor."""

    def __init__(self, path: str, store: Storage = LOCAL):
        self.path, self.store = path, store
        self._map = None            # the file mapped (view()); False: the storage cannot map it
        store.forget(path)      # blocks a storage kept from an earlier read may be of an older file
        try:
            self.size = store.size(path)
            head = store.read_bytes(path, 8)
            if len(head) < 8:
                raise FormatError(f"{path}: file is {self.size} bytes, too short for a "
                                  "safetensors header (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > self.size:
                raise FormatError(f"{path}: header claims {n} bytes but the file has "
                                  f"{self.size} (truncated or not a safetensors file)")
            raw = bytearray(n)
            if store.read_into(path, 8, raw) != n:
                raise FormatError(f"{path}: the header ended early (the file changed while it was read?)")
        except OSError as e:
            raise FormatError(f"{path}: cannot read shard file: {e}") from e
        try:
            header = json.loads(bytes(raw).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path}: header is not valid JSON ({e}); the file is corrupt") from e
        if not isinstance(header, dict):
            raise FormatError(f"{path}: header is not a JSON object")
        self.data_start = 8 + n
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise FormatError(f"{path}: __metadata__ must map strings to strings")
        self.metadata: Dict[str, str] = meta
        self.entries: Dict[str, tuple] = {}
        spans = []
        for key, info in header.items():
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise FormatError(f"{path}: entry {key!r} is malformed: {info!r}")
            code, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
            if code not in SAFETENSORS_CODE_TO_NAME:
                raise FormatError(f"{path}: entry {key!r} has unsupported dtype {code!r}")
            if (not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                        and s >= 0 for s in shape)):
                raise FormatError(f"{path}: entry {key!r} has a bad shape {shape!r}")
            if (not isinstance(offs, list) or len(offs) != 2
                    or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
                raise FormatError(f"{path}: entry {key!r} has bad data_offsets {offs!r}")
            dname = SAFETENSORS_CODE_TO_NAME[code]
            nbytes = math.prod(shape) * DTYPES[dname][2]
            if offs[1] - offs[0] != nbytes or offs[0] < 0:
                raise FormatError(f"{path}: entry {key!r} spans {offs} but shape {shape} of "
                                  f"{dname} needs {nbytes} bytes")
            self.entries[key] = (dname, tuple(shape), offs[0], offs[1])
            spans.append((offs[0], offs[1], key))
        spans.sort()
        pos = 0
        for a, b, key in spans:
            if a != pos:
                raise FormatError(f"{path}: entry {key!r} starts at {a}, expected {pos} "
                                  "(overlapping or gapped data)")
            pos = b
        if self.data_start + pos != self.size:
            raise FormatError(f"{path}: header describes {self.data_start + pos} bytes but the "
                              f"file has {self.size} (truncated or padded file)")

    def view(self, key: str) -> Optional[torch.Tensor]:
        """The tensor ``key`` as a view of the file mapped into memory (its bytes read as they are
        touched, not copied into a buffer first), or None where the storage cannot map the file."""
        if key not in self.entries:
            raise FormatError(f"{self.path}: no tensor {key!r} in this shard file")
        if self._map is None:
            self._map = self.store.map(self.path) or False
        dname, shape, a, b = self.entries[key]
        if self._map is False:
            return None
        if len(self._map) != self.size:
            raise FormatError(f"{self.path}: the file has {len(self._map)} bytes now, {self.size} when its "
                              "header was read (it changed while it was loaded)")
        if b == a:
            return torch.empty(shape, dtype=DTYPES[dname][0])
        return torch.frombuffer(self._map, dtype=torch.uint8, count=b - a,
                                offset=self.data_start + a).view(DTYPES[dname][0]).view(shape)

    def read(self, key: str, out: torch.Tensor = None) -> torch.Tensor:
        """The tensor ``key``: into ``out`` (contiguous, same dtype and shape) or a new tensor."""
        if key not in self.entries:
            raise FormatError(f"{self.path}: no tensor {key!r} in this shard file")
        dname, shape, a, b = self.entries[key]
        if out is None:
            out = torch.empty(shape, dtype=DTYPES[dname][0])
        elif (out.dtype != DTYPES[dname][0] or tuple(out.shape) != shape or not out.is_contiguous()
              or out.device.type != "cpu"):
            raise ValueError(f"{self.path}: cannot read {key!r} ({dname}{list(shape)}) into a "
                             f"{out.dtype}{list(out.shape)} tensor")
        if b > a:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            try:
                got = self.store.read_into(self.path, self.data_start + a, view)
            except OSError as e:
                raise FormatError(f"{self.path}: cannot read {key!r}: {e}") from e
            if got != b - a:
                raise FormatError(f"{self.path}: {key!r} ended after {got} of {b - a} bytes")
        return out
