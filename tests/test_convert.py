"""adacheck convert --to weights: full weights as standard safetensors, loaded by torch."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from adacheck.cli import main as cli
from ds_worker import Net
from launch import check, launch

# tied weights: one nn.Parameter under two names, as a GPT-2's lm_head.weight is its
# transformer.wte.weight (named_parameters() lists it once, state_dict() under both names)
TIE = [["mid.1.weight", "mid.0.weight"]]


def test_weights_export_loads_into_the_module(tmp_path):
    d = str(tmp_path)
    runs = [{"stage": 3, "dtype": "bf16", "layers": 3, "adacheck": {"enabled": True},
             "actions": [["train", 2], ["save", f"{d}/ck"], ["dump", "S"]]}]
    check(launch(2, {"runs": runs}, d))
    saved = load_file(f"{d}/S.safetensors")
    assert cli(["convert", f"{d}/ck", f"{d}/w"]) == 0
    assert cli(["convert", f"{d}/ck", f"{d}/w32", "--dtype", "fp32", "--max-shard-size", "3KB"]) == 0
    assert cli(["convert", f"{d}/ck", f"{d}/w16", "--dtype", "fp16"]) == 0    # (cast from the fp32 masters)
    for out, prefix, dtype in ((f"{d}/w", "model/", torch.bfloat16), (f"{d}/w32", "master/", torch.float32),
                               (f"{d}/w16", "master/", torch.float16)):
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
    for s, _ in sources:     # the model-states file's module: the saved module weights and buffers, as torch reads it
        states = torch.load(f"{d}/uc{s}/global_step3/mp_rank_00_model_states.pt", weights_only=True)
        saved = load_file(f"{d}/S{s}.safetensors")
        want = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith(("model/", "buffer/"))}
        assert sorted(states["module"]) == sorted(want)
        for k, v in want.items():
            assert states["module"][k].dtype == v.dtype and torch.equal(states["module"][k], v), (s, k)
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


@pytest.mark.timeout(1500)     # (11 conversions, each starting DeepSpeed ranks: 100-340 s on 2 idle cores)
def test_native_deepspeed_files_for_any_layout_and_back(tmp_path, monkeypatch, capsys):
    """adacheck convert --to deepspeed / --from deepspeed / --to adacheck: DeepSpeed itself writes
    and reads the native files in the target layout.  Stock engine.load_checkpoint of the
    converted files gives every logical tensor of the saved state (ZeRO-2 -> 2 and -> 3 at DP=4,
    ZeRO-0 fp32 -> ZeRO-1), training continues bit-identically, native -> AdaCheck -> native and
    AdaCheck -> native -> AdaCheck are exact, and online deltas are materialised first (also
    into another layout).  Tied weights: the native files hold every name of the tied weight
    and DeepSpeed's shared_params, as DeepSpeed's own save of the same state does, stock
    DeepSpeed loads them (strict), and stock DeepSpeed's native save of a tied model converts
    to AdaCheck; each continues with the uninterrupted run's losses and state.  Nothing
    existing is overwritten."""
    d = str(tmp_path)
    on = {"enabled": True, "save_dir": f"{d}/on", "online": {"enabled": True, "base_interval": 100}}
    check(launch(2, {"runs": [
        dict(stage=2, dtype="bf16", layers=3, frozen=["norm"], adacheck={"enabled": True},
             actions=[["train", 3], ["save", f"{d}/ck2"], ["dump", "S2"], ["train", 2], ["dump", "A2"]]),
        dict(stage=0, dtype="fp32", layers=3, adacheck={"enabled": True},
             actions=[["train", 3], ["save", f"{d}/ck0"], ["dump", "S0"]]),
        dict(stage=1, dtype="bf16", layers=3, optimizer="ds_adam",
             actions=[["train", 3], ["save_native", f"{d}/nsrc"], ["dump", "N1"], ["train", 2], ["dump", "NA1"]]),
        dict(stage=1, dtype="bf16", layers=3, adacheck=on, actions=[["train_dump", 5, "O_"]]),
        # tied weights: AdaCheck's and DeepSpeed's own save of the same state
        dict(stage=2, dtype="bf16", layers=3, tie=TIE, adacheck={"enabled": True},
             actions=[["train", 3], ["save", f"{d}/ckt"], ["save_native", f"{d}/nsrct"],
                      ["dump", "ST"], ["train", 2], ["dump", "AT"]]),
    ]}, d))
    conv = [(["ck2", "nat2", "--to", "deepspeed"]),
            (["ck2", "nat34", "--to", "deepspeed", "--zero-stage", "3", "--dp", "4"]),
            (["ck0", "nat1", "--to", "deepspeed", "--zero-stage", "1"]),
            (["nsrc", "back", "--from", "deepspeed"]),
            (["back", "nsrc2", "--to", "deepspeed"]),
            (["nat2", "back2", "--from", "deepspeed", "--optimizer", "torch.optim.AdamW"]),   # a client optimizer
            (["ckt", "natt", "--to", "deepspeed"]),                 # tied weights, both ways
            (["nsrct", "backt", "--from", "deepspeed", "--optimizer", "torch.optim.AdamW"]),
            (["on", "onm", "--to", "adacheck"]),                                      # deltas -> one base
            (["on", "on3", "--to", "adacheck", "--step", "3"]),                       # or a chosen step
            (["on", "onn", "--to", "deepspeed", "--zero-stage", "3", "--dp", "4"])]  # via the saving layout
    monkeypatch.setenv("ADACHECK_PROGRESS", "1")      # (the progress bar, also without a terminal)
    for args in conv:
        assert cli(["convert", f"{d}/{args[0]}", f"{d}/{args[1]}", *args[2:]]) == 0, args
        err = capsys.readouterr().err       # each run of DeepSpeed ranks reports its 4 phases as they end
        runs = 2 if args[1] == "onn" else 1     # (deltas into another layout: materialised first)
        assert err.count("convert:   0%") == runs and err.count(" 4/4 ") >= runs, (args, err[-2000:])
        assert err.count("convert: starting ranks") >= runs, (args, err[-2000:])   # (a bar from the start)
        assert "committed online steps" not in err, (args, err[-2000:])   # (these replay them: no note)
    monkeypatch.delenv("ADACHECK_PROGRESS")
    # a format that does not replay the deltas holds the base's step, and says so
    assert cli(["convert", f"{d}/on", f"{d}/onw"]) == 0
    err = capsys.readouterr().err
    assert "(step 1) of 4 committed online steps (to step 5); the conversion holds the base's step" in err, err
    assert open(f"{d}/nat2/latest").read() == "global_step3"
    # tied weights: the module state and shared_params DeepSpeed's own save of the state writes
    ours, stock = (torch.load(f"{d}/{n}/global_step3/mp_rank_00_model_states.pt",
                              weights_only=True) for n in ("natt", "nsrct"))
    assert stock["shared_params"] == {"mid.1.weight": "mid.0.weight"}
    assert ours["shared_params"] == stock["shared_params"]
    assert ours["param_shapes"] == stock["param_shapes"]
    assert set(ours["module"]) == set(stock["module"])
    for k, v in stock["module"].items():
        assert ours["module"][k].dtype == v.dtype and torch.equal(ours["module"][k], v), k
    # (one base; the save directory also holds AdaCheck's README and zero_to_fp32.py)
    assert [f for f in sorted(os.listdir(f"{d}/onm")) if f.startswith("global")] == ["global_step5"]
    assert open(f"{d}/onm/latest").read().strip() == "global_step5"
    # never overwrites, and bad requests are refused before anything is written
    before = sorted(os.listdir(f"{d}/nat2/global_step3"))
    assert cli(["convert", f"{d}/ck2", f"{d}/nat2", "--to", "deepspeed"]) == 2
    assert sorted(os.listdir(f"{d}/nat2/global_step3")) == before and not [
        f for f in os.listdir(f"{d}/nat2") if f.startswith(".")]
    assert cli(["convert", f"{d}/nsrc", f"{d}/x", "--from", "deepspeed", "--dp", "3"]) == 2
    assert cli(["convert", f"{d}/S2.safetensors", f"{d}/x", "--from", "deepspeed"]) == 2
    assert cli(["convert", f"{d}/nat2", f"{d}/x", "--from", "deepspeed"]) == 2   # which optimizer?
    assert cli(["convert", f"{d}/on", f"{d}/x", "--to", "adacheck", "--step", "9"]) == 2   # not recorded
    assert not os.path.exists(f"{d}/x")
    # AdaCheck -> native -> AdaCheck: the same tensors
    from adacheck.checkpoint import CheckpointReader, resolve
    a, b = CheckpointReader(resolve(f"{d}/ck2")), CheckpointReader(resolve(f"{d}/back2"))
    assert set(a.manifest.tensors) == set(b.manifest.tensors)
    for n in a.manifest.tensors:
        if "/rng/" not in n:   # DeepSpeed's native files hold no RNG state (the new one is the converter's)
            assert torch.equal(a.read(n), b.read(n)), n
    # stock DeepSpeed loads the native files
    check(launch(2, {"runs": [
        dict(stage=2, dtype="bf16", layers=3, frozen=["norm"], seed=7,
             actions=[["load_native", f"{d}/nat2"], ["dump", "L2"], ["train", 2], ["dump", "LA2"]]),
        dict(stage=1, dtype="fp32", layers=3, seed=7, actions=[["load_native", f"{d}/nat1"], ["dump", "L1"]]),
        dict(stage=1, dtype="bf16", layers=3, optimizer="ds_adam", seed=7,
             actions=[["load_native", f"{d}/nsrc2"], ["dump", "LN1"], ["train", 2], ["dump", "LNA1"]]),
        dict(stage=1, dtype="bf16", layers=3, seed=7, adacheck={"enabled": True},
             actions=[["load", f"{d}/onm"], ["dump", "LM"]]),
        dict(stage=1, dtype="bf16", layers=3, seed=7, adacheck={"enabled": True},
             actions=[["load", f"{d}/on3"], ["dump", "LM3"]]),
        dict(stage=2, dtype="bf16", layers=3, tie=TIE, seed=7,   # stock load_checkpoint (strict)
             actions=[["load_native", f"{d}/natt"], ["dump", "LT"], ["train", 2],
                      ["dump", "LAT"]]),
        dict(stage=2, dtype="bf16", layers=3, tie=TIE, seed=7, adacheck={"enabled": True},
             actions=[["load", f"{d}/backt"], ["dump", "LBT"], ["train", 2], ["dump", "LBAT"]]),
    ]}, f"{d}/l2"))
    check(launch(4, {"runs": [
        dict(stage=3, dtype="bf16", layers=3, frozen=["norm"], seed=7,
             actions=[["load_native", f"{d}/nat34"], ["dump", "L34"]]),
        dict(stage=3, dtype="bf16", layers=3, seed=7, actions=[["load_native", f"{d}/onn"], ["dump", "LO"]]),
    ]}, f"{d}/l4"))
    for ref, got in (("S2", "l2/L2"), ("A2", "l2/LA2"), ("S0", "l2/L1"), ("N1", "l2/LN1"), ("NA1", "l2/LNA1"),
                     ("S2", "l4/L34"), ("O_5", "l2/LM"), ("O_3", "l2/LM3"), ("O_5", "l4/LO"),
                     ("ST", "l2/LT"), ("AT", "l2/LAT"), ("ST", "l2/LBT"), ("AT", "l2/LBAT")):
        saved, loaded = load_file(f"{d}/{ref}.safetensors"), load_file(f"{d}/{got}.safetensors")
        assert set(saved) == set(loaded), (ref, got)
        for k in saved:
            assert torch.equal(saved[k], loaded[k]), (ref, got, k)
    # the tied runs' next losses: those of the uninterrupted run
    trained = json.load(open(f"{d}/result-rank0.json"))[4]["losses"]
    resumed = json.load(open(f"{d}/l2/result-rank0.json"))
    assert resumed[5]["losses"] == resumed[6]["losses"] == trained[3:], (trained, resumed[5:])


def test_shell_module_rebuilds_parameter_order_and_refuses_impossible_orders():
    """The shell DeepSpeed is built around has the recorded parameters in module order (what
    DeepSpeed flattens and partitions by); an order no module tree yields is refused."""
    import pytest
    from adacheck.errors import StateError
    from adacheck_ds.native import shell_module
    from adacheck_ds.native_spec import ModelSpec
    net = Net(37, 3).to(torch.bfloat16)
    params = [(n, tuple(p.shape), "bfloat16", not n.startswith("norm")) for n, p in net.named_parameters()]
    buffers = [(n, tuple(b.shape), "float32") for n, b in net.named_buffers()]
    shell = shell_module(ModelSpec(params, buffers, [[p[0] for p in params]], None, {}))
    assert [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in shell.named_parameters()] == \
        [(n, s, torch.bfloat16, t) for n, s, _, t in params]
    assert [n for n, _ in shell.named_buffers()] == [n for n, _ in net.named_buffers()]
    assert set(shell.state_dict()) == set(net.state_dict())
    with pytest.raises(StateError, match="module tree"):
        shell_module(ModelSpec([("a.w", (2,), "float32", True), ("b", (2,), "float32", True)], [], [], None, {}))


def test_tied_weights_are_found_in_native_files_and_rebuilt_as_one_parameter(tmp_path):
    """A tied weight (a GPT-2's lm_head.weight is its wte.weight) is one nn.Parameter under two
    names: the shell registers that one Parameter under both (its state_dict() then holds the
    model's names, and DeepSpeed's save writes them), and the tied names of a native module
    state dict come from DeepSpeed's shared_params, or where DeepSpeed writes none (no ZeRO)
    from torch.save storing the tensor once."""
    import pytest
    from adacheck.errors import StateError
    from adacheck_ds.native import shell_module
    from adacheck_ds.native_spec import ModelSpec, native_aliases
    from adacheck_ds.state import tied_parameters

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(11, 4)
            self.ln = torch.nn.LayerNorm(4)
            self.lm_head = torch.nn.Linear(4, 11, bias=False)
            self.lm_head.weight = self.wte.weight

    lm = LM()
    tied = {"lm_head.weight": "wte.weight"}
    assert tied_parameters(lm) == tied and tied_parameters(Net(37, 3)) == {}
    torch.save(lm.state_dict(), tmp_path / "module.pt")     # what a native file's "module" holds
    module = torch.load(tmp_path / "module.pt", weights_only=True)
    assert list(module) == ["wte.weight", "ln.weight", "ln.bias", "lm_head.weight"]
    assert native_aliases(module, None, set()) == tied
    assert native_aliases(module, {}, set()) == {}          # DeepSpeed's record, where written
    params = [(n, tuple(p.shape), "float32", True) for n, p in lm.named_parameters()]
    shell = shell_module(ModelSpec(params, [], [[p[0] for p in params]], None, {}, shared=tied))
    assert shell.lm_head.weight is shell.wte.weight
    assert list(shell.state_dict()) == list(lm.state_dict()) and tied_parameters(shell) == tied
    with pytest.raises(StateError, match="tied weight"):
        shell_module(ModelSpec(params, [], [], None, {}, shared={"lm_head.weight": "head.weight"}))
    with pytest.raises(StateError, match="damaged"):
        native_aliases(module, {"lm_head.weight": "head.weight"}, set())
