"""Host copies of a rank's state for an asynchronous save: taken at the save call, read by the
background persist while training changes the originals.

One buffer per box this rank saves, kept from one save to the next and reused, so an async job
holds one host copy of its state however many saves it makes; a box that is no longer saved
frees its buffer.  Device tensors are copied into pinned host memory without blocking, and one
CUDA event recorded after the copies tells the background reader when they have landed (never
a whole-device synchronisation)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch


class Staging:
    def __init__(self):
        self.buffers: Dict[tuple, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, shards: list) -> Tuple[list, Optional[Callable[[], None]]]:
        """``shards`` (LocalShard) with their tensors replaced by host copies, and a function that
        waits until those copies are complete (None: they already are)."""
        kept: Dict[tuple, torch.Tensor] = {}
        out: List = []
        on_device = False
        for s in shards:
            t = s.tensor.detach()
            key = (s.name, s.box, t.dtype)
            buf = self.buffers.get(key)
            if buf is None or tuple(buf.shape) != tuple(t.shape):
                buf = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=t.is_cuda)
            if t.is_cuda:
                buf.copy_(t, non_blocking=True)
                on_device = True
            else:
                buf.copy_(t)
            kept[key] = buf
            out.append(dataclasses.replace(s, tensor=buf))
        self.buffers = kept
        if not on_device:
            return out, None
        event = torch.cuda.Event()
        event.record()          # after every copy above, on the stream they were issued on
        return out, event.synchronize
