"""What AdaCheck finishes when the interpreter exits, however the training script ends.

Most training scripts end without ``engine.destroy()`` or ``destroy_process_group()``.  At
interpreter exit (``atexit``, which runs before Python starts tearing its threads down) AdaCheck

1. closes every open background writer (:func:`keep`): what was promised is committed (the
   last online delta step becomes recoverable) and the writer thread is joined, so no thread of
   AdaCheck's is inside torch when the interpreter finalizes;
2. releases the GIL for a moment (:data:`SETTLE_SECONDS`) when a gloo process group exists, or
   existed when AdaCheck was attached (a script that called ``destroy_process_group()`` has no
   group left, but DeepSpeed's engine still holds the groups, and their gloo threads run on).
   A gloo worker thread that finishes a collective may hold the last reference to a tensor
   that Python already let go of; freeing it needs the GIL.  Once finalization has begun,
   Python ends any thread that asks for the GIL with ``pthread_exit``, and the unwind through
   gloo's C++ frames aborts the process ("terminate called without an active exception",
   SIGABRT, seen with gdb in ``ProcessGroupGloo::runLoop``): torchrun then reports a job that
   finished its work as failed.  Native DeepSpeed has the same race (one abort in 12 runs of a
   load-and-step script here; 40 of 40 exited cleanly with this pause added at exit).  Gloo's threads cannot be joined from Python while the framework
   holds its groups (``destroy_process_group`` and the backend's ``shutdown``/``abort`` leave
   them running in torch 2.13), so AdaCheck lets a waiting worker finish its cleanup while the
   interpreter is still whole.  This is local: no collective runs at exit, so a rank that
   crashed never makes the others wait.

The hook is registered once per process, when an integration attaches AdaCheck to a job
(:func:`register`); errors inside it are logged, never raised.
"""
from __future__ import annotations

import atexit
import logging
import time
import weakref

log = logging.getLogger("adacheck")

_OPEN: "weakref.WeakSet" = weakref.WeakSet()   # objects with close(): flushed and joined at exit
_HELD: set = set()       # those of them that must outlive their callers' references (keep(strong=True))
_STATE = {"registered": False, "distributed": False}


def register() -> None:
    """Run :func:`at_exit` when the interpreter exits (once per process); notes whether the job
    runs with process groups (:func:`settles`)."""
    if not _STATE["registered"]:
        atexit.register(at_exit)
        _STATE["registered"] = True
    _STATE["distributed"] = _STATE["distributed"] or _initialized()


def keep(obj, strong: bool = False) -> None:
    """Close ``obj`` (its ``close()``) at exit unless it was :func:`release`-d before; ``strong``:
    hold it until then, also when nothing else does (what it must still do at exit is a promise)."""
    register()
    _OPEN.add(obj)
    if strong:
        _HELD.add(obj)


def release(obj) -> None:
    _OPEN.discard(obj)
    _HELD.discard(obj)


def finish_saves(block: bool = True) -> None:
    """Every job's asynchronous save in flight: completed and reported (``block``), or reported
    if it has finished (a cheap poll)."""
    for obj in list(_OPEN):
        fn = getattr(obj, "finish" if block else "poll", None)
        if fn is not None:
            fn()


SETTLE_SECONDS = 0.1


def at_exit() -> None:
    # lower exit_order first: an online delta log is complete before a memory tier copies it
    for obj in sorted(_OPEN, key=lambda o: getattr(o, "exit_order", 1)):
        try:
            obj.close()
        except Exception as e:  # noqa: BLE001 - the interpreter is exiting: report, do not raise
            log.warning("AdaCheck: at exit, closing %s failed: %s", type(obj).__name__, e)
        release(obj)
    settle_gloo()


def _initialized() -> bool:
    try:
        import torch.distributed as dist
        return bool(dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001 - no torch.distributed: no groups
        return False


def settles() -> bool:
    """Whether :func:`at_exit` pauses for gloo's threads: process groups are there, or were when
    AdaCheck was attached.  After ``destroy_process_group()`` torch says none is initialized, but
    the groups DeepSpeed's engine holds keep their gloo threads, so their race at exit is still
    there."""
    return _STATE["distributed"] or _initialized()


def settle_gloo() -> None:
    """Release the GIL for SETTLE_SECONDS if process groups are (or were) there (see above): the
    default one may be gloo, and AdaCheck's own groups are (also under an NCCL default group)."""
    if settles():
        time.sleep(SETTLE_SECONDS)
