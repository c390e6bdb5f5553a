"""At exit, AdaCheck pauses for gloo's worker threads (adacheck.lifecycle) also when the script
called ``destroy_process_group()``: the groups DeepSpeed's engine holds keep their threads, whose
race with interpreter finalization aborts the exit (SIGABRT) now and then.

Oracle: the process's own thread list (/proc/self/task) and torch.distributed's
``is_initialized()``, before and after ``destroy_process_group()``.
"""
import json
import os
import subprocess
import sys

from launch import ROOT, free_port

SCRIPT = r"""
import json, os, sys
import torch, deepspeed, torch.distributed as dist
import adacheck_ds  # noqa: F401  (the "adacheck" block of the config)
from adacheck import lifecycle

def threads():
    return len(os.listdir("/proc/self/task"))

deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(16, 16)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "adacheck": {"enabled": True}})
loss = engine(torch.randn(1, 16)).sum()
engine.backward(loss)
engine.step()
engine.save_checkpoint(sys.argv[1])
before = threads()
dist.destroy_process_group()
print(json.dumps({"before": before, "after": threads(), "initialized": dist.is_initialized(),
                  "settles": lifecycle.settles()}), flush=True)
"""


def test_the_exit_pause_survives_destroy_process_group(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env, capture_output=True,
                       text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # the situation the pause is for: no group initialized, the engine's gloo threads still running
    assert got["initialized"] is False
    assert got["after"] == got["before"] > 1, got
    assert got["settles"] is True, got
