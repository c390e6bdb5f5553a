"""Megatron-DeepSpeed style tensor parallelism: DeepSpeed engines built with ``mpu=`` (real
engines on CPU, gloo), a column- and a row-parallel layer marked as Megatron marks them."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from launch import check, launch
from test_ds_integration import assert_same, results

pytestmark = pytest.mark.timeout(900)


def _stored(ckpt):
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    return man, {n: t for n, t in man["tensors"].items()}


def test_tensor_parallel_save_resume_and_reshard(tmp_path):
    """TP=2 x DP=2: resume is bit-identical; TP-replicated state is stored once; the checkpoint
    loads into TP=4, TP=1 and another ZeRO stage with every logical tensor equal."""
    d = str(tmp_path)
    layouts = [(1, "bf16"), (2, "fp32"), (3, "bf16")]
    runs = []
    for stage, dt in layouts:
        ck = f"{d}/ck{stage}{dt}"
        runs.append({"tp": 2, "stage": stage, "dtype": dt, "adacheck": {"enabled": True},
                     "actions": [["train", 3], ["save", ck], ["dump", f"S{stage}{dt}"], ["train", 2],
                                 ["dump", f"A{stage}{dt}"]]})
        runs.append({"tp": 2, "stage": stage, "dtype": dt, "seed": 9, "adacheck": {"enabled": True},
                     "actions": [["load", ck], ["train", 2], ["dump", f"B{stage}{dt}"]]})
    # another TP size and stage in the same 4 processes
    runs.append({"tp": 4, "stage": 2, "dtype": "bf16", "seed": 5, "adacheck": {"enabled": True},
                 "actions": [["load", f"{d}/ck1bf16"], ["dump", "T4"]]})
    check(launch(4, {"runs": runs}, d))
    res = results(d)
    for i, (stage, dt) in enumerate(layouts):
        assert res[2 * i]["losses"][3:] == res[2 * i + 1]["losses"], (stage, dt)
        assert_same(load_file(f"{d}/A{stage}{dt}.safetensors"), load_file(f"{d}/B{stage}{dt}.safetensors"))
        man, tensors = _stored(f"{d}/ck{stage}{dt}/global_step3")
        assert man["topology"]["world_size"] == 4
        assert man["framework"]["tp_world_size"] == 2
        # logical shapes are the full (unsplit) ones
        assert tensors["model/inp.weight"]["shape"] == [40, 12]
        assert tensors["model/out.weight"]["shape"] == [5, 40]
        s = load_file(f"{d}/S{stage}{dt}.safetensors")
        assert list(s["master/inp.weight"].shape) == [40, 12]
        # every box once: what TP ranks both hold (LayerNorm, out.bias) is not stored twice
        for name, t in tensors.items():
            keys = [b["key"] for b in t.get("boxes", [])]
            assert len(keys) == len(set(keys)), name
        norm = [b for b in tensors["master/norm.weight"]["boxes"]] if "master/norm.weight" in tensors else \
            tensors["model/norm.weight"]["boxes"]
        assert all(len(b["holders"]) >= 2 for b in norm), norm
    t4 = load_file(f"{d}/T4.safetensors")
    s = load_file(f"{d}/S1bf16.safetensors")
    assert_same(s, t4, [k for k in s if not k.startswith("meta/")])

    # the same checkpoints on 2 processes: TP=1 x DP=2, TP=2 x DP=1
    d2 = str(tmp_path / "two")
    runs = [{"tp": 1, "stage": 1, "dtype": "bf16", "seed": 3, "adacheck": {"enabled": True},
             "actions": [["load", f"{d}/ck1bf16"], ["dump", "T1"], ["save", f"{d2}/one"]]},
            {"tp": 2, "stage": 0, "dtype": "fp32", "seed": 3, "adacheck": {"enabled": True},
             "actions": [["load", f"{d}/ck2fp32"], ["dump", "T2"]]}]
    check(launch(2, {"runs": runs}, d2))
    t1 = load_file(f"{d2}/T1.safetensors")
    assert_same(s, t1, [k for k in s if not k.startswith("meta/")])
    s2 = load_file(f"{d}/S2fp32.safetensors")
    t2 = load_file(f"{d2}/T2.safetensors")
    assert_same(s2, t2, [k for k in s2 if not k.startswith("meta/")])
    assert res[-1]["errors"] == []
    # a TP=1 save of a model whose layers are marked (as Megatron marks them at any TP size)
    # records how they split, so it converts into TP=2 native files
    from adacheck.cli import main as cli
    man, _ = _stored(f"{d2}/one/global_step3")
    assert man["framework"]["tp_world_size"] == 1
    assert cli(["convert", f"{d2}/one", f"{d2}/n21", "--to", "deepspeed", "--tp", "2", "--dp", "1"]) == 0
    check(launch(2, {"runs": [{"tp": 2, "stage": 1, "dtype": "bf16", "seed": 4,
                               "actions": [["load_native", f"{d2}/n21"], ["dump", "T21"]]}]}, f"{d2}/l"))
    t21 = load_file(f"{d2}/l/T21.safetensors")
    assert_same(s, t21, [k for k in s if not k.startswith("meta/")])


def _online(ck, **kw):
    return {"enabled": True, "save_dir": ck, "online": dict({"enabled": True}, **kw)}


def test_tensor_parallel_online_deltas_recover_exactly(tmp_path):
    """TP=2 x DP=2 with online deltas (ZeRO-1 bf16, ZeRO-0 fp32): a new job replays base 4 +
    deltas 5, 6 to exactly the uninterrupted run's state; ZeRO-0's replicated gradients are
    written once per data-parallel group; both replay on TP=2 x DP=1 (ZeRO-1: each rank rebuilds
    the partitions its TP rank had on the two DP ranks and steps them with their records)."""
    from adacheck.online import deltas
    d = str(tmp_path)
    layouts = [(1, "bf16"), (0, "fp32")]
    runs = []
    for stage, dt in layouts:
        ck = f"{d}/ck{stage}{dt}"
        runs += [{"tp": 2, "stage": stage, "dtype": dt, "adacheck": _online(ck, base_interval=3),
                  "actions": [["train_dump", 6, f"A{stage}{dt}_"]]},
                 {"tp": 2, "stage": stage, "dtype": dt, "seed": 5, "adacheck": _online(ck, base_interval=3),
                  "actions": [["load", ck], ["steps"], ["dump", f"B{stage}{dt}"]]}]
    check(launch(4, {"runs": runs}, d))
    res = results(d)
    for i, (stage, dt) in enumerate(layouts):
        assert res[2 * i + 1]["steps"][0] == 6, (stage, dt)
        assert_same(load_file(f"{d}/A{stage}{dt}_6.safetensors"), load_file(f"{d}/B{stage}{dt}.safetensors"))
    steps, _ = deltas.committed_steps(f"{d}/ck0fp32/global_step4", 4, 4)
    recs = steps[0].records
    # keys name the TP rank; each DP group (ranks 0,2 and 1,3) writes its gradients once
    for tp in range(2):
        a, b = set(recs[tp]["tensors"]), set(recs[tp + 2]["tensors"])
        assert a and b and not a & b, (a, b)
        assert all(k.startswith(f"tp{tp}.") for k in a | b)
    d2 = str(tmp_path / "two")
    runs = [{"tp": 2, "stage": stage, "dtype": dt, "seed": 5, "adacheck": {"enabled": True},
             "actions": [["load", f"{d}/ck{stage}{dt}"], ["steps"], ["dump", f"C{stage}{dt}"]]}
            for stage, dt in layouts]
    check(launch(2, {"runs": runs}, d2))
    for i, (stage, dt) in enumerate(layouts):
        assert results(d2)[i]["steps"][0] == 6, (stage, dt)
        assert_same(load_file(f"{d}/A{stage}{dt}_6.safetensors"), load_file(f"{d2}/C{stage}{dt}.safetensors"))


def test_tensor_parallel_native_conversion_both_ways(tmp_path):
    """adacheck convert --to deepspeed --tp N writes mp_rank files that stock DeepSpeed engines of
    that TP size load (same layout: training continues bit-identically; TP=2 x DP=1 and TP=1:
    every logical tensor equal), and --to deepspeed-universal files a TP=2 engine's
    load_universal slices correctly (row-parallel along dimension 1); --from deepspeed reads DeepSpeed's own TP=2 save (split
    dimensions from the model's universal_checkpoint_info) into the same tensors as AdaCheck's."""
    from adacheck.checkpoint import CheckpointReader, resolve
    from adacheck.cli import main as cli
    d = str(tmp_path)
    check(launch(4, {"runs": [
        {"tp": 2, "stage": 1, "dtype": "bf16", "adacheck": {"enabled": True},
         "actions": [["train", 3], ["save", f"{d}/ck"], ["dump", "S"], ["train", 2], ["dump", "A"]]},
        {"tp": 2, "stage": 1, "dtype": "bf16",
         "actions": [["train", 3], ["save_native", f"{d}/nsrc"], ["dump", "N"]]}]}, d))
    for args in (["ck", "n22", "--to", "deepspeed"],
                 ["ck", "n21", "--to", "deepspeed", "--tp", "2", "--dp", "1", "--zero-stage", "2"],
                 ["ck", "n12", "--to", "deepspeed", "--tp", "1", "--dp", "2"],
                 ["nsrc", "back", "--from", "deepspeed", "--optimizer", "torch.optim.AdamW"],
                 ["ck", "uc", "--to", "deepspeed-universal"]):
        assert cli(["convert", f"{d}/{args[0]}", f"{d}/{args[1]}", *args[2:]]) == 0, args
    assert sorted(f for f in os.listdir(f"{d}/n22/global_step3") if f.startswith("mp_rank")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert cli(["convert", f"{d}/ck", f"{d}/x", "--to", "deepspeed", "--tp", "3"]) == 2   # 40 % 3 != 0
    assert not os.path.exists(f"{d}/x")
    check(launch(4, {"runs": [
        {"tp": 2, "stage": 1, "dtype": "bf16", "seed": 7,
         "actions": [["load_native", f"{d}/n22"], ["train", 2], ["dump", "B"]]},
        {"tp": 2, "stage": 1, "dtype": "bf16", "seed": 7, "ds_extra": {"checkpoint": {"load_universal": True}},
         "actions": [["load_native", f"{d}/uc"], ["dump", "U"]]}]}, f"{d}/l4"))
    check(launch(2, {"runs": [
        {"tp": 2, "stage": 2, "dtype": "bf16", "seed": 7, "actions": [["load_native", f"{d}/n21"], ["dump", "L21"]]},
        {"tp": 1, "stage": 1, "dtype": "bf16", "seed": 7, "actions": [["load_native", f"{d}/n12"], ["dump", "L12"]]},
    ]}, f"{d}/l2"))
    assert results(d)[0]["losses"][3:] == results(f"{d}/l4")[0]["losses"]
    assert_same(load_file(f"{d}/A.safetensors"), load_file(f"{d}/l4/B.safetensors"))
    s = load_file(f"{d}/S.safetensors")
    for got in ("l2/L21", "l2/L12", "l4/U"):
        assert_same(s, load_file(f"{d}/{got}.safetensors"), [k for k in s if k != "meta/global_steps"])
    # DeepSpeed's own TP=2 files -> AdaCheck: the tensors AdaCheck's own save of that state holds
    a, b = CheckpointReader(resolve(f"{d}/ck")), CheckpointReader(resolve(f"{d}/back"))
    assert b.manifest.framework["tp_world_size"] == 2
    state = {n for n in a.manifest.tensors if not n.startswith("object/client_state/")}   # the save's own
    assert state == set(b.manifest.tensors)
    for n in state:
        if "/rng/" not in n:
            assert torch.equal(a.read(n), b.read(n)), n


def test_split_dimensions_of_native_files_come_from_the_models_patterns():
    """Native files do not say how parameters are split: DeepSpeed's universal-checkpoint
    patterns do, and anything they cannot express is refused with what to do instead."""
    from adacheck.errors import StateError
    from adacheck_ds.native_spec import split_from_patterns
    names = ["emb.weight", "l0.qkv.weight", "l0.proj.weight", "l0.proj.bias", "l0.norm.weight"]
    info = {"tp_replicated_parameter_patterns": [r".*\.proj\.bias$", r".*norm\."],
            "parameter_with_row_parallelism_patterns": [r".*\.proj\.weight$"]}
    assert split_from_patterns(names, info, "x") == {"emb.weight": 0, "l0.qkv.weight": 0, "l0.proj.weight": 1}
    with pytest.raises(StateError, match="without universal_checkpoint_info.*save once"):
        split_from_patterns(names, None, "x")
    with pytest.raises(StateError, match="parameter_with_2_sub_params_cat_dim_0.*qkv"):
        split_from_patterns(names, dict(info, parameter_with_2_sub_params_cat_dim_0=[r".*qkv"]), "x")
