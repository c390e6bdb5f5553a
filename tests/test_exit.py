"""A training script that ends without engine.destroy() / destroy_process_group() (most do):
every torchrun job exits 0, an online job's last step is committed at exit, and so is an
asynchronous save still in flight when the script ends.

Oracle: the losses of an uninterrupted native DeepSpeed run of the same script (the model has
dropout, so they match only if the RNG state is restored too).
"""
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT, free_port

pytestmark = pytest.mark.timeout(1200)

SCRIPT = os.path.join(ROOT, "tests", "user_train.py")


def torchrun(mode, ckpt, until, losses):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), SCRIPT, "--mode", mode, "--ckpt", ckpt, "--until", str(until), "--losses", losses]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, DS_ACCELERATOR="cpu")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)


def _is_writer(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"adacheck.checkpoint.writer_main" in f.read()
    except OSError:
        return False


def read_losses(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jobs_that_end_without_destroy_exit_cleanly_and_keep_their_last_step(tmp_path):
    """6 online-recovery jobs (each: load = base + replay of every committed delta, one more
    step recorded, exit), 2 plain ones (load, one step, save, exit) and 3 async ones (the same, the
    save still in flight when the script ends: the exit hook commits it, and stops the writer
    processes: none is left), then 2 with the persist in a thread, all under torchrun:
    every job exits 0 (before the fix, 4 of 6 online-recovery jobs of this kind aborted with
    SIGABRT: 5 recoveries here all pass by chance with odds under 1%), each online job recovers
    exactly the step the previous one ended at (its last delta was committed at exit, not left as
    rank<r>.json.tmp), and every logged loss equals the uninterrupted native run's."""
    total = 3 + 6
    ref_log = str(tmp_path / "native.jsonl")
    torchrun("native", str(tmp_path / "native"), total, ref_log)   # (its exit code is DeepSpeed's own)
    reference = {r["step"]: r["loss"] for r in read_losses(ref_log)}
    assert sorted(reference) == list(range(1, total + 1))

    online, log = str(tmp_path / "online"), str(tmp_path / "online.jsonl")
    runs = [("online", online, 3)] + [("online", online, 3 + i) for i in range(1, 6)]
    plain, plain_log = str(tmp_path / "plain"), str(tmp_path / "plain.jsonl")
    runs += [("plain", plain, 8)] + [("plain", plain, 9)]
    # the last save of each async job is committed by the exit hook; the next job resumes from it
    asy, async_log = str(tmp_path / "async"), str(tmp_path / "async.jsonl")
    runs += [("async", asy, 2)] + [("async", asy, 2 + i) for i in range(1, 3)]
    # (in writer processes, the default: the exit hook stops them too) ... and in threads
    runs += [("async_thread", asy, 4 + i) for i in range(1, 3)]
    for i, (mode, ckpt, until) in enumerate(runs):
        p = torchrun(mode, ckpt, until, {"online": log, "plain": plain_log, "async": async_log,
                                         "async_thread": async_log}[mode])
        assert p.returncode == 0, f"job {i} ({mode}) exited with {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        if mode != "online":
            # the script configures no logging, and DeepSpeed's log_level "info": the save's line is
            # in DeepSpeed's log, once (rank 0), for an async save too, which the exit hook commits
            said = f"AdaCheck: saved global_step{until} (step {until}) to {ckpt}/global_step{until}: "
            assert (p.stdout + p.stderr).count(said) == 1, (said, p.stdout[-2000:], p.stderr[-2000:])
        if mode == "online" and i > 0:
            # the step the previous job ended at was committed when it exited, and recovered now
            assert f"(steps 2-{until - 1})" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    got = read_losses(log)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert {r["step"]: r["loss"] for r in got} == {s: reference[s] for s in range(1, 9)}
    got = read_losses(plain_log)
    assert [r["step"] for r in got] == list(range(1, 10))
    assert {r["step"]: r["loss"] for r in got} == {s: reference[s] for s in range(1, 10)}
    got = read_losses(async_log)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert {r["step"]: r["loss"] for r in got} == {s: reference[s] for s in range(1, 7)}
    assert open(os.path.join(asy, "latest")).read().strip() == "global_step6"
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_writer(p)], "a writer process outlived its job"
    step8 = os.path.join(online, "global_step1", "deltas", "0000000008")
    assert sorted(os.listdir(step8)) == ["rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors"]
