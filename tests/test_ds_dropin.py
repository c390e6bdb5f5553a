"""Layouts DeepSpeed's own checkpoint tests use that the other DeepSpeed tests do not (issue 61),
with real engines (CPU, gloo, 2 processes; tests/dropin_worker.py).  The oracle is DeepSpeed's
native save and load of the same step, and the uninterrupted run.

- ZeRO-0 with DeepSpeed's fused Adam (the config's "Adam") and bf16 or fp16: FP16_Optimizer,
  one flat fp32 master per param group.
- An optimizer whose state holds tensors that are neither shaped like what it steps nor scalars
  (DeepSpeed's HybridStateOptimizer: a 1-element ``tensor_step`` and a Python int).
- DeepSpeed's "checkpoint" config section, its universal conversion, and the arguments of
  save_checkpoint / load_checkpoint, each judged by DeepSpeed's own behaviour.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from launch import check, launch
from test_ds_integration import assert_same, results

from adacheck.online import deltas

pytestmark = pytest.mark.timeout(900)


def raw(d, name, rank):
    return load_file(os.path.join(d, f"{name}-rank{rank}.safetensors"))


def resume_runs(d, name, run):
    """Train 3, save with AdaCheck and natively, train 2; a new job loads each and trains 2.
    (DeepSpeed's safe_get_full_* API, which the logical dumps use, knows no optimizer state
    but Adam's: the other runs compare the raw per-rank state only.)"""
    ck, nat = f"{d}/{name}", f"{d}/{name}-native"

    def dump(to):
        return [["dump", to]] if run.get("optimizer") != "hybrid" else []
    return [dict(run, adacheck={"enabled": True},
                 actions=[["kind"], ["train", 3], ["save", ck], ["save_native", nat], ["train", 2],
                          *dump(f"{name}-A"), ["raw", f"{name}-A"]]),
            dict(run, seed=7, adacheck={"enabled": True},
                 actions=[["load", ck], ["raw", f"{name}-B3"], ["train", 2], *dump(f"{name}-B"),
                          ["raw", f"{name}-B"]]),
            dict(run, seed=7, actions=[["load_native", nat], ["raw", f"{name}-C3"], ["train", 2]])]


def check_resumes(d, name, first, logical=True):
    """The three runs of resume_runs, from results' index ``first`` (``logical``: with dumps)."""
    a, b, c = results(d)[first: first + 3]
    assert b["losses"] == a["losses"][3:] == c["losses"], name
    if logical:
        assert_same(load_file(f"{d}/{name}-A.safetensors"), load_file(f"{d}/{name}-B.safetensors"))
    for rank in (0, 1):
        # what AdaCheck's load put in the engine is what DeepSpeed's own load puts there
        assert_same(raw(d, f"{name}-B3", rank), raw(d, f"{name}-C3", rank))
        assert_same(raw(d, f"{name}-A", rank), raw(d, f"{name}-B", rank))
        ours, theirs = (results(d, rank)[first + i]["types"] for i in (1, 2))
        assert ours[f"{name}-B3"] == theirs[f"{name}-C3"], name


# DeepSpeed's CPU kernel of its fused Adam keeps beta1^step and beta2^step in the process, multiplied
# by beta once a step, and takes pow(beta, step) after a jump (a resumed job's first step):
# betas whose powers are exact in float32 make both the same, as the CUDA kernel's always are
EXACT_ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01, "betas": [0.5, 0.75]}}}
FUSED = {"bf16": dict(stage=0, dtype="bf16", optimizer="ds_adam", ds_extra=EXACT_ADAM),
         "fp16": dict(stage=0, dtype="fp16", optimizer="ds_adam", ds_extra=EXACT_ADAM)}


def test_zero0_fused_optimizer_resumes_as_deepspeed_does(tmp_path):
    """ZeRO-0 bf16 / fp16 with DeepSpeed's Adam (FP16_Optimizer): AdaCheck stores each parameter's
    master and moments cut from the flat groups (the module weights as proven casts of them); its
    load puts in every rank's engine what DeepSpeed's native load of the same step puts there, and
    training goes on bit-identically."""
    d = str(tmp_path)
    runs = [r for name, run in FUSED.items() for r in resume_runs(d, name, run)]
    check(launch(2, {"runs": runs}, d, script="dropin_worker.py"))
    res = results(d)
    for i, name in enumerate(FUSED):
        assert res[3 * i]["kind"] == ["FP16_Optimizer"], res[3 * i]["kind"]
        check_resumes(d, name, 3 * i)
        man = json.load(open(f"{d}/{name}/global_step3/manifest.json"))["tensors"]
        assert {n.split("/")[0] for n in man} >= {"model", "master", "optim"}, name
        assert all("derived" in t for n, t in man.items() if n.startswith("model/")), name
        assert man["optim/exp_avg/inp.weight"]["shape"] == [37, 12]


def online(ck, **kw):
    return {"enabled": True, "save_dir": ck, "online": dict({"enabled": True}, **kw)}


def test_zero0_fused_optimizer_online_replay(tmp_path):
    """Online deltas of ZeRO-0 with FP16_Optimizer (bf16 with gradient clipping on every step:
    the gradients are recorded before it scales them, in bf16, and the replay scales them with its
    own code; fp16 with its dynamic loss scale: recorded once unscaled): base 4 + deltas 5 and 6
    give the uninterrupted run's state at step 6 and its next losses."""
    d = str(tmp_path)
    runs = []
    for name, run in FUSED.items():
        run = dict(run, ds_extra=dict(EXACT_ADAM, gradient_clipping=1e-3))
        ck = f"{d}/ck{name}"
        runs += [dict(run, actions=[["train", 8]]),
                 dict(run, adacheck=online(ck, base_interval=3), actions=[["train_dump", 6, f"{name}-A"]]),
                 dict(run, seed=5, adacheck=online(ck, base_interval=3),
                      actions=[["load", ck], ["steps"], ["dump", f"{name}-B"], ["train", 2]])]
    check(launch(2, {"runs": runs}, d, script="dropin_worker.py"))
    res = results(d)
    for i, name in enumerate(FUSED):
        ref, a, b = res[3 * i: 3 * i + 3]
        assert a["losses"] == ref["losses"][:6], name
        assert b["steps"][0] == 6, name
        assert_same(load_file(f"{d}/{name}-A6.safetensors"), load_file(f"{d}/{name}-B.safetensors"))
        assert b["losses"] == ref["losses"][6:8], name
        steps, _ = deltas.committed_steps(f"{d}/ck{name}/global_step4", 4, 2)
        assert [st.step for st in steps] == [5, 6], name
        for st in steps:
            stored = {m["stored"] for r in st.records.values() for m in r["tensors"].values()}
            pre = [deltas.read_extra(f"{d}/ck{name}/global_step4", st, r)["preclip"] for r in (0, 1)]
            if name == "bf16":   # before FP16_Optimizer clipped them: exact bf16 sums, 2 bytes each
                assert stored == {"bfloat16"} and all(pre), (stored, pre)
            else:                # fp16: after it unscaled them (its dynamic loss scale is not replayed)
                assert stored == {"float32"} and not any(pre), (stored, pre)


HYBRID = {f"hybrid{stage}{dtype}": dict(stage=stage, dtype=dtype, optimizer="hybrid")
          for stage, dtype in ((0, "fp32"), (1, "bf16"), (2, "fp32"))}


def test_optimizer_state_neither_parameter_shaped_nor_scalar(tmp_path):
    """HybridStateOptimizer's ``tensor_step`` (a 1-element tensor) and ``integer_step`` (an int),
    at ZeRO-0, ZeRO-1 and ZeRO-2: stored whole with each parameter, loaded back as DeepSpeed's
    native load has them (the same tensors, the same Python types), training goes on identically."""
    d = str(tmp_path)
    runs = [r for name, run in HYBRID.items() for r in resume_runs(d, name, run)]
    # a state tensor shaped like a parameter but not like the flat partition it belongs to would
    # read back as that parameter's elements: refused
    runs.append(dict(stage=1, dtype="bf16", optimizer="hybrid", odd_shape=[37], adacheck={"enabled": True},
                     actions=[["train", 1], ["expect_error", "cannot tell whether it is per element",
                                             "save", f"{d}/odd"]]))
    check(launch(2, {"runs": runs}, d, script="dropin_worker.py"))
    res = results(d)
    assert "optimizer state 'odd' of inp.bias has the parameter's shape [37]" in res[-1]["errors"][0]
    for i, name in enumerate(HYBRID):
        check_resumes(d, name, 3 * i, logical=False)
        b3 = raw(d, f"{name}-B3", 0)
        assert torch.equal(b3["state/0/tensor_step"], torch.tensor([3.0])), name
        assert results(d)[3 * i + 1]["types"][f"{name}-B3"]["0/integer_step"] == "int"
        man = json.load(open(f"{d}/{name}/global_step3/manifest.json"))["tensors"]
        assert man["optim/tensor_step/inp.weight"]["shape"] == [1], name
    # DeepSpeed's universal format has no place for them: the conversion says so
    from adacheck.errors import StateError
    from adacheck_ds.convert import to_universal
    with pytest.raises(StateError, match="'tensor_step' of .* is one \\[1\\] tensor for the whole tensor"):
        to_universal(f"{d}/hybrid1bf16", f"{d}/universal")


def universal(src_dir, tag):
    """DeepSpeed's universal conversion as its tests call it (ds_to_universal.main), with
    adacheck_ds imported (inject_missing_state: the native save has no universal_checkpoint_info)."""
    import adacheck_ds  # noqa: F401
    from deepspeed.checkpoint import ds_to_universal
    ds_to_universal.main(SimpleNamespace(input_folder=f"{src_dir}/{tag}", output_folder=f"{src_dir}/{tag}_universal",
                                         num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                         strict=True, inject_missing_state=True))


def test_checkpoint_section_and_deepspeed_universal_conversion(tmp_path):
    """DeepSpeed's "checkpoint" section with AdaCheck: use_node_local_storage is refused at
    deepspeed.initialize, before DeepSpeed builds anything; parallel_write.pipeline_stage saves
    as always; DeepSpeed's ds_to_universal.main converts an AdaCheck checkpoint (through
    AdaCheck's converter), and an engine with load_universal and no tag loads what
    latest_universal names, as DeepSpeed does (through DeepSpeed's own load, also when another
    decorator wraps the engine's load_checkpoint, and at ZeRO-3 without optimizer states): the
    same state as DeepSpeed's own conversion and load of a native save of the same step, and the
    same next losses."""
    d = str(tmp_path)
    ck, nat = f"{d}/ck", f"{d}/native"
    base = dict(stage=2, dtype="fp32")
    check(launch(2, {"runs": [
        dict(base, adacheck={"enabled": True}, ds_extra={"checkpoint": {"use_node_local_storage": True}},
             init_error="checkpoint.use_node_local_storage is true"),
        dict(base, adacheck={"enabled": True}, ds_extra={"checkpoint": {"parallel_write": {"pipeline_stage": True}}},
             actions=[["train", 3], ["save", ck], ["save_native", nat], ["train", 2]]),
        dict(stage=3, dtype="fp32", adacheck={"enabled": True},
             actions=[["train", 3], ["save", f"{ck}3"], ["save_native", f"{nat}3"], ["train", 2]])]}, d,
        script="dropin_worker.py"))
    res = results(d)
    assert not res[0]["engine_code_ran"] and "use_node_local_storage" in res[0]["errors"][0]
    assert os.path.isfile(f"{ck}/global_step3/manifest.json")
    for src in (ck, nat, f"{ck}3", f"{nat}3"):
        universal(src, "global_step3")
    assert open(f"{ck}/latest_universal").read().strip() == "global_step3_universal"
    load_universal = dict(base, seed=7, ds_extra={"checkpoint": {"load_universal": True}})
    # ZeRO-3 without optimizer states: DeepSpeed's load also reads the fp32 weights of what the
    # directory's 'latest' names (get_fp32_state_dict_from_zero_checkpoint), here AdaCheck's save
    no_optim = {"load_optimizer_states": False}
    check(launch(2, {"runs": [
        dict(load_universal, stage=3, adacheck={"enabled": True},
             actions=[["load", f"{ck}3", no_optim], ["raw", "B3"], ["train", 2]]),
        dict(load_universal, stage=3, actions=[["load_native_kw", f"{nat}3", no_optim], ["raw", "C3"], ["train", 2]]),
        # (last: the decorator stays on the class, counting into this run's record)
        dict(load_universal, adacheck={"enabled": True},
             actions=[["wrap_methods"], ["load", ck], ["raw", "B"], ["train", 2]]),
        dict(load_universal, actions=[["load_native", nat], ["raw", "C"], ["train", 2]])]},
        d, script="dropin_worker.py"))
    b3, c3, b, c = results(d)
    assert "global_step3_universal" in b["loaded"][0][0] and b["calls"] == 1
    assert b["losses"] == c["losses"] == res[1]["losses"][3:]
    assert "global_step3_universal" in b3["loaded"][0][0] and b3["losses"] == c3["losses"]
    for rank in (0, 1):
        assert_same(raw(d, "B", rank), raw(d, "C", rank))
        assert_same(raw(d, "B3", rank), raw(d, "C3", rank))


LOAD_ARGUMENTS = [{"load_optimizer_states": False}, {"load_lr_scheduler_states": False},
                  {"load_module_only": True}, {"load_module_strict": False}]


def test_save_and_load_arguments_as_deepspeed(tmp_path):
    """save_checkpoint's save_latest=False leaves 'latest'; load_checkpoint's
    load_optimizer_states, load_lr_scheduler_states, load_module_only and load_module_strict put
    in a trained engine what DeepSpeed's own load with the same argument puts there (ZeRO-2
    fp32: DeepSpeed's module-only load makes the masters from the module weights, which in fp32
    are the masters); custom_load_fn is refused with a clear error."""
    d = str(tmp_path)
    ck, nat = f"{d}/ck", f"{d}/native"
    base = dict(stage=2, dtype="fp32")
    runs = [dict(base, adacheck={"enabled": True},
                 actions=[["train", 3], ["save", ck], ["save_native", nat], ["train", 1],
                          ["save", ck, "later", {"save_latest": False}], ["latest", ck],
                          ["expect_error", "custom_load_fn is not supported", "load_custom_fn", ck]])]
    for i, kw in enumerate(LOAD_ARGUMENTS):
        runs += [dict(base, seed=7, adacheck={"enabled": True},
                      actions=[["train", 1], ["load", ck, kw], ["raw", f"B{i}"], ["train", 1]]),
                 dict(base, seed=7, actions=[["train", 1], ["load_native_kw", nat, kw], ["raw", f"C{i}"], ["train", 1]])]
    check(launch(2, {"runs": runs}, d, script="dropin_worker.py"))
    res = results(d)
    assert res[0]["latest"] == ["global_step3"] and os.path.isfile(f"{ck}/later/manifest.json")
    for i, kw in enumerate(LOAD_ARGUMENTS):
        b, c = res[1 + 2 * i: 3 + 2 * i]
        assert b["losses"] == c["losses"], kw
        for rank in (0, 1):
            assert_same(raw(d, f"B{i}", rank), raw(d, f"C{i}", rank))
