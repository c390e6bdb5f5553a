"""DeepSpeed's PipelineEngine with AdaCheck (CPU, gloo, 2-4 real processes, tests/pipe_worker.py):
a PipelineModule of residual blocks whose first and last layers are one TiedLayerSpec, trained
with train_batch, ZeRO-1 within each stage.

Oracles: DeepSpeed's own native save and load of the same step, the tensors DeepSpeed's
accessors (safe_get_full_fp32_param, safe_get_full_optimizer_state) gather from every stage, and
the losses of the uninterrupted run."""
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from launch import check, kill_at_marker
from launch import launch as _launch
from test_ds_integration import assert_same, results

from adacheck.cli import main as cli

from adacheck.checkpoint import CheckpointReader

pytestmark = pytest.mark.timeout(1200)

PP = {"dtype": "bf16", "stage": 1, "tie": True, "hidden": 8, "layers": 3}   # (the tied weight straddles the
# ZeRO-1 partitions of one stage, not of the other: DeepSpeed lists it first on each stage)


def launch(*args, **kwargs):
    return _launch(*args, script="pipe_worker.py", **kwargs)


def dump(d, name):
    return load_file(os.path.join(d, f"{name}.safetensors"))


def logs(d, world):
    return "".join(open(os.path.join(d, f"rank{r}.log")).read() for r in range(world))


def manifest(ck, tag):
    with open(os.path.join(ck, tag, "manifest.json")) as f:
        return json.load(f)


def test_pipeline_saves_once_resumes_exactly_and_loads_into_other_stage_counts(tmp_path):
    """4 ranks, 2 stages x 2 data-parallel ranks, ZeRO-1 bf16, tied first/last layer (and 4
    stages of 1 rank, fp32 without ZeRO): AdaCheck's load gives the state DeepSpeed's own load of
    its native checkpoint of the same step gives, and the uninterrupted run's next losses; the
    tied weight is stored once, with no replica taken for diverged.  Then 2 ranks load that
    checkpoint into 1 stage x 2 and 2 stages x 1 (every tensor as gathered in the saving run;
    1 x 2 continues with the uninterrupted run's loss) and into 2 stages x 1 at ZeRO-0, and a
    1-stage save loads into 2 stages.
    ``adacheck convert --to deepspeed --dp 1`` writes the layer files DeepSpeed's own save wrote,
    and stock load_checkpoint of them gives the saved state; --to deepspeed-universal equals
    DeepSpeed's own ds_to_universal of its native save (both loaded by stock load_universal into 2
    stages and 1); --from deepspeed of that native save rebuilds the training job's pipeline and
    loads into it with the saved state."""
    d = str(tmp_path)
    a, nat, fp, b = f"{d}/a", f"{d}/native", f"{d}/fp32", f"{d}/b"
    ac = {"enabled": True}
    check(launch(4, {"runs": [
        dict(PP, pp=2, adacheck=ac, actions=[
            ["train", 2], ["save_native", nat], ["save", a], ["dump", "S2"], ["train", 2],
            ["load", a], ["dump", "L2"], ["train", 2], ["load_native", nat], ["dump", "N2"]]),
        dict(pp=4, dtype="fp32", stage=0, tie=True, adacheck=ac, actions=[
            ["train", 2], ["save", fp], ["dump", "F2"], ["train", 1], ["load", fp], ["dump", "G2"], ["train", 1]]),
    ]}, d, timeout=900))
    res = results(d)
    assert_same(dump(d, "S2"), dump(d, "L2"))
    assert_same(dump(d, "N2"), dump(d, "L2"))
    assert res[0]["losses"][2:4] == res[0]["losses"][4:6]
    assert_same(dump(d, "F2"), dump(d, "G2"))
    assert res[1]["losses"][2] == res[1]["losses"][3]
    assert "declared replicas diverged" not in logs(d, 4)
    saved = dump(d, "S2")
    for ck in (a, fp):
        m = manifest(ck, "global_step2")
        tied = {n: e for n, e in m["tensors"].items() if "tied_modules.embed" in n}
        assert {n.split("/")[0] for n in tied} >= ({"model", "master"} if ck == a else {"model"})
        for n, e in tied.items():     # one stored copy (or a derivation): no variants, no overlap
            assert not any("#v" in str(box) for box in e.get("boxes", [])), n
        # every tensor gathered from the stages by DeepSpeed's API is in the checkpoint (without
        # ZeRO, fp32: the module's weights are the optimizer's, "master" in the dump)
        gathered = dump(d, "S2" if ck == a else "F2")
        assert {k for k in gathered if not k.startswith(("meta/", "master/" if ck == fp else "-"))} <= set(m["tensors"])
        assert m["framework"]["pp_world_size"] == (2 if ck == a else 4)
        stats = m["stats"]
        # stored once: no more than the state itself (a few scalars and objects besides)
        assert stats["stored_bytes"] <= stats["logical_bytes"] * 1.1, (ck, stats)

    # DeepSpeed's own files of that checkpoint, in 2 stages x 1 data-parallel rank
    conv = f"{d}/conv"
    assert cli(["convert", a, conv, "--to", "deepspeed", "--dp", "1"]) == 0
    check(launch(2, {"runs": [
        dict(PP, pp=2, adacheck=None, actions=[["load", conv], ["dump", "C2"]]),
        dict(PP, pp=1, adacheck=ac, actions=[["load", a], ["dump", "P1"], ["train", 1], ["save", b], ["dump", "B3"]]),
        dict(PP, pp=2, adacheck=ac, actions=[["load", a], ["dump", "P2"]]),
        dict(PP, pp=2, adacheck=ac, actions=[["load", b], ["dump", "Q2"]]),
    ]}, f"{d}/r", timeout=900))
    r = results(f"{d}/r")[1:]
    assert_same(saved, dump(f"{d}/r", "C2"))     # stock load_checkpoint of the converted files
    for f in sorted(os.listdir(f"{nat}/global_step2")):   # the same layer files as DeepSpeed's own save
        if f.startswith("layer_"):
            x, y = (torch.load(f"{c}/global_step2/{f}", weights_only=True) for c in (nat, conv))
            assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x), f
    assert_same(saved, dump(f"{d}/r", "P1"))
    assert_same(saved, dump(f"{d}/r", "P2"))
    assert r[0]["losses"] == res[0]["losses"][2:3]     # (the same data-parallel replicas: the same step)
    assert_same(dump(f"{d}/r", "B3"), dump(f"{d}/r", "Q2"))
    # the model description of a 2-stage save (what a conversion rebuilds the model from) is
    # every stage's, as the 1-stage engine's own module lists it
    two, one = (CheckpointReader(f"{ck}/global_step{s}").objects()["model_spec"] for ck, s in ((a, 2), (b, 3)))
    assert two["parameters"] == one["parameters"] and two["groups"] == one["groups"]
    assert two["buffers"] == one["buffers"] and len(one["parameters"]) == 1 + 4 * PP["layers"]
    # DeepSpeed's universal format: AdaCheck's conversion, and DeepSpeed's own (ds_to_universal) of
    # its native save of the same step, loaded by stock load_universal into 2 stages and into 1
    assert cli(["convert", a, f"{d}/uc", "--to", "deepspeed-universal"]) == 0
    ds_universal(f"{nat}/global_step2", f"{d}/ucn")
    # and DeepSpeed's native pipeline files (2 stages x 2) to AdaCheck: the model rebuilt from them
    # (tied layer held by the first stage, used as a function by the last) is the training job's
    assert cli(["convert", nat, f"{d}/fromnat", "--from", "deepspeed", "--optimizer", "torch.optim.AdamW"]) == 0
    spec = (CheckpointReader(f"{ck}/global_step2").objects()["model_spec"] for ck in (a, f"{d}/fromnat"))
    assert next(spec)["pipeline"] == next(spec)["pipeline"]
    uc = {"checkpoint": {"load_universal": True}}
    check(launch(2, {"runs": [dict(PP, pp=p, ds_extra=uc, seed=5, actions=[["load_native", src], ["dump", f"U{p}{k}"]])
                              for p in (2, 1) for k, src in (("a", f"{d}/uc"), ("n", f"{d}/ucn"))] +
                     [dict(PP, pp=2, adacheck=ac, seed=5, actions=[["load", f"{d}/fromnat"], ["dump", "FN"]]),
                      # (and into ZeRO-0, 2 stages x 1)
                      dict(PP, pp=2, stage=0, adacheck=ac, seed=5, actions=[["load", a], ["dump", "Z2"]])]},
                 f"{d}/u", timeout=900))
    for p in (2, 1):
        ours, theirs = dump(f"{d}/u", f"U{p}a"), dump(f"{d}/u", f"U{p}n")
        assert_same(theirs, ours)
        assert_same(saved, ours)
    assert_same(saved, dump(f"{d}/u", "FN"))      # (DeepSpeed's accessors, in the run that saved both)
    assert_same(saved, dump(f"{d}/u", "Z2"))


def test_pipeline_with_tensor_parallelism_saves_once_resumes_and_reshapes(tmp_path):
    """Megatron-DeepSpeed's 3D layout on 4 ranks: 2 stages x 2 tensor-parallel ranks (blocks split
    as Megatron splits an MLP, the norm and the tied projections replicated), ZeRO-1 bf16: AdaCheck's
    load gives the state of DeepSpeed's own native load of the same step and the uninterrupted
    run's next losses, each logical tensor stored once; the checkpoint loads into 1 stage x 2
    tensor-parallel ranks and into 2 stages x 1 (every tensor as DeepSpeed's accessors gathered it
    in the saving run), and --to deepspeed-universal loads with stock load_universal into 2 x 2."""
    d = str(tmp_path)
    a, nat = f"{d}/a", f"{d}/native"
    ac = {"enabled": True}
    tp = dict(PP, split=True, tp=2, hidden=8)
    check(launch(4, {"runs": [dict(tp, pp=2, adacheck=ac, actions=[
        ["train", 2], ["save_native", nat], ["save", a], ["dump", "S"], ["train", 2],
        ["load", a], ["dump", "L"], ["train", 2], ["load_native", nat], ["dump", "N"]])]}, d, timeout=900))
    res = results(d)
    saved = dump(d, "S")
    assert_same(saved, dump(d, "L"))
    assert_same(dump(d, "N"), dump(d, "L"))
    assert res[0]["losses"][2:4] == res[0]["losses"][4:6]
    assert "declared replicas diverged" not in logs(d, 4)
    m = manifest(a, "global_step2")
    assert m["tensors"]["master/1.fc1_weight"]["shape"] == [16, 8]     # (the logical tensor, not a slice)
    assert m["stats"]["stored_bytes"] <= m["stats"]["logical_bytes"] * 1.1, m["stats"]
    assert cli(["convert", a, f"{d}/uc", "--to", "deepspeed-universal"]) == 0
    assert cli(["convert", a, f"{d}/conv", "--to", "deepspeed"]) == 2     # (not yet: refused, nothing written)
    assert not os.path.exists(f"{d}/conv")
    check(launch(2, {"runs": [dict(tp, pp=1, adacheck=ac, seed=5, actions=[["load", a], ["dump", "P1"]]),
                              dict(tp, pp=2, tp=1, adacheck=ac, seed=5, actions=[["load", a], ["dump", "T1"]])]},
                 f"{d}/r", timeout=900))
    check(launch(4, {"runs": [dict(tp, pp=2, seed=5, ds_extra={"checkpoint": {"load_universal": True}},
                                   actions=[["load_native", f"{d}/uc"], ["dump", "U"]])]}, f"{d}/u", timeout=900))
    for name in ("r/P1", "r/T1", "u/U"):
        assert_same(saved, dump(d, name))


def ds_universal(src, out):
    """DeepSpeed's own universal conversion of its native checkpoint folder ``src`` (as its tests call
    it; inject_missing_state: the save has no universal_checkpoint_info)."""
    from types import SimpleNamespace
    from deepspeed.checkpoint import ds_to_universal
    os.makedirs(out)
    ds_to_universal.main(SimpleNamespace(input_folder=src, output_folder=f"{out}/global_step2",
                                         num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                         strict=True, inject_missing_state=True))
    with open(f"{out}/latest_universal", "w") as f:
        f.write("global_step2")


def test_pipeline_online_recovers_after_sigkill_exactly(tmp_path):
    """Online deltas recorded around train_batch (bases every 3 steps) on 2 stages x 2 ranks;
    a last-stage rank is SIGKILLed at a step; a new job's load replays to the last committed
    step: its tensors equal the uninterrupted run's at that step, and it trains on with the
    uninterrupted run's losses.  An asynchronous save of a pipeline commits behind train_batch."""
    d = str(tmp_path)
    ck = f"{d}/ck"
    check(launch(4, {"runs": [dict(PP, pp=2, actions=[["train_dump", 8, "U"]])]}, f"{d}/u", timeout=900))
    ref = results(f"{d}/u")[0]["losses"]
    ac = {"enabled": True, "save_dir": ck, "online": {"enabled": True, "base_interval": 3}}
    res = launch(4, {"runs": [dict(PP, pp=2, adacheck=ac, actions=[["train_dump", 8, "K", "m"]])]}, f"{d}/k",
                 on_started=kill_at_marker(f"{d}/k/m5-rank3", victim=3), grace=30, timeout=900)
    assert res[3][0] == -signal.SIGKILL, res[3][1][-3000:]
    asy = f"{d}/async"
    check(launch(4, {"runs": [
        dict(PP, pp=2, seed=7, adacheck=ac, actions=[["load", ck], ["steps"], ["dump", "R"], ["train_to", 8]]),
        dict(PP, pp=2, adacheck={"enabled": True, "async": True}, actions=[
            ["train", 2], ["save", asy], ["train", 1], ["finish"], ["load", asy], ["dump", "A2"]]),
    ]}, f"{d}/r", timeout=900))
    r = results(f"{d}/r")
    t = r[0]["steps"][0]
    assert t >= 4, t
    assert_same(dump(f"{d}/u", f"U{t}"), dump(f"{d}/r", "R"))
    assert r[0]["losses"] == ref[t:8]
    assert r[1]["finished"] == [None] or r[1]["finished"] == ["global_step2"]
    assert_same(dump(f"{d}/u", "U2"), dump(f"{d}/r", "A2"))
