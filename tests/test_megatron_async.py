"""--async-save under --adacheck with real megatron-core on CPU (gloo, 2 processes): the save
returns after a snapshot, training goes on while the background commits, and a resume from that
checkpoint continues exactly as the uninterrupted run (losses, and every rank's weights, main
weights and optimizer state); a save waits for the one in flight."""
import json
import os

import pytest

from launch import check, launch
from test_megatron import assert_same_dumps

pytestmark = pytest.mark.timeout(900)


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def test_async_save_resumes_exactly(tmp_path):
    ck = str(tmp_path / "ck")
    argv = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--bf16", "--adacheck",
            "--async-save"]
    runs = [{"argv": argv, "actions": [["train", 3], ["save", ck], ["train", 1], ["save", ck], ["train", 1],
                                       ["dump", "a"], ["finish"]]},
            {"argv": argv, "actions": [["scramble"], ["load", ck], ["train", 1], ["dump", "b"]]}]
    # weights, main weights and moments change the moment the save call returns (while the
    # background hashes and writes): the checkpoint holds them as they were at the call
    runs += [{"argv": argv, "actions": [["train", 2], ["dump", "c"], ["save", f"{ck}2"], ["perturb_optimizer"],
                                        ["scramble"], ["finish"]]},
             {"argv": argv, "actions": [["scramble"], ["load", f"{ck}2"], ["dump", "d"]]}]
    # the same with the persist in a thread of each rank (the default: writer processes)
    thread = argv + ["--adacheck-async-writer", "thread"]
    runs += [{"argv": thread, "actions": [["train", 2], ["dump", "e"], ["save", f"{ck}3"], ["perturb_optimizer"],
                                        ["scramble"], ["finish"]]},
             {"argv": argv, "actions": [["scramble"], ["load", f"{ck}3"], ["dump", "f"]]}]
    check(launch(2, {"runs": runs}, str(tmp_path), script="megatron_worker.py"))
    res = results(str(tmp_path))
    assert res[1]["loaded"] == [4] and res[0]["losses"][4:] == res[1]["losses"]
    assert_same_dumps(str(tmp_path), "a", "b", 2)
    assert res[3]["loaded"] == [2]
    assert_same_dumps(str(tmp_path), "c", "d", 2)
    assert res[5]["loaded"] == [2]
    assert_same_dumps(str(tmp_path), "e", "f", 2)
    assert open(os.path.join(ck, "latest")).read().strip() == "iter_0000004"
    assert os.path.exists(os.path.join(ck, "iter_0000003", "manifest.json"))
