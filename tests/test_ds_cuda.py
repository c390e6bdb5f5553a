"""DeepSpeed on a GPU (CUDA accelerator, NCCL, one rank): what only a device can show.

- An asynchronous save (writer process, pinned shared staging; writer thread, pinned staging)
  holds exactly the state at the call, although training changes it on the GPU right after:
  the device-to-host copies are waited for by a CUDA event, not by luck.
- A synchronous save, and loads into other ZeRO stages.
- Online deltas: gradients staged from the GPU by non-blocking copies replay to exactly the
  recorded run's state.
- Training goes on after a load (ZeRO-2 fp32 and bf16 sync saves, a ZeRO-1 bf16 async save, each
  loaded in its own stage) with the losses of the uninterrupted run.
- The partitioned exchange (format 5) saves asynchronously from the GPU and loads into ZeRO-3; online
  deltas staged from the GPU into the memory tier survive a SIGKILL and recover from it exactly.

The oracles are the state DeepSpeed's own accessors return at each point (ds_worker's dumps)
and the uninterrupted runs' losses.
Skipped without CUDA (CI has none); the sessions that get a GPU run it."""
import os

import pytest
import torch
from safetensors.torch import load_file

from launch import check, launch
from test_ds_integration import assert_same, results

pytestmark = [pytest.mark.timeout(900), pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def dump(d, name):
    return load_file(os.path.join(d, f"{name}.safetensors"))


def test_async_sync_and_online_saves_on_the_gpu_load_exactly(tmp_path):
    d = str(tmp_path)
    ck, ck3, cky, ckb, on = f"{d}/ck", f"{d}/ck3", f"{d}/cky", f"{d}/ckb", f"{d}/online"
    async_process = {"enabled": True, "async": True, "async_writer": "process"}
    async_thread = {"enabled": True, "async": True, "async_writer": "thread"}
    online = {"enabled": True, "save_dir": on, "online": {"enabled": True, "base_interval": 3}}
    runs = [
        {"stage": 1, "dtype": "bf16", "hidden": 512, "layers": 3, "adacheck": async_process,
         "actions": [["train", 2], ["dump", "S2"], ["save", ck], ["train", 1], ["dump", "S3"], ["save", ck],
                     ["train", 1], ["finish"], ["latest", ck]]},
        {"stage": 3, "dtype": "bf16", "hidden": 512, "layers": 3, "adacheck": async_thread,
         "actions": [["train", 2], ["dump", "T2"], ["save", ck3], ["train", 1], ["finish"]]},
        {"stage": 2, "dtype": "fp32", "hidden": 512, "layers": 3, "adacheck": {"enabled": True},
         "actions": [["train", 2], ["dump", "Y2"], ["save", cky], ["train", 2]]},
        {"stage": 2, "dtype": "bf16", "hidden": 512, "layers": 3, "adacheck": online,
         "actions": [["train_dump", 5, "O"]]},
        # new engines (seed 7: other initial weights) load each checkpoint, in other ZeRO stages
        {"stage": 3, "dtype": "bf16", "hidden": 512, "layers": 3, "seed": 7, "adacheck": {"enabled": True},
         "actions": [["load", ck, {"tag": "global_step2"}], ["dump", "L2"], ["load", ck], ["dump", "L3"]]},
        {"stage": 1, "dtype": "bf16", "hidden": 512, "layers": 3, "seed": 7, "adacheck": {"enabled": True},
         "actions": [["load", ck3], ["dump", "LT2"]]},
        {"stage": 1, "dtype": "fp32", "hidden": 512, "layers": 3, "seed": 7, "adacheck": {"enabled": True},
         "actions": [["load", cky], ["dump", "LY2"]]},
        {"stage": 2, "dtype": "bf16", "hidden": 512, "layers": 3, "seed": 7, "adacheck": {"enabled": True},
         "actions": [["load", on], ["steps"], ["dump", "LO"]]},
        # continued training in the saving stage: the losses of the uninterrupted runs
        {"stage": 2, "dtype": "fp32", "hidden": 512, "layers": 3, "seed": 7, "adacheck": {"enabled": True},
         "actions": [["load", cky], ["train", 2]]},
        {"stage": 1, "dtype": "bf16", "hidden": 512, "layers": 3, "seed": 7, "adacheck": {"enabled": True},
         "actions": [["load", ck, {"tag": "global_step2"}], ["train", 2]]},
        # ZeRO-2 bf16: save, load, resume
        {"stage": 2, "dtype": "bf16", "hidden": 512, "layers": 3, "adacheck": {"enabled": True},
         "actions": [["train", 2], ["save", ckb], ["train", 2]]},
        {"stage": 2, "dtype": "bf16", "hidden": 512, "layers": 3, "seed": 7, "adacheck": {"enabled": True},
         "actions": [["load", ckb], ["train", 2]]},
    ]
    check(launch(1, {"runs": runs}, d, device="cuda"))
    res = results(d)
    assert res[0]["finished"] == ["global_step3"] and res[0]["latest"] == ["global_step3"], res[0]
    assert res[7]["steps"][0] == 5, res[7]
    assert len(res[2]["losses"]) == 4 and res[8]["losses"] == res[2]["losses"][2:], (res[2], res[8])
    assert len(res[0]["losses"]) == 4 and res[9]["losses"] == res[0]["losses"][2:], (res[0], res[9])
    assert len(res[10]["losses"]) == 4 and res[11]["losses"] == res[10]["losses"][2:], (res[10], res[11])
    for saved, loaded in (("S2", "L2"), ("S3", "L3"), ("T2", "LT2"), ("Y2", "LY2"), ("O5", "LO")):
        a, b = dump(d, saved), dump(d, loaded)
        keys = [k for k in a if k.startswith(("model/", "master/", "optim/"))]
        assert keys, saved
        assert_same(a, b, keys)
        assert b["meta/optim_step"].tolist() == a["meta/optim_step"].tolist(), saved


def test_partitioned_save_and_memory_tier_deltas_on_the_gpu(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "cuda-tiers")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    ckp, mo = f"{d}/ckp", f"{d}/mo"
    parted = {"enabled": True, "async": True, "exchange": "partitioned"}
    tiered = {"enabled": True, "save_dir": mo, "online": {"enabled": True, "base_interval": 3},
              "tiers": {"memory": True, "persist_interval": 4}}
    model = {"stage": 2, "dtype": "bf16", "hidden": 512, "layers": 3}
    runs = [dict(model, stage=1, adacheck=parted, actions=[["train", 2], ["dump", "P2"], ["save", ckp], ["train", 1],
                                                           ["finish"]]),
            dict(model, stage=3, seed=7, adacheck={"enabled": True}, actions=[["load", ckp], ["dump", "LP2"]]),
            # deltas into memory only (no base is persisted before step 8): killed after step 5
            dict(model, adacheck=tiered, actions=[["train_dump", 5, "M"], ["finish"], ["die"]])]
    out = launch(1, {"runs": runs}, f"{d}/a", device="cuda")
    assert out[0][0] == -9, out[0][1][-3000:]
    assert open(f"{ckp}/latest").read().strip() == "global_step2"
    assert any(n.startswith("manifest-g") and "-rank-" in n for n in os.listdir(f"{ckp}/global_step2")), \
        os.listdir(f"{ckp}/global_step2")              # (format 5: a rank file)
    assert not os.path.exists(f"{mo}/latest")          # (nothing of the online run is durable yet)
    out = launch(1, {"runs": [dict(model, seed=7, adacheck=tiered, actions=[["load", mo], ["steps"], ["dump", "L"]])]},
                 f"{d}/b", device="cuda")
    check(out)
    assert "from the memory tier" in out[0][1], out[0][1][-3000:]
    assert results(f"{d}/b")[0]["steps"][0] == 5
    for (sd, saved), (ld, loaded) in (((f"{d}/a", "P2"), (f"{d}/a", "LP2")), ((f"{d}/a", "M5"), (f"{d}/b", "L"))):
        a, b = dump(sd, saved), dump(ld, loaded)
        keys = [k for k in a if k.startswith(("model/", "master/", "optim/"))]
        assert keys, saved
        assert_same(a, b, keys)
        assert b["meta/optim_step"].tolist() == a["meta/optim_step"].tolist(), saved
