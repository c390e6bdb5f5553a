"""Start N real processes of ``tests/ds_worker.py`` with a gloo rendezvous, never hanging.

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT like torchrun; the
whole group is killed when ``timeout`` passes or when one rank dies and the others do not
follow within ``grace`` seconds.  The ranks of CPU jobs of the workers tests/prestarted.py names
(DeepSpeed, megatron-core, Hugging Face Trainer and Accelerate, the synthetic 8- and 32-rank
layouts) are forked from four servers that have imported torch and the framework once;
ADACHECK_TEST_FRESH_RANKS=1 starts every rank as a fresh interpreter.
"""
from __future__ import annotations

import atexit
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from jit_ops import remove_stale_locks  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ prestarted ranks
# one server per (worker script, rank index mod PRESTARTED_RANKS), started on first use, ended at exit
_SERVERS: dict = {}
PRESTARTED_RANKS = 4


class _Server:
    def __init__(self, script: str, rank: int):
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        self.errors = open(os.path.join(_server_dir(), f"{script}-{rank}.log"), "w")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "prestarted.py"), script], env=env, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, text=True)
        self.lock = threading.Lock()
        self._ready = None

    READY_S = 300

    def ready(self) -> bool:
        """Whether it has imported its modules and serves (waits for that the first time, up to
        READY_S: a server stuck importing is killed, and jobs start fresh interpreters instead)."""
        if self._ready is None:
            readable = select.select([self.proc.stdout], [], [], self.READY_S)[0]
            if not readable:
                self.proc.kill()
            line = self.proc.stdout.readline() if readable else ""
            self._ready = json.loads(line or "{}").get("ready") is not None
        return self._ready and self.proc.poll() is None

    def ask(self, **req):
        with self.lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            with open(self.errors.name) as f:
                raise RuntimeError(f"the prestarted rank server {self.proc.args[-1]} died:\n{f.read()[-3000:]}")
        return json.loads(line)

    def start(self, argv, env, cwd, log):
        return _Forked(self, self.ask(op="run", script=argv[0], args=argv[1:], env=env, cwd=cwd, log=log)["pid"])


class _Forked:
    """What launch() uses of a Popen, for a rank forked by a server."""

    def __init__(self, server: _Server, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.ask(op="poll", pid=self.pid)["returncode"]
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _server_dir() -> str:
    import tempfile
    path = os.path.join(tempfile.gettempdir(), f"adacheck-prestarted-{os.getpid()}")
    if not os.path.isdir(path):
        os.makedirs(path)
        atexit.register(_stop_servers, path)
    return path


def _stop_servers(path: str) -> None:
    import shutil
    for server in _SERVERS.values():
        server.proc.stdin.close()          # (a server ends when its stdin closes)
    for server in _SERVERS.values():
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
    shutil.rmtree(path, ignore_errors=True)


def _server(script: str, rank: int):
    from prestarted import PRELOAD
    if script not in PRELOAD or os.environ.get("ADACHECK_TEST_FRESH_RANKS") == "1":
        return None
    rank %= PRESTARTED_RANKS
    if (script, rank) not in _SERVERS:
        _SERVERS[script, rank] = _Server(script, rank)
    return _SERVERS[script, rank]


def launch(world: int, spec: dict, out_dir: str, timeout: float = 420, grace: float = 60,
           on_started=None, script: str = "ds_worker.py", device: str = "cpu", rank_env=None):
    """Run the worker on ``world`` ranks; returns [(returncode, output)] per rank.  ``device``
    "cuda": DeepSpeed's CUDA accelerator, NCCL, one GPU per rank (ds_worker.py).  ``rank_env(r)``:
    more environment for rank r (e.g. a simulated node: $ADACHECK_NODE, $ADACHECK_MEMORY_DIR)."""
    os.makedirs(out_dir, exist_ok=True)
    remove_stale_locks()       # (a rank killed while loading a DeepSpeed op would hang every later one)
    spec_path = os.path.join(out_dir, f"spec-{time.monotonic_ns()}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    port = free_port()
    procs, logs = [], []
    servers = [_server(script, rank) if device == "cpu" else None for rank in range(world)]   # (all starting)
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DS_ACCELERATOR=device, ADACHECK_TEST_DEVICE=device, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep +
                   os.environ.get("PYTHONPATH", ""))
        # every job of a test is one job restarted (the lease of a save directory passes to it, as to a
        # restarted job's), unless the test names the job (tests/test_lease.py: jobs that compete)
        env.setdefault("ADACHECK_JOB", "adacheck-tests")
        env.update(rank_env(rank) if rank_env is not None else {})
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w+")
        argv = [os.path.join(HERE, script), spec_path, out_dir]
        server = servers[rank] if servers[rank] is not None and servers[rank].ready() else None
        procs.append(server.start(argv, env, ROOT, log.name) if server is not None else
                     subprocess.Popen([sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        logs.append(log)
    if on_started is not None:
        on_started(procs)
    deadline = time.monotonic() + timeout
    first_exit = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_exit is None and any(p.poll() is not None for p in procs):
            first_exit = now
        if now > deadline or (first_exit is not None and now - first_exit > grace):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    out = []
    for p, log in zip(procs, logs):
        p.wait()
        log.seek(0)
        out.append((p.returncode, log.read()))
        log.close()
    return out


def kill_at_marker(marker: str, victim: int = 1, jitter: float = 0.3, wait: float = 400):
    """An ``on_started`` for launch(): SIGKILL rank ``victim`` within ``jitter`` seconds after the
    file ``marker`` appears (or after ``wait`` seconds)."""
    def killer(procs):
        deadline = time.monotonic() + wait
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(random.random() * jitter)
        procs[victim].send_signal(signal.SIGKILL)

    return lambda procs: threading.Thread(target=killer, args=(procs,), daemon=True).start()


def kill_when_written(pattern: str, after: str, victim: int = 1, wait: float = 400):
    """An ``on_started`` for launch() and what it saw: once the file ``after`` exists, SIGKILL rank
    ``victim`` the moment a file matching the glob ``pattern`` appears (say a shard file under its
    temporary name: the kill then lands inside the write phase).  ``seen["path"]`` is that file."""
    import glob
    seen = {}

    def killer(procs):
        deadline = time.monotonic() + wait
        while not os.path.exists(after) and time.monotonic() < deadline:
            time.sleep(0.05)
        while time.monotonic() < deadline:
            found = glob.glob(pattern)
            if found:
                procs[victim].send_signal(signal.SIGKILL)
                seen["path"] = found[0]
                return
            time.sleep(0.001)

    return (lambda procs: threading.Thread(target=killer, args=(procs,), daemon=True).start()), seen


def check(results):
    for rank, (rc, text) in enumerate(results):
        if rc != 0:
            raise AssertionError(f"rank {rank} exited with {rc}:\n{text[-6000:]}")
    return results
