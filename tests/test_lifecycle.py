"""At exit, AdaCheck pauses for gloo's worker threads (adacheck.checkpoint.lifecycle) also when the script
called ``destroy_process_group()``: the groups DeepSpeed's engine holds keep their threads, whose
race with interpreter finalization aborts the exit (SIGABRT) now and then.

Oracle: the process's own thread list (/proc/self/task) and torch.distributed's
``is_initialized()``, before and after ``destroy_process_group()`` (lifecycle_worker.py).
"""
import json

from launch import launch


def test_the_exit_pause_survives_destroy_process_group(tmp_path):
    [(code, output)] = launch(1, {}, str(tmp_path), script="lifecycle_worker.py", timeout=240)
    assert code == 0, output[-3000:]
    got = json.loads([line for line in output.splitlines() if line.startswith('{"before"')][-1])
    # the situation the pause is for: no group initialized, the engine's gloo threads still running
    assert got["initialized"] is False
    assert got["after"] == got["before"] > 1, got
    assert got["settles"] is True, got
