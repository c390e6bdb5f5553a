import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_sessionstart(session):
    """DeepSpeed's CPU ops built (torch's JIT) and loadable before the first test starts ranks
    (tests/jit_ops.py): once here, not by ranks racing for the build that a test may kill."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if session.config.getoption("markexpr", "").strip() == "unit":     # the fast layer starts no ranks
        return
    from jit_ops import warm
    problem = warm()
    if problem:
        sys.stderr.write(f"conftest: {problem}\n")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on a CUDA device (skipped without one); the other tests' "
                                       "processes see no GPU")


@pytest.fixture(autouse=True)
def _cpu_processes_see_no_gpu(request, monkeypatch):
    """The suite's processes train on the CPU with gloo (megatron-core through its CPU shim,
    which refuses to run where CUDA is available, and two ranks that would share one GPU under
    NCCL): on a machine with a GPU they are started without one, except for tests marked cuda."""
    if "cuda" not in request.keywords:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
