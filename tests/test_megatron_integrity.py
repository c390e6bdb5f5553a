"""Real megatron-core on CPU (gloo, 2 processes) under faults: a full disk (a real ENOSPC from a
small tmpfs), a SIGKILL inside the write phase, and a resume with dropout that is exact only
when every RNG state (host generators and megatron-core's model-parallel tracker) comes back.

Oracles: each rank's own dump of its weights, main weights and optimizer state (megatron-core's
objects read directly, not through AdaCheck), and the losses of an uninterrupted run."""
import glob
import os
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from launch import check, kill_when_written, launch
from test_megatron import results

pytestmark = pytest.mark.timeout(900)

TP2 = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4"]


def same_dump(a, b):
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def disk_usage(path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) -> a directory on a tmpfs of that many bytes (root only: CI runs as root)."""
    mounted = []

    def mount(size: int) -> str:
        d = str(tmp_path / "tmpfs")
        os.makedirs(d, exist_ok=True)
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (not root, or no mount permission): {p.stderr.strip()}")
        mounted.append(d)
        return d
    if os.geteuid() != 0:
        pytest.skip("a real ENOSPC needs a small tmpfs, which only root can mount")
    yield mount
    for d in mounted:
        subprocess.run(["umount", d], capture_output=True)


def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_previous(tmp_path, small_tmpfs):
    """The checkpoint directory is a tmpfs that holds one checkpoint but not two: the second save
    fails on both ranks with the disk's own error (ENOSPC), 'latest' still names the first right
    after the failure, no file of the failed save stays behind, training goes on, and the first
    checkpoint loads exactly (each rank's dump of its own weights and optimizer state)."""
    probe = str(tmp_path / "probe")
    check(launch(2, {"runs": [{"argv": TP2, "actions": [["train", 1], ["save", probe]]}]}, str(tmp_path / "p"),
                 script="megatron_worker.py"))
    size = disk_usage(probe)
    full = small_tmpfs(int(size * 1.5) // 4096 * 4096)
    d = str(tmp_path / "run")
    check(launch(2, {"runs": [{"argv": TP2, "actions": [
        ["train", 1], ["save", full], ["dump", "first"], ["train", 1],
        ["expect_error", "No space left on device", ["save", full]], ["latest", full], ["train", 1],
        ["scramble"], ["load", full], ["dump", "reloaded"]]}]}, d, script="megatron_worker.py"))
    for r in (0, 1):
        res = results(d, r)[0]
        assert len(res["errors"]) == 1 and "Errno 28" in res["errors"][0], res["errors"]
        assert res["latest"] == ["iter_0000001"] and res["loaded"] == [1]
        same_dump(f"{d}/first-rank{r}.safetensors", f"{d}/reloaded-rank{r}.safetensors")
    assert results(d, 0)[0]["errors"] == results(d, 1)[0]["errors"]
    assert all(not f.endswith(".tmp") for f in os.listdir(os.path.join(full, "iter_0000001")))
    assert not glob.glob(os.path.join(full, "iter_0000002", "*")), os.listdir(full)   # (at most an empty directory)


def test_sigkill_inside_the_write_phase_keeps_the_previous_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed the moment one of its shard files appears under its temporary name (the
    test shows the kill landed inside the write phase: the temporary file is still there), while
    the job saves the same iteration again and again; the save never commits, and a new job
    loads exactly what 'latest' names (each rank's dump taken after that state was saved)."""
    ck = str(tmp_path / "ck")
    big = TP2 + ["--hidden-size", "256", "--num-attention-heads", "8", "--num-layers", "4"]
    runs = [{"argv": big, "actions": [["train", 1], ["save", ck], ["dump", "one"], ["train", 1], ["dump", "two"],
                                      ["marker", "saving"]] + [["save", ck]] * 30}]
    started, seen = kill_when_written(os.path.join(ck, "iter_*", "rank00001-*.safetensors.tmp"),
                                      str(tmp_path / "k" / "saving-rank1"))
    res = launch(2, {"runs": runs}, str(tmp_path / "k"), grace=30, script="megatron_worker.py", on_started=started)
    assert res[1][0] == -signal.SIGKILL, res[1][1][-3000:]
    assert os.path.exists(seen["path"]), "the kill did not land inside the write phase"
    latest = open(os.path.join(ck, "latest")).read().strip()
    reload = str(tmp_path / "r")
    check(launch(2, {"runs": [{"argv": big, "actions": [["scramble"], ["load", ck], ["dump", "loaded"]]}]}, reload,
                 script="megatron_worker.py"))
    want = "one" if latest == "iter_0000001" else "two"
    for r in (0, 1):
        same_dump(f"{tmp_path}/k/{want}-rank{r}.safetensors", f"{reload}/loaded-rank{r}.safetensors")


def test_resume_with_dropout_restores_every_rng_state(tmp_path):
    """TP=2 with hidden and attention dropout 0.1: dropout inside the tensor-parallel regions draws
    from megatron-core's model-parallel RNG tracker, the rest from the host generators.  A job that
    starts from other RNG states (and other weights), loads iteration 3 and trains 2 iterations
    logs exactly the losses of the uninterrupted run; the same load with --no-load-rng does not
    (so the losses do depend on the RNG states the checkpoint restores)."""
    ck = str(tmp_path / "ck")
    drop = TP2 + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    runs = [{"argv": drop, "actions": [["train", 3], ["save", ck], ["train", 2]]},
            {"argv": drop, "actions": [["scramble"], ["scramble_rng"], ["load", ck], ["train", 2]]},
            {"argv": drop, "actions": [["set_args", {"no_load_rng": True}], ["scramble"], ["scramble_rng"],
                                       ["load", ck], ["train", 2]]}]
    check(launch(2, {"runs": runs}, str(tmp_path), script="megatron_worker.py"))
    whole, resumed, without_rng = results(str(tmp_path))
    assert resumed["loaded"] == [3] and without_rng["loaded"] == [3]
    assert resumed["losses"] == whole["losses"][3:5]
    assert without_rng["losses"] != whole["losses"][3:5]


def test_a_damaged_latest_names_the_intact_iteration_or_falls_back_to_it(tmp_path):
    """A bit flipped in a shard of the newest checkpoint: the load fails on both ranks with the
    same error, naming iteration 1 as the newest intact checkpoint and Megatron-LM's flag that
    loads it (--ckpt-step 1), with the model untouched; with --adacheck-on-corrupt fallback the
    same load takes iteration 1, warning on every rank, and each rank holds exactly what it held
    after saving iteration 1."""
    ck = str(tmp_path / "ck")
    check(launch(2, {"runs": [{"argv": TP2, "actions": [["train", 1], ["save", ck], ["dump", "one"], ["train", 1],
                                                         ["save", ck]]}]}, str(tmp_path / "s"),
                 script="megatron_worker.py"))
    shard = sorted(glob.glob(os.path.join(ck, "iter_0000002", "rank*.safetensors")))[0]
    data = bytearray(open(shard, "rb").read())
    data[-7] ^= 0x20
    open(shard, "wb").write(bytes(data))
    d = str(tmp_path / "l")
    res = check(launch(2, {"runs": [
        {"argv": TP2, "actions": [["scramble"], ["dump", "before"], ["expect_error", "--ckpt-step 1", ["load", ck]],
                                  ["dump", "after"]]},
        {"argv": TP2 + ["--adacheck", "--adacheck-on-corrupt", "fallback"],
         "actions": [["scramble"], ["load", ck], ["dump", "fallback"], ["train", 1]]}]}, d, script="megatron_worker.py"))
    errors = [results(d, r)[0]["errors"] for r in (0, 1)]
    assert errors[0] == errors[1] and len(errors[0]) == 1
    assert "the newest intact checkpoint there is 'iter_0000001'" in errors[0][0] and "hash" in errors[0][0]
    for r in (0, 1):
        same_dump(f"{d}/before-rank{r}.safetensors", f"{d}/after-rank{r}.safetensors")
        same_dump(f"{tmp_path}/s/one-rank{r}.safetensors", f"{d}/fallback-rank{r}.safetensors")
        assert "loading iter_0000001 (step 1), the newest intact checkpoint, instead" in res[r][1]
    assert results(d)[1]["loaded"] == [1]
