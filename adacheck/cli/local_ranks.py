"""Run the ranks of a job on this machine: ``python -m MODULE ARGV`` as ``world`` processes
with torch.distributed's environment (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT, ...), for the
conversions that need a framework's engines on as many ranks as a checkpoint was saved by; and
the end of such a rank (``exit_rank``)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional

from ..errors import StateError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PHASE = "adacheck-progress:"


def phase(done: int, total: int, what: str = "") -> None:
    """In a rank's process (rank 0's counts): ``done`` of ``total`` phases of its work are done;
    :func:`run` passes it on to its ``progress``."""
    print(f"{PHASE} {done}/{total} {what}", flush=True)


def _phases(text: str):
    for line in text.splitlines():
        if line.startswith(PHASE):
            try:
                done, total = line[len(PHASE):].split()[0].split("/")
                yield int(done), int(total)
            except ValueError:
                continue


def run(module: str, world: int, argv: List[str], env: Optional[Dict[str, str]] = None,
        grace: float = 60.0, what: str = "conversion",
        progress: Optional[Callable[[int, int], None]] = None) -> None:
    """Run ``python -m module argv`` on ``world`` local ranks and wait for all of them.  When a
    rank fails, the others get ``grace`` seconds (they may be waiting on it) before they are
    killed; the error names the rank that failed first and its last error line, and keeps every
    rank's log.  ``env``: added to this process's environment.  ``progress(done, total)``: called
    with each :func:`phase` rank 0 reports, as it reports it, and with the last one again while
    none is new (``(0, None)`` while the ranks start, before rank 0 reports one)."""
    port = free_port()
    logs_dir = tempfile.mkdtemp(prefix=f"adacheck-{what}-logs-")
    base = dict(os.environ, **(env or {}))
    procs, logs = [], []
    for r in range(world):
        rank_env = dict(base, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(os.path.join(logs_dir, f"rank{r}.log"), "w+")
        procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=rank_env,
                                      stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    first_exit, first_failed = None, None
    seen = 0        # bytes of rank 0's log read for its phases
    last = (0, None)    # the phase reported last; None: the ranks are starting (no total yet)

    def report():
        nonlocal seen, last
        if progress is None:
            return
        with open(os.path.join(logs_dir, "rank0.log"), "rb") as f:
            f.seek(seen)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]     # whole lines only
        seen += len(complete)
        phases = list(_phases(complete.decode("utf-8", errors="replace")))
        for last in phases:
            progress(*last)
        if not phases:
            progress(*last)     # again: a bar that shows the time passing while a phase runs

    while any(p.poll() is None for p in procs):
        report()
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed and first_exit is None:
            first_exit, first_failed = time.monotonic(), failed[0]
        if first_exit is not None and time.monotonic() - first_exit > grace:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    report()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    tails = {}
    for r, log in enumerate(logs):
        log.seek(0)
        tails[r] = log.read()
        log.close()
    if bad:
        # the rank that failed first names the cause; the others lost their peer
        r, rc = next(((r, rc) for r, rc in bad if r == first_failed), bad[0])
        lines = [ln for ln in tails[r].splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        raise StateError(f"{what} rank {r} failed (exit {rc}): "
                         f"{(errors or lines or ['no output'])[-1].strip()} (all logs: {logs_dir})")
    shutil.rmtree(logs_dir, ignore_errors=True)


def exit_rank(work: Callable[[], None]) -> None:
    """Run one rank's ``work`` (a process that :func:`run` or torchrun started) and end the
    process: exit status 0, or 1 after printing the error.  It leaves without running interpreter
    teardown: DeepSpeed's and gloo's C++ threads can abort the process there ("terminate called
    without an active exception") after the work succeeded, which would read as a failed rank."""
    code = 0
    try:
        work()
    except BaseException:  # noqa: BLE001 - reported, then the rank exits non-zero
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
