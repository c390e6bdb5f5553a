"""DeepSpeed's CPU ops (shared-memory collectives, CPU Adam, fused Adam), compiled by torch's JIT
the first time a process loads them, ready before the first test starts its ranks.

Every load, also of an op built long ago, holds ``<build dir>/lock`` for a moment, and a process
killed while it holds it (a test's SIGKILL, a timeout, a session ended mid-compile) leaves the
file behind: every later load then waits for it forever, so every DeepSpeed rank of the rest of
the suite hangs in ``init_distributed`` until its test's timeout. :func:`remove_stale_locks`
removes lock files older than any compile takes; :func:`warm` (at the start of a session) does
that, then loads the ops once, in a process of its own, with a timeout.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder")
STALE_S = 600.0     # (a compile of one op takes ~40 s, a few minutes on a loaded 2-core machine)


def extensions_root() -> str:
    """Where torch's JIT builds extensions (as torch.utils.cpp_extension decides it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions")


def remove_stale_locks(older_than_s: float = STALE_S) -> list:
    """Remove the JIT build lock files not touched for ``older_than_s`` seconds; returns their paths."""
    gone, now = [], time.time()
    for lock in glob.glob(os.path.join(extensions_root(), "*", "*", "lock")):
        try:
            if now - os.path.getmtime(lock) > older_than_s:
                os.remove(lock)
                gone.append(lock)
        except OSError:
            pass
    return gone


# the ops, loaded (built first where they are not) in a process of its own, one line per op
LOAD_OPS = """
from deepspeed.accelerator import get_accelerator
for name in %r:
    try:
        b = get_accelerator().create_op_builder(name)
        if b is not None and b.is_compatible(verbose=False):
            b.load(verbose=False)
            print("built", name)
    except Exception as e:
        print("not built", name, type(e).__name__, e)
""" % (OPS,)


def load_ops(env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """Run :data:`LOAD_OPS` with ``env`` (raises subprocess.TimeoutExpired past ``timeout_s``)."""
    return subprocess.run([sys.executable, "-c", LOAD_OPS], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def warm(timeout_s: float = 900.0) -> str:
    """Stale locks removed, then DeepSpeed's CPU ops loaded (built if they were not) in a process
    of its own; returns what went wrong, or '' when they load."""
    gone = remove_stale_locks()
    try:
        p = load_ops(dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES=""), timeout_s)
    except subprocess.TimeoutExpired:
        return f"DeepSpeed's CPU ops did not load within {timeout_s:.0f}s (stale locks removed: {gone})"
    failed = [ln for ln in p.stdout.splitlines() if ln.startswith("not built")]
    if p.returncode != 0 or failed:
        return f"DeepSpeed's CPU ops did not load (exit {p.returncode}): {failed} {p.stderr[-2000:]}"
    return ""
