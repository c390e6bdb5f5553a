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
    ck, bad = f"{src}/ck", f"{src}/bad"
    block = {"enabled": True, "async": True}
    runs = [
        # the next step starts right after each save call returns and changes every weight, master
        # and moment while the background hashes and writes; the last save is in flight when the
        # script ends (the engine's destroy commits it)
        {"stage": 2, "dtype": "bf16", "adacheck": block,
         "actions": [["train", 3], ["dump", "S3"], ["save", ck], ["train", 2], ["dump", "S5"], ["save", ck],
                     ["train", 1], ["dump", "S6"], ["save", ck], ["train", 1]]},
        # a background failure: rank 1 cannot write files (RLIMIT_FSIZE): a warning, training goes
        # on, 'latest' stays; with on_error "raise" the error reaches the loop
        {"stage": 1, "dtype": "fp32", "adacheck": block,
         "actions": [["train", 1], ["save", bad], ["finish"], ["fsize_limit", 1, 1], ["train", 1], ["save", bad],
                     ["finish"], ["train", 1], ["latest", bad], ["fsize_limit", 1, -1]]},
        {"stage": 1, "dtype": "fp32", "adacheck": dict(block, on_error="raise"),
         "actions": [["fsize_limit", 1, 1], ["train", 1], ["save", f"{src}/bad2"],
                     ["expect_error", "was not published", "finish"], ["fsize_limit", 1, -1], ["train", 1]]},
        # compressed (zstd byte planes), ZeRO-3
        {"stage": 3, "dtype": "bf16", "adacheck": dict(block, compression="zstd"),
         "actions": [["train", 2], ["dump", "Z2"], ["save", f"{src}/zstd"], ["train", 1]]},
    ]
    check(launch(2, {"runs": runs}, src))
    res = [results(src, r) for r in (0, 1)]
    for r in (0, 1):
        assert res[r][1]["finished"] == ["global_step1", None], res[r][1]
        assert any("asynchronous save" in w and "global_step2" in w for w in res[r][1]["warnings"]), res[r][1]
        assert len(res[r][1]["losses"]) == 3
        assert len(res[r][2]["errors"]) == 1 and "bad2" in res[r][2]["errors"][0]
    assert res[0][1]["latest"] == ["global_step1"]
    assert not os.path.exists(f"{src}/bad2/latest")
    left = [os.path.join(d, f) for root in (bad, f"{src}/bad2") for d, _, fs in os.walk(root) for f in fs
            if f.endswith(".tmp")]
    assert not left, left
    # another layout (DP=1 ZeRO-3) loads each checkpoint: exactly the state dumped at its call
    runs = [{"stage": 3, "dtype": "bf16", "seed": 9, "adacheck": {"enabled": True},
             "actions": [["load", ck, {"tag": f"global_step{s}"}], ["dump", f"L{s}"]]} for s in (3, 5)]
    runs.append({"stage": 3, "dtype": "bf16", "seed": 9, "adacheck": {"enabled": True},
                 "actions": [["load", ck], ["dump", "L6"]]})
    runs.append({"stage": 1, "dtype": "bf16", "seed": 9, "adacheck": {"enabled": True},
                 "actions": [["load", f"{src}/zstd"], ["dump", "LZ2"]]})
    check(launch(1, {"runs": runs}, dst))
    for s in (3, 5, 6, "Z2"):
        saved, loaded = load_file(f"{src}/S{s}.safetensors".replace("SZ", "Z")), load_file(f"{dst}/L{s}.safetensors")
        keys = state_keys(saved)
        assert keys
        for k in keys:
            assert torch.equal(saved[k], loaded[k]), (s, k)
        assert loaded["meta/optim_step"].tolist() == saved["meta/optim_step"].tolist(), s
    assert open(f"{ck}/latest").read().strip() == "global_step6"
    manifest = json.load(open(f"{src}/zstd/global_step2/manifest.json"))
    assert manifest["format_version"] == 3
