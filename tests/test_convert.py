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
