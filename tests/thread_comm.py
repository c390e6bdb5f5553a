"""A job of N ranks inside one process: each rank a thread, their collectives through shared
memory (:class:`ThreadComm`, an :class:`adacheck.plan.exchange.Comm`), so that every collective
path of a save and a load (the ring and partitioned exchanges, the plan, the commit, an error
agreed on every rank) runs in a unit test without starting processes.

    results = run_ranks(4, lambda comm: save(comm, d, "s1", collect_for(comm.rank)))

Every object a rank receives went through pickle, as over a process group, so no rank shares
a mutable object with another.  A collective that some rank never reaches breaks the barrier
after ``timeout_s`` on every rank (no hang); so does a rank that raises: :func:`run_ranks`
aborts the barrier for the others and raises the first error."""
from __future__ import annotations

import pickle
import threading
from typing import Any, Callable, List, Optional

import numpy as np
import torch

from adacheck.plan.exchange import GATHERS, Comm


class World:
    """What the ranks of one in-process job share: a barrier and one slot per rank."""

    def __init__(self, size: int, timeout_s: float = 60.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: List[Any] = [None] * size

    def gather(self, rank: int, value: Any) -> List[Any]:
        """Every rank's ``value`` (pickled), in rank order, on every rank."""
        self.slots[rank] = pickle.dumps(value)
        self.barrier.wait()
        out = [pickle.loads(s) for s in self.slots]
        self.barrier.wait()            # nobody overwrites a slot before every rank has read them all
        return out


class ThreadComm(Comm):
    """Rank ``rank`` of the in-process job ``world``."""

    def __init__(self, world: World, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.size
        self.collectives = 0            # how many collectives this rank ran (for tests that count them)

    def _gather(self, value):
        self.collectives += 1
        return self.world.gather(self.rank, value)

    def all_gather_object(self, obj):
        return self._gather(obj)

    def all_gather_bytes(self, data: bytes, how: str = "ring"):
        if how not in GATHERS:
            raise ValueError(f"unknown exchange {how!r}; expected one of {GATHERS}")
        return [bytes(b) for b in self._gather(bytes(data))]

    def all_to_all_bytes(self, blocks):
        sent = self._gather([bytes(b or b"") for b in blocks])
        return [sent[src][self.rank] for src in range(self.world_size)]

    def any(self, flag: bool) -> bool:
        return any(self._gather(bool(flag)))

    def max_each(self, values):
        return [max(col) for col in zip(*self._gather([int(v) for v in values]))]

    def sum_each(self, values):
        return [sum(col) for col in zip(*self._gather([int(v) for v in values]))]

    def barrier(self) -> None:
        self._gather(None)

    def _exchange_blocks(self, sends, recv_from, into=None) -> list:
        posted = self._gather([(to, None if data is None else bytes(memoryview(_as_bytes(data))))
                               for to, data in sends])
        queues = {src: [d for to, d in posted[src] if to == self.rank] for src in set(recv_from)}
        out = []
        for k, src in enumerate(recv_from):
            data = queues[src].pop(0)
            if data is None:
                out.append(None)
                continue
            buf = into(k, len(data)) if into is not None else torch.empty(len(data), dtype=torch.uint8)
            if len(data):
                buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            out.append(buf.numpy())
        return out


def _as_bytes(data):
    if isinstance(data, torch.Tensor):
        return data.contiguous().view(torch.uint8).numpy().tobytes()
    if isinstance(data, np.ndarray):
        return data.tobytes()
    return bytes(data)


def run_ranks(size: int, fn: Callable[[ThreadComm], Any], timeout_s: float = 60.0) -> List[Any]:
    """``fn(comm)`` on ``size`` ranks, each in a thread of this process; every rank's result in
    rank order.  A rank that raises breaks the others' next collective; the first error (by rank)
    is raised here, with the others' in its notes."""
    world = World(size, timeout_s)
    results: List[Any] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    def one(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(world, rank))
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors[rank] = e
            world.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,), name=f"rank{r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
        if t.is_alive():
            world.barrier.abort()
            raise TimeoutError(f"{t.name} of the in-process job still runs after {timeout_s * 4:.0f} s")
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        others = [f"rank {r}: {type(e).__name__}: {e}" for r, e in enumerate(errors) if e is not None and e is not first]
        if others and hasattr(first, "add_note"):      # (Python 3.11+)
            first.add_note("\n".join(others))
        raise first
    return results
