"""Rank processes for tests/launch.py, forked from an interpreter that has already imported what
the worker script needs (torch, DeepSpeed or megatron-core, AdaCheck).

Each rank of a test job is otherwise a fresh ``python tests/<worker>.py``, and on the 2-core CI
machine about half of a rank's CPU time went into importing torch, torch._dynamo (which torch's
optimizers import on first use) and the framework, again for every rank of every launch.  Here
one server per (worker script, rank index) imports those once; each rank is then an ``os.fork()``
of it that runs the script as ``__main__`` with the rank's own environment, working directory,
arguments and log file, and ends the way a fresh interpreter ends (atexit, non-daemon threads,
the exit code or the signal that killed it).

Rank r of every job comes from server r mod 4, a process of its own, so ranks 0-3 of one job
still differ in everything a fresh process would: their hash seeds (set iteration order), Python's
``random`` (reseeded after a fork anyway), their pids (a larger job's ranks r and r + 4 share a
hash seed).  Only CPU jobs use it (a CUDA context must
not be forked), and only the workers named in ``PRELOAD``.

Protocol (one JSON line each way, over the server's stdin / stdout):
  {"op": "run", "script", "args", "env", "cwd", "log"}  ->  {"pid": PID}
  {"op": "poll", "pid"}                                 ->  {"returncode": None | int (-N: signal N)}
A returncode is answered once (the rank is reaped then); the asker keeps it.
The server ends when its stdin closes; the ranks it started are not its to stop (launch.py
kills them on its deadline, by pid).
"""
import importlib
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = {
    "ds_worker.py": ["torch", "torch._dynamo", "deepspeed", "safetensors.torch", "adacheck_ds"],
    "pipe_worker.py": ["torch", "torch._dynamo", "deepspeed", "deepspeed.pipe", "safetensors.torch", "adacheck_ds"],
    "moe_worker.py": ["torch", "torch._dynamo", "deepspeed", "deepspeed.moe.layer", "safetensors.torch", "adacheck_ds"],
    "megatron_worker.py": ["torch", "torch._dynamo", "pretrain_gpt"],      # (scripts/pretrain_gpt.py)
    "hf_worker.py": ["torch", "torch._dynamo", "deepspeed", "transformers.trainer",
                     "transformers.models.gpt2.modeling_gpt2", "adacheck_ds"],
    "accelerate_worker.py": ["torch", "torch._dynamo", "deepspeed", "accelerate", "adacheck_ds"],
    "partition_worker.py": ["torch", "adacheck.checkpoint", "adacheck_megatron.state"],    # (8 ranks)
    "auto_worker.py": ["torch", "adacheck.checkpoint"],                                    # (32 ranks)
}
# what a fresh interpreter has on its path besides the script's folder and $PYTHONPATH
_SITE = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def serve(script):
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)     # (nothing a library prints here reaches the pipe)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    for name in PRELOAD[script]:
        importlib.import_module(name)
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "run":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                reply.close()
                return req
            answer = {"pid": pid}
        else:
            # answered once, never remembered: a reaped rank's pid is free for the next fork (the
            # kernel reuses pids within a long suite, pid_max 32768 on CI), and a remembered code
            # would be read back as the new rank's, which launch() would then take for ended
            got, status = os.waitpid(req["pid"], os.WNOHANG)
            answer = {"returncode": os.waitstatus_to_exitcode(status) if got == req["pid"] else None}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    sys.exit(0)


def run(req):
    """In the forked rank: become ``python SCRIPT ARGS`` run with ENV in CWD, output to LOG."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)      # (the request pipe is the server's)
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[:] = [os.path.dirname(os.path.abspath(req["script"]))] + [
        p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p] + _SITE
    sys.argv = [req["script"], *req["args"]]
    runpy.run_path(req["script"], run_name="__main__")


if __name__ == "__main__":
    run(serve(sys.argv[1]))
