"""Python's automatic garbage collection paused while AdaCheck works in the training loop.

A checkpoint call (a save, the snapshot of an asynchronous one, a load) and a save's planning
make tens of thousands of objects (a manifest's boxes and entries, every rank's list of shards).
The cyclic collector would walk every live object of the process (a training job has hundreds of
thousands) each time their number crosses its thresholds, for nothing: they are freed by
reference counting, or kept.  Worse, collections in the middle of a call promote the call's
short-lived objects to the oldest generation, and every few calls that triggers a full
collection of the whole process: 0.08-0.18 s with DeepSpeed loaded, on one rank while the others
wait for it in the next collective.  Paused, they are never promoted.

One pause for the whole process, however many threads and nested calls enter it: collection
resumes when the last one leaves, and only if it was on when the first one entered (a script that
turned it off keeps it off)."""
from __future__ import annotations

import contextlib
import functools
import gc
import threading

_LOCK = threading.Lock()
_STATE = {"inside": 0, "was_enabled": False}


@contextlib.contextmanager
def paused():
    """Automatic collection paused for the body (see the module's docstring)."""
    with _LOCK:
        if _STATE["inside"] == 0:
            _STATE["was_enabled"] = gc.isenabled()
            gc.disable()
        _STATE["inside"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["inside"] -= 1
            if _STATE["inside"] == 0 and _STATE["was_enabled"]:
                gc.enable()


def pausing(fn):
    """``fn`` runs inside :func:`paused`: for calls that return to the training loop, never for
    work that runs behind it for long (garbage with cycles would wait until it ends)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with paused():
            return fn(*args, **kwargs)
    return wrapper
