"""adacheck convert --to weights: full weights as standard safetensors, loaded by torch."""
import json
import os

import torch
from safetensors.torch import load_file

from adacheck.cli import main as cli
from ds_worker import Net
from launch import check, launch


def test_weights_export_loads_into_the_module(tmp_path):
    d = str(tmp_path)
    runs = [{"stage": 3, "dtype": "bf16", "layers": 3, "adacheck": {"enabled": True},
             "actions": [["train", 2], ["save", f"{d}/ck"], ["dump", "S"]]}]
    check(launch(2, {"runs": runs}, d))
    saved = load_file(f"{d}/S.safetensors")
    assert cli(["convert", f"{d}/ck", f"{d}/w"]) == 0
    assert cli(["convert", f"{d}/ck", f"{d}/w32", "--dtype", "fp32", "--max-shard-size", "3KB"]) == 0
    for out, prefix, dtype in ((f"{d}/w", "model/", torch.bfloat16), (f"{d}/w32", "master/", torch.float32)):
        files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
        state = {}
        for f in files:
            state.update(load_file(os.path.join(out, f)))
        if len(files) > 1:   # Hugging Face style index next to the shards
            index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
            assert sorted(set(index["weight_map"].values())) == files and set(index["weight_map"]) == set(state)
        net = Net(37, 3).to(dtype)
        net.load_state_dict(state, strict=True)   # the real module takes it as is
        for n, p in net.named_parameters():
            assert torch.equal(p.data, saved[prefix + n].to(dtype)), n
    assert len(os.listdir(f"{d}/w32")) > 2
    # never overwrites without being asked
    assert cli(["convert", f"{d}/ck", f"{d}/w"]) == 2


def test_deepspeed_universal_loads_with_stock_deepspeed(tmp_path):
    """AdaCheck -> universal checkpoint -> stock engine.load_checkpoint (load_universal) in
    ZeRO 1/2/3 at DP=2 and DP=4: every master weight, moment, step, lr and buffer equal."""
    d = str(tmp_path)
    sources = [(2, "bf16"), (0, "fp32")]
    check(launch(2, {"runs": [dict(stage=s, dtype=dt, layers=3, adacheck={"enabled": True},
                                   actions=[["train", 3], ["save", f"{d}/ck{s}"], ["dump", f"S{s}"], ["train", 2],
                                            ["dump", f"A{s}"]]) for s, dt in sources]}, d))
    for s, _ in sources:
        assert cli(["convert", f"{d}/ck{s}", f"{d}/uc{s}", "--to", "deepspeed-universal"]) == 0
        assert open(f"{d}/uc{s}/latest_universal").read() == "global_step3"
    assert cli(["convert", f"{d}/ck2", f"{d}/uc2", "--to", "deepspeed-universal"]) == 2   # never overwrites
    uc = {"checkpoint": {"load_universal": True}}
    for world, targets in ((2, [(2, "bf16", 2), (1, "fp32", 0)]), (4, [(3, "bf16", 2), (1, "bf16", 2)])):
        runs = [dict(stage=t, dtype=dt, layers=3, seed=5, ds_extra=uc,
                     actions=[["load_native", f"{d}/uc{s}"], ["dump", f"U{t}{dt}{s}"], ["train", 2],
                              ["dump", f"UA{t}{dt}{s}"]]) for t, dt, s in targets]
        out = f"{d}/l{world}"
        check(launch(world, {"runs": runs}, out))
        for t, dt, s in targets:
            saved, got = load_file(f"{d}/S{s}.safetensors"), load_file(f"{out}/U{t}{dt}{s}.safetensors")
            for k in saved:
                if k.startswith(("master/", "optim/", "buffer/", "meta/lr", "meta/optim_step")):
                    assert torch.equal(saved[k], got[k]), (t, dt, s, k)
                if k.startswith("model/"):
                    assert torch.equal(got[k], saved[k.replace("model/", "master/")].to(got[k].dtype)), k
            assert got["meta/global_steps"].tolist()[0] == 3
    # same layout as saved: training continues bit-identically
    after, resumed = load_file(f"{d}/A2.safetensors"), load_file(f"{d}/l2/UA2bf162.safetensors")
    for k in after:
        assert torch.equal(after[k], resumed[k]), k
