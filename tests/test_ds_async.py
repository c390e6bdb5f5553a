"""Asynchronous saves with real DeepSpeed engines on CPU (gloo, 2 processes): the checkpoint holds
exactly the state at the save call although training changes it while the background writes;
a background failure is a warning (or an error with on_error "raise") and leaves the previous
checkpoint as 'latest', with no temporary file behind; the engine's destroy commits the save in
flight; compressed (zstd) checkpoints load into another layout exactly."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from launch import check, launch

pytestmark = pytest.mark.timeout(900)


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def state_keys(saved):
    return [k for k in saved if k.startswith(("master/", "optim/", "buffer/"))]


def test_async_saves_hold_the_state_at_the_call(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ck, bad, pk, dead = f"{src}/ck", f"{src}/bad", f"{src}/pk", f"{src}/dead"
    block = {"enabled": True, "async": True}
    thread = dict(block, async_writer="thread")    # (RLIMIT_FSIZE below limits the rank's own writes)
    runs = [
        # the next step starts right after each save call returns and changes every weight, master
        # and moment while the background hashes and writes; the last save is in flight when the
        # script ends (the engine's destroy commits it)
        {"stage": 2, "dtype": "bf16", "adacheck": thread,
         "actions": [["train", 3], ["dump", "S3"], ["save", ck], ["train", 2], ["dump", "S5"], ["save", ck],
                     ["train", 1], ["dump", "S6"], ["save", ck], ["train", 1]]},
        # a background failure: rank 1 cannot write files (RLIMIT_FSIZE): a warning, training goes
        # on, 'latest' stays; with on_error "raise" the error reaches the loop
        {"stage": 1, "dtype": "fp32", "adacheck": thread,
         "actions": [["train", 1], ["save", bad], ["finish"], ["fsize_limit", 1, 1], ["train", 1], ["save", bad],
                     ["finish"], ["train", 1], ["latest", bad], ["fsize_limit", 1, -1]]},
        {"stage": 1, "dtype": "fp32", "adacheck": dict(thread, on_error="raise"),
         "actions": [["fsize_limit", 1, 1], ["train", 1], ["save", f"{src}/bad2"],
                     ["expect_error", "was not published", "finish"], ["fsize_limit", 1, -1], ["train", 1]]},
        # compressed (zstd byte planes), ZeRO-3
        {"stage": 3, "dtype": "bf16", "adacheck": dict(block, compression="zstd"),
         "actions": [["train", 2], ["dump", "Z2"], ["save", f"{src}/zstd"], ["train", 1]]},
        # the same in writer processes (the default: shared-memory staging, a gloo world of their
        # own); the last save is in flight when the script ends
        {"stage": 2, "dtype": "bf16", "adacheck": block,
         "actions": [["train", 3], ["dump", "P3"], ["save", pk], ["train", 2], ["dump", "P5"], ["save", pk],
                     ["train", 1], ["dump", "P6"], ["save", pk], ["train", 1]]},
        # rank 1's writer dies during a save (stopped before it, killed after the call): a warning
        # on both ranks, 'latest' stays; the next save starts new writers and commits
        {"stage": 1, "dtype": "fp32", "adacheck": block,
         "actions": [["train", 1], ["save", dead], ["finish"], ["stop_writer", 1], ["train", 1], ["save", dead],
                     ["kill_writer", 1], ["finish"], ["latest", dead], ["train", 1], ["dump", "K3"], ["save", dead],
                     ["finish"], ["latest", dead]]},
    ]
    check(launch(2, {"runs": runs}, src))
    res = [results(src, r) for r in (0, 1)]
    for r in (0, 1):
        assert res[r][1]["finished"] == ["global_step1", None], res[r][1]
        assert any("asynchronous save" in w and "global_step2" in w for w in res[r][1]["warnings"]), res[r][1]
        assert len(res[r][1]["losses"]) == 3
        assert len(res[r][2]["errors"]) == 1 and "bad2" in res[r][2]["errors"][0]
    assert res[0][1]["latest"] == ["global_step1"]
    # what the committed async save cost, on every rank once reported; a failed one replaces nothing
    on_disk = sum(os.path.getsize(f"{bad}/global_step1/{f}") for f in os.listdir(f"{bad}/global_step1")
                  if f.endswith(".safetensors"))
    for r in (0, 1):
        reports = res[r][1]["last_save"]      # (after: save, finish, save, finish that failed)
        assert reports[0] is None and reports[1] == reports[2] == reports[3], reports
        assert reports[1]["tag"] == "global_step1" and reports[1]["async"], reports
        assert reports[1]["stored_bytes"] == on_disk and reports[1]["stall_s"] <= reports[1]["commit_s"], reports
    for r in (0, 1):
        died = res[r][5]
        assert died["finished"] == ["global_step1", None, "global_step3"], died
        assert any("writer process" in w and "global_step2" in w for w in died["warnings"]), died
    assert res[0][5]["latest"] == ["global_step1", "global_step3"]
    assert not os.path.exists(f"{dead}/global_step2/manifest.json")
    assert not os.path.exists(f"{src}/bad2/latest")
    left = [os.path.join(d, f) for root in (bad, f"{src}/bad2", dead) for d, _, fs in os.walk(root) for f in fs
            if f.endswith(".tmp")]
    assert not left, left
    # another layout (DP=1 ZeRO-3) loads each checkpoint: exactly the state dumped at its call
    runs = [{"stage": 3, "dtype": "bf16", "seed": 9, "adacheck": {"enabled": True},
             "actions": [["load", ck, {"tag": f"global_step{s}"}], ["dump", f"L{s}"]]} for s in (3, 5)]
    runs.append({"stage": 3, "dtype": "bf16", "seed": 9, "adacheck": {"enabled": True},
                 "actions": [["load", ck], ["dump", "L6"]]})
    runs.append({"stage": 1, "dtype": "bf16", "seed": 9, "adacheck": {"enabled": True},
                 "actions": [["load", f"{src}/zstd"], ["dump", "LZ2"]]})
    runs += [{"stage": 3, "dtype": "bf16", "seed": 9, "adacheck": {"enabled": True},
              "actions": [["load", pk, {"tag": f"global_step{s}"}], ["dump", f"LP{s}"]]} for s in (3, 5, 6)]
    runs.append({"stage": 1, "dtype": "fp32", "seed": 9, "adacheck": {"enabled": True},
                 "actions": [["load", dead], ["dump", "LK3"]]})
    check(launch(1, {"runs": runs}, dst))
    named = {3: "S3", 5: "S5", 6: "S6", "Z2": "Z2", "P3": "P3", "P5": "P5", "P6": "P6", "K3": "K3"}
    for s, dumped in named.items():
        saved, loaded = load_file(f"{src}/{dumped}.safetensors"), load_file(f"{dst}/L{s}.safetensors")
        keys = state_keys(saved)
        assert keys
        for k in keys:
            assert torch.equal(saved[k], loaded[k]), (s, k)
        assert loaded["meta/optim_step"].tolist() == saved["meta/optim_step"].tolist(), s
    assert open(f"{ck}/latest").read().strip() == "global_step6"
    manifest = json.load(open(f"{src}/zstd/global_step2/manifest.json"))
    assert manifest["format_version"] == 3


def test_a_writer_that_dies_as_it_starts_fails_the_save_soon(tmp_path, monkeypatch):
    """Rank 1's writer process is killed while it starts (the save call has just returned): rank
    0's writer gives up waiting for it after ADACHECK_WRITER_MEET_SECONDS, not after a
    collective's 30 minutes; both ranks warn, 'latest' stays absent, training goes on, and the
    next save starts new writers and commits."""
    monkeypatch.setenv("ADACHECK_WRITER_MEET_SECONDS", "15")
    ck = str(tmp_path / "ck")
    runs = [{"stage": 1, "dtype": "fp32", "adacheck": {"enabled": True, "async": True},
             "actions": [["train", 1], ["save", ck], ["kill_writer", 1], ["finish"], ["latest", ck], ["train", 1],
                         ["save", ck], ["finish"], ["latest", ck]]}]
    check(launch(2, {"runs": runs}, str(tmp_path), timeout=300))
    for r in (0, 1):
        res = results(str(tmp_path), r)[0]
        assert res["finished"] == [None, "global_step2"], res
        assert len(res["losses"]) == 2
    warned = [results(str(tmp_path), r)[0]["warnings"] for r in (0, 1)]
    assert any("did not meet within 15s" in w for w in warned[0]), warned[0]
    assert any("writer process" in w and "killed by signal 9" in w for w in warned[1]), warned[1]
    assert results(str(tmp_path))[0]["latest"] == [None, "global_step2"]


@pytest.mark.parametrize("backend", ["gloo", "cuda:gloo"])
def test_a_job_without_a_tcp_store_persists_in_a_thread(tmp_path, backend):
    """Writer processes meet in the job's TCP store; a job that met in a FileStore gets the thread
    instead, with a warning on every rank, and its async save holds the state at the call.
    ``cuda:gloo``: the job's default group carries no CPU tensors (a GPU job's is NCCL); AdaCheck
    exchanges its host bytes on a gloo group of its own, in the sync and the async save."""
    spec = {"store": str(tmp_path / "rendezvous"), "dir": str(tmp_path / "ck"), "backend": backend}
    out = check(launch(2, spec, str(tmp_path), script="core_async_worker.py", timeout=180))
    for rank, (_, text) in enumerate(out):
        assert "persist in a thread" in text and "TCP store" in text, text
        got = results(str(tmp_path), rank)
        after = got.pop("after_commit")
        assert got == {"committed": True, "writer": False, "equal": True}
        # 'latest' could not be written after s2's manifest was: said as committed, loadable by its tag
        assert not after["returned"] and after["equal"], after
        said = " ".join(after["warnings"])
        assert "'s2' was committed" in said and "load 's2' by its tag" in said, said
        assert "from the previous checkpoint" not in said, said
