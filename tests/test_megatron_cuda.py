"""scripts/pretrain_gpt.py on a GPU (megatron-core on CUDA, NCCL, no CPU shim): a job that
stops at iteration 2 and a new job that resumes from its AdaCheck checkpoint log the same losses
as one uninterrupted job, with synchronous and with asynchronous saves (``--async-save``).

The oracle is the uninterrupted run's own losses.  Skipped without CUDA (CI has none)."""
import os
import subprocess
import sys

import pytest
import torch

from launch import ROOT, free_port
from test_megatron import SCRIPT, losses

pytestmark = [pytest.mark.timeout(900), pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def run(argv, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_port()), os.path.join(ROOT, "scripts", "pretrain_gpt.py")] + argv
    env = dict(os.environ, OMP_NUM_THREADS="1", CUBLAS_WORKSPACE_CONFIG=":4096:8",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    err = p.stderr[p.stderr.find("Traceback"):][:5000] if "Traceback" in p.stderr else p.stderr[-3000:]
    assert p.returncode == 0, p.stdout[-2000:] + err
    return p.stdout


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_pretrain_script_resumes_exactly_on_the_gpu(tmp_path, mode):
    argv = SCRIPT[2:] + ["--adacheck"] + mode      # (one rank: no tensor parallelism)
    whole = run(argv + ["--adacheck-dir", str(tmp_path / "a"), "--save-interval", "2"], str(tmp_path))
    first = run(argv + ["--adacheck-dir", str(tmp_path / "b"), "--save-interval", "2", "--exit-interval", "2"],
                str(tmp_path))
    second = run(argv + ["--adacheck-dir", str(tmp_path / "b")], str(tmp_path))
    assert "exiting at iteration 2" in first
    assert "loaded AdaCheck checkpoint iteration 2" in second
    assert len(losses(whole)) == 4
    assert losses(first) + losses(second) == losses(whole)
    with open(tmp_path / "a" / "latest") as f:
        assert f.read().strip() == "iter_0000004"
