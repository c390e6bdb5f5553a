"""Host copies of a rank's state for an asynchronous save: taken at the save call, read by the
background persist while training changes the originals.

All of a save's boxes are copied into one host buffer (the *arena*), each at an offset aligned
to 64 bytes.  The arena is kept from one save to the next and reused while the boxes keep their
names, shapes and dtypes, so an async job holds one host copy of its state however many saves
it makes; when they change a new arena replaces the old one.  Device tensors are copied into
pinned host memory without blocking, and one CUDA event recorded after the copies tells the
background reader when they have landed (never a whole-device synchronisation).

``shared=True`` (the writer process, :mod:`adacheck.checkpoint.writer_process`) puts the arena in an
anonymous shared-memory file (``memfd``): the writer process maps the same pages through a file
descriptor passed over its socket, so nothing is copied twice and nothing is left in ``/dev/shm``
when either process dies.  On CUDA the shared pages are pinned with ``cudaHostRegister``."""
from __future__ import annotations

import dataclasses
import mmap
import os
from typing import Callable, List, Optional, Tuple

import torch

ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one box's copy lies in the arena."""
    offset: int
    dtype: torch.dtype
    shape: tuple


def view(arena: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor stored at ``slot`` of ``arena`` (a flat uint8 tensor)."""
    n = torch.Size(slot.shape).numel() * torch.empty((), dtype=slot.dtype).element_size()
    return arena[slot.offset:slot.offset + n].view(slot.dtype).view(slot.shape)


def map_shared(fd: int, nbytes: int) -> Tuple[torch.Tensor, mmap.mmap]:
    """A flat uint8 tensor over the shared-memory file ``fd`` (and the mapping, kept by the caller
    for as long as the tensor is used)."""
    mm = mmap.mmap(fd, max(nbytes, 1))
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8), mm


class Staging:
    def __init__(self, shared: bool = False):
        self.shared = shared
        self.arena: Optional[torch.Tensor] = None
        self.layout: Optional[tuple] = None       # ((name, box), shape, dtype) per box, in order
        self.slots: List[Slot] = []
        self.fd: Optional[int] = None             # shared: the arena's memfd
        self.generation = 0                       # +1 for every new arena
        self._mmap: Optional[mmap.mmap] = None
        self._registered = False

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def _allocate(self, nbytes: int, pin: bool) -> None:
        self.release()
        if self.shared:
            self.fd = os.memfd_create("adacheck-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, max(nbytes, 1))
            self.arena, self._mmap = map_shared(self.fd, nbytes)
            if pin and nbytes:
                rc = torch.cuda.cudart().cudaHostRegister(self.arena.data_ptr(), nbytes, 0)
                if int(rc) != 0:
                    raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of shared staging memory failed ({rc})")
                self._registered = True
        else:
            self.arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.generation += 1

    def release(self) -> None:
        """Free the arena (and close its shared file; a writer process that mapped it keeps its own
        mapping until it drops it)."""
        if self._registered and self.arena is not None:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
            self._registered = False
        self.arena, self.layout, self.slots = None, None, []
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:     # a tensor over it is still alive: freed with it
                pass
            self._mmap = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def stage(self, shards: list) -> Tuple[list, Optional[Callable[[], None]]]:
        """``shards`` (LocalShard) with their tensors replaced by host copies in the arena, and a
        function that waits until those copies are complete (None: they already are)."""
        tensors = [s.tensor.detach() for s in shards]
        layout = tuple(((s.name, s.box), tuple(t.shape), t.dtype) for s, t in zip(shards, tensors))
        on_device = any(t.is_cuda for t in tensors)
        if layout != self.layout:
            slots, end = [], 0
            for t in tensors:
                slots.append(Slot(end, t.dtype, tuple(t.shape)))
                end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            self._allocate(end, pin=on_device)
            self.layout, self.slots = layout, slots
        out: List = []
        for s, t, slot in zip(shards, tensors, self.slots):
            buf = view(self.arena, slot)
            buf.copy_(t, non_blocking=t.is_cuda)
            out.append(dataclasses.replace(s, tensor=buf))
        if not on_device:
            return out, None
        event = torch.cuda.Event(blocking=True)     # the reader sleeps while it waits, it does not spin
        event.record()          # after every copy above, on the stream they were issued on
        return out, event.synchronize
