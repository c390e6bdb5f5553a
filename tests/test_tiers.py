"""The memory tier (adacheck.tiers) with real DeepSpeed engines (CPU, gloo, 2 processes on one
node): every save goes to memory, every 4th is copied to the checkpoint directory behind
training, and recovery takes the newest state across the tiers.

The oracle is the state DeepSpeed's own accessors return at each save (ds_worker's dumps)."""
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from launch import ROOT, check, launch
from test_ds_integration import assert_same, results

from adacheck import commit
from adacheck.storage import LOCAL
from adacheck.tiers import memory_location

pytestmark = pytest.mark.timeout(900)


def dump(d, name):
    return load_file(os.path.join(d, f"{name}.safetensors"))


def state(d, name):
    s = dump(d, name)
    return s, [k for k in s if k.startswith(("model/", "master/", "optim/"))]


def cli(*argv):
    p = subprocess.run([sys.executable, "-m", "adacheck.cli", *argv], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def tags(path):
    return sorted(t for t, m, _ in commit.list_checkpoints(path, LOCAL) if m is not None) if os.path.isdir(path) else []


def test_memory_tier_recovers_newer_than_durable_falls_back_and_persists_at_exit(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-1")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    ck, ck2, ck3 = f"{d}/ck", f"{d}/ck2", f"{d}/ck3"
    mem3 = memory_location(LOCAL, ck3)
    # (asynchronous: the memory copy is written behind training, by a writer process)
    tiered = {"enabled": True, "async": True, "tiers": {"memory": True, "persist_interval": 4}}
    saves = []
    for step in range(1, 7):
        saves += [["train", 1]] + ([["dump", f"A{step}"]] if step in (4, 6) else []) + [["save", ck]]
    runs = [
        # 50 saves, every 10th persisted: memory holds at most keep (2) + the one being copied
        {"stage": 1, "dtype": "bf16", "adacheck": {"enabled": True, "tiers": {"memory": True, "persist_interval": 10}},
         "actions": [a for _ in range(50) for a in (["train", 1], ["save", ck3], ["ls", mem3])] + [["finish"]]},
        # 6 saves (durable: the 4th), then the job is killed
        {"stage": 1, "dtype": "bf16", "adacheck": tiered, "actions": saves + [["finish"], ["die"]]},
    ]
    out = launch(2, {"runs": runs}, f"{d}/a")
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    assert tags(ck3) == [f"global_step{s}" for s in (10, 20, 30, 40, 50)]
    seen = results(f"{d}/a")[0]["ls"]           # the memory tier of ck3 after each save
    assert max(len(x) for x in seen) <= 3 and seen[-1] == ["global_step49", "global_step50"], seen
    held = results(f"{d}/a")[0]["ls_dirs"]      # (and the files of those alone: retired ones are deleted)
    assert max(len(x) for x in held) <= 3 and held[-1] == ["global_step49", "global_step50"], held
    assert not os.path.exists(mem3)             # (the engine's destroy ended that training cleanly)
    assert tags(ck) == ["global_step4"] and commit.read_latest(ck) == "global_step4"
    mem = memory_location(LOCAL, ck)
    assert tags(mem) == ["global_step5", "global_step6"]

    # a new job (same identity): the newest state is in memory, newer than durable storage
    runs = [{"stage": 1, "dtype": "bf16", "seed": 7, "adacheck": tiered, "actions": [["load", ck], ["dump", "B6"]]},
            # a job that ends cleanly: its newest memory checkpoint is persisted at exit
            {"stage": 1, "dtype": "bf16", "adacheck": tiered,
             "actions": [["train", 1], ["save", ck2], ["train", 1], ["save", ck2], ["train", 1], ["dump", "E3"],
                         ["save", ck2]]}]
    out = launch(2, {"runs": runs}, f"{d}/b")
    check(out)
    assert "loaded global_step6 (step 6) from the memory tier" in out[0][1], out[0][1][-3000:]
    assert "the memory tier holds 1 checkpoint(s) of " + ck2 in out[0][1]      # (the log's total)
    a6, keys = state(f"{d}/a", "A6")
    assert_same(a6, dump(f"{d}/b", "B6"), keys)
    assert commit.read_latest(ck2) == "global_step3" and tags(ck2) == ["global_step3"]
    assert not os.path.exists(memory_location(LOCAL, ck2))       # (removed at the clean exit)
    # another layout (DP=1, ZeRO-3) recovers from the memory tier too
    check(launch(1, {"runs": [{"stage": 3, "dtype": "bf16", "seed": 7, "adacheck": tiered,
                               "actions": [["load", ck], ["dump", "C6"]]}]}, f"{d}/c"))
    assert_same(a6, dump(f"{d}/c", "C6"), keys)

    # the node's memory is lost (here: `adacheck clean` removes what the killed job left): recovery
    # falls back to durable storage and says so
    dry = cli("clean", "--memory-dir", f"{d}/shm")
    assert "job-1:" in dry and f"for {ck}: newest global_step6" in dry and "dry run" in dry, dry
    assert os.path.isdir(mem)
    cli("clean", "--memory-dir", f"{d}/shm", "--job", "job-1", "--yes")
    assert not os.path.exists(mem) and not os.path.exists(f"{d}/shm/job-1")
    runs = [{"stage": 1, "dtype": "bf16", "seed": 7, "adacheck": tiered, "actions": [["load", ck], ["dump", "D4"]]},
            {"stage": 1, "dtype": "bf16", "seed": 7, "adacheck": tiered, "actions": [["load", ck2], ["dump", "F3"]]}]
    out = launch(2, {"runs": runs}, f"{d}/d")
    check(out)
    assert "memory tier holds no checkpoint" in out[0][1]
    a4, keys = state(f"{d}/a", "A4")
    assert_same(a4, dump(f"{d}/d", "D4"), keys)
    e3, keys = state(f"{d}/b", "E3")
    assert_same(e3, dump(f"{d}/d", "F3"), keys)


def test_megatron_recovers_from_the_memory_tier_after_a_sigkill(tmp_path, monkeypatch):
    """TP=2 megatron-core (scripts/pretrain_gpt.py's flags, --adacheck-tiers-memory, nothing copied
    to the checkpoint directory yet): the job is killed after iteration 5; a new job (other
    weights) loads iteration 3 from memory, and after 2 more iterations every rank's weights, main
    weights and optimizer state equal the killed job's at iteration 5 (read from megatron-core's
    objects)."""
    from test_megatron import assert_same_dumps
    monkeypatch.setenv("ADACHECK_JOB", "megatron-tiers")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", str(tmp_path / "shm"))
    ck = str(tmp_path / "ck")
    argv = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--adacheck",
            "--adacheck-tiers-memory", "--adacheck-tiers-persist-interval", "10"]
    out = launch(2, {"runs": [{"argv": argv, "actions": [["train", 3], ["save", ck], ["train", 2], ["dump", "a"],
                                                          ["die"]]}]},
                 str(tmp_path), script="megatron_worker.py")
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    assert tags(ck) == [] and tags(memory_location(LOCAL, ck)) == ["iter_0000003"]
    out = launch(2, {"runs": [{"argv": argv, "actions": [["scramble"], ["load", ck], ["train", 2], ["dump", "b"]]}]},
                 str(tmp_path), script="megatron_worker.py")
    check(out)
    assert "loaded AdaCheck checkpoint iteration 3 from the memory tier" in out[0][1], out[0][1][-3000:]
    assert results(str(tmp_path))[0]["loaded"] == [3]
    assert_same_dumps(str(tmp_path), "a", "b", 2)
