"""The only module that calls torch.distributed.

``Comm`` is the small interface the rest of AdaCheck uses; ``agree`` turns a local
step into a collective one: every rank runs it, the outcomes are gathered, and if any
rank failed every rank raises the same DistributedError naming each cause.  A rank
that fails therefore never leaves the others waiting in a later collective.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, List, Optional

from .errors import AdaCheckError, DistributedError


class Comm:
    rank: int = 0
    world_size: int = 1

    def all_gather_object(self, obj: Any) -> List[Any]:
        raise NotImplementedError

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.all_gather_object(obj)[src]

    def barrier(self) -> None:
        self.all_gather_object(None)


class SoloComm(Comm):
    """A world of one process (no process group needed)."""

    def all_gather_object(self, obj):
        return [obj]


class TorchComm(Comm):
    """torch.distributed over ``group`` (default: the world)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self):
        self._dist.barrier(group=self.group)


def default_comm() -> Comm:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return TorchComm()
    except ImportError:  # pragma: no cover
        pass
    return SoloComm()


def _describe(e: BaseException) -> str:
    if isinstance(e, AdaCheckError):
        return str(e)
    text = f"{type(e).__name__}: {e}"
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        last = tb[-1]
        text += f" (at {last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
    return text


def agree(comm: Comm, what: str, fn: Callable[[], Any],
          on_failure: Optional[Callable[[], None]] = None) -> Any:
    """Run ``fn`` on every rank; return its result where all succeeded, else raise everywhere.

    ``on_failure`` runs on every rank (also the healthy ones) before the error is raised,
    e.g. to remove temporary files.
    """
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - gathered and re-raised below
        error = _describe(e)
        local_exc = e
    outcomes = comm.all_gather_object(error)
    failures = {r: msg for r, msg in enumerate(outcomes) if msg is not None}
    if failures:
        if on_failure is not None:
            try:
                on_failure()
            except Exception:  # noqa: BLE001 - cleanup must not mask the real cause
                pass
        err = DistributedError(what, failures)
        if error is not None:
            raise err from local_exc
        raise err
    return result
