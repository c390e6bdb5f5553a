"""DeepSpeed-MoE with AdaCheck (CPU, gloo, 2 real processes, tests/moe_worker.py): a MoE layer of 2
experts with top-1 gating between two dense layers, expert-parallel over 2 ranks (each rank holds
another expert) or 1 (each rank holds both), ZeRO 0-2.

Oracles: DeepSpeed's own native save and load of the same step (its expert files are named by
global expert id), the tensors DeepSpeed's accessors gather on each rank (experts renamed to their
global ids by the test, gathered over the expert-parallel group), and the uninterrupted run's
losses."""
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from launch import check, kill_at_marker
from launch import launch as _launch
from test_ds_integration import assert_same, results

from adacheck.checkpoint import CheckpointReader
from adacheck.cli import main as cli

pytestmark = pytest.mark.timeout(1200)

EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts"


def launch(*args, **kwargs):
    return _launch(*args, script="moe_worker.py", **kwargs)


def dump(d, name):
    return load_file(os.path.join(d, f"{name}.safetensors"))


def test_experts_are_named_by_global_id_resume_exactly_and_load_into_other_ep_sizes(tmp_path, capsys):
    """ep_size 2 (ZeRO-0 fp32 and ZeRO-2 bf16): no replica taken for diverged, each expert
    stored under its global id, AdaCheck's load gives the state of DeepSpeed's own native load
    of the same step and the uninterrupted run's next losses.  The same checkpoints load into
    ep_size 1 at another ZeRO stage (every tensor as gathered in the saving run), and an ep_size
    1 ZeRO-1 save loads into ep_size 2.  ``adacheck convert --to deepspeed`` writes DeepSpeed's
    own per-expert files, and ``--from deepspeed`` reads them."""
    d = str(tmp_path)
    ac = {"enabled": True}
    runs = []
    for stage, dtype in ((0, "fp32"), (2, "bf16")):
        k = f"{stage}{dtype}"
        runs.append(dict(ep=2, stage=stage, dtype=dtype, adacheck=ac, actions=[
            ["train", 2], ["save_native", f"{d}/native{k}"], ["save", f"{d}/a{k}"], ["dump", f"S{k}"], ["train", 2],
            ["load", f"{d}/a{k}"], ["dump", f"L{k}"], ["train", 2], ["load_native", f"{d}/native{k}"],
            ["dump", f"N{k}"]]))
    for stage, dtype, into in ((0, "fp32", 2), (2, "bf16", 1)):     # (another ZeRO stage too)
        runs.append(dict(ep=1, stage=into, dtype=dtype, adacheck=ac, actions=[
            ["load", f"{d}/a{stage}{dtype}"], ["dump", f"R{stage}{dtype}"], ["train", 1]]))
    runs += [dict(ep=1, stage=1, dtype="fp32", adacheck=ac, actions=[["train", 2], ["save", f"{d}/b"], ["dump", "SB"]]),
             dict(ep=2, stage=1, dtype="fp32", adacheck=ac, actions=[["load", f"{d}/b"], ["dump", "RB"], ["train", 1]])]
    check(launch(2, {"runs": runs}, d, timeout=1000))
    res = results(d)
    text = "".join(open(os.path.join(d, f"rank{r}.log")).read() for r in range(2))
    assert "declared replicas diverged" not in text
    for i, k in enumerate(("0fp32", "2bf16")):
        assert_same(dump(d, f"S{k}"), dump(d, f"L{k}"))
        assert_same(dump(d, f"N{k}"), dump(d, f"L{k}"))
        assert res[i]["losses"][2:4] == res[i]["losses"][4:6], k
        assert_same(dump(d, f"S{k}"), dump(d, f"R{k}"))
        with open(f"{d}/a{k}/global_step2/manifest.json") as f:
            names = set(json.load(f)["tensors"])
        for e in (0, 1):   # each expert once, under its global id
            assert f"model/{EXPERT}.{e}.0.weight" in names, (k, sorted(names))
        assert f"model/{EXPERT}.2.0.weight" not in names
    assert_same(dump(d, "SB"), dump(d, "RB"))
    # DeepSpeed's own per-expert files of the ZeRO-2 bf16 checkpoint: the same files as DeepSpeed's
    # save of that step, and stock load_checkpoint of them gives the saved state
    conv = f"{d}/conv"
    assert cli(["convert", f"{d}/a2bf16", conv, "--to", "deepspeed"]) == 0
    # and DeepSpeed's own save of that step to AdaCheck: the MoE layers, parameters and optimizer
    # groups rebuilt from its files are those AdaCheck recorded in the training job, and the
    # result loads into the training engine (ep_size 2, and 1) with the state gathered there
    assert cli(["convert", f"{d}/native2bf16", f"{d}/fromnat", "--from", "deepspeed",
                "--optimizer", "torch.optim.AdamW"]) == 0
    assert (CheckpointReader(f"{d}/fromnat/global_step2").objects()["model_spec"] ==
            CheckpointReader(f"{d}/a2bf16/global_step2").objects()["model_spec"])
    check(launch(2, {"runs": [dict(ep=2, stage=2, dtype="bf16", adacheck=None, actions=[["load", conv], ["dump", "C"]])] +
                     [dict(ep=ep, stage=2, dtype="bf16", adacheck=ac, actions=[["load", f"{d}/fromnat"], ["dump", f"F{ep}"]])
                      for ep in (2, 1)]},
                 f"{d}/c", timeout=600))
    assert_same(dump(d, "S2bf16"), dump(f"{d}/c", "C"))
    assert_same(dump(d, "S2bf16"), dump(f"{d}/c", "F2"))
    assert_same(dump(d, "R2bf16"), dump(f"{d}/c", "F1"))
    for f in sorted(os.listdir(f"{d}/native2bf16/global_step2")):
        if f.endswith("model_states.pt"):
            x, y = (torch.load(f"{c}/global_step2/{f}", weights_only=False) for c in (f"{d}/native2bf16", conv))
            x, y = x.get("module", x), y.get("module", y)
            assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x), f
    # DeepSpeed's universal format cannot hold native MoE experts (its loader finds each by its
    # rank-local name), and a native MoE checkpoint without ZeRO does not name the experts its
    # optimizer steps: refused
    capsys.readouterr()
    assert cli(["convert", f"{d}/a0fp32", f"{d}/conv-universal", "--to", "deepspeed-universal"]) == 2
    assert "rank-local name" in capsys.readouterr().err
    assert cli(["convert", f"{d}/native0fp32", f"{d}/from-native", "--from", "deepspeed",
                "--optimizer", "torch.optim.AdamW"]) == 2
    assert "ZeRO 1-2" in capsys.readouterr().err
    assert not os.path.exists(f"{d}/conv-universal") and not os.path.exists(f"{d}/from-native")


def test_online_deltas_of_experts_recover_after_sigkill_and_zero0_is_refused_at_initialize(tmp_path):
    """ZeRO-2 bf16, ep_size 2, online deltas with bases every 3 steps; rank 1 is SIGKILLed at a
    step after the first base: a new job's load replays base + deltas to the last committed step,
    where every tensor equals the uninterrupted run's, and trains on with its losses.  Without
    ZeRO (each rank's optimizer steps other experts, so gradients are not replicated over the
    data-parallel group) deepspeed.initialize refuses adacheck.online."""
    d = str(tmp_path)
    ck = f"{d}/ck"
    ac = {"enabled": True, "save_dir": ck, "online": {"enabled": True, "base_interval": 3}}
    moe = {"ep": 2, "stage": 2, "dtype": "bf16"}
    check(launch(2, {"runs": [
        dict(moe, actions=[["train_dump", 8, "U"]]),
        dict(moe, stage=0, dtype="fp32", adacheck=dict(ac, save_dir=f"{d}/z0"),
             init_error="adacheck.online with DeepSpeed-MoE experts needs ZeRO stage 1-3"),
    ]}, d, timeout=1000))
    ref, z0 = results(d)
    assert "set zero_optimization.stage to 1 or 2" in z0["errors"][0], z0["errors"]
    # (the job waits at its end, so that the kill lands however fast the steps are)
    res = launch(2, {"runs": [dict(moe, adacheck=ac, actions=[["train_dump", 8, "K", "m"], ["wait_file", f"{d}/never"]])]},
                 f"{d}/k", on_started=kill_at_marker(f"{d}/k/m5-rank1", victim=1, jitter=0), grace=10, timeout=1000)
    assert res[1][0] == -signal.SIGKILL, res[1][1][-3000:]
    check(launch(2, {"runs": [dict(moe, seed=5, adacheck=ac, actions=[["load", ck], ["steps"], ["dump", "B"],
                                                                       ["train_to", 8]])]}, f"{d}/r", timeout=1000))
    b = results(f"{d}/r")[0]
    t = b["steps"][0]
    assert t >= 4, t
    assert_same(dump(d, f"U{t}"), dump(f"{d}/r", "B"))
    assert b["losses"] == ref["losses"][t:8]
