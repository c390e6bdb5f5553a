"""Online gradient deltas with real DeepSpeed engines (CPU, gloo, 2 processes): recovery
replays the committed deltas to exactly the state of the uninterrupted run."""
import json
import os
import random
import signal

import pytest
from safetensors.torch import load_file

from launch import check, kill_at_marker, launch
from test_ds_integration import LAYOUTS, assert_same, results

from adacheck.online import deltas

pytestmark = pytest.mark.timeout(900)


def online(ck, **kw):
    return {"enabled": True, "save_dir": ck, "online": dict({"enabled": True}, **kw)}


def dump(d, name):
    return load_file(os.path.join(d, f"{name}.safetensors"))


def test_recovery_replays_deltas_bit_exactly_for_every_stage_and_dtype(tmp_path):
    """6 steps with online deltas (bases at steps 1 and 4, deltas 2-3 and 5-6); a new job's
    load_checkpoint replays base 4 + deltas 5, 6: every logical tensor equals the
    uninterrupted run's at step 6, and the next losses are those of a run never checkpointed."""
    d = str(tmp_path)
    runs = []
    for stage, dtype in LAYOUTS:
        ck = f"{d}/ck{stage}{dtype}"
        runs += [{"stage": stage, "dtype": dtype, "actions": [["train", 8]]},
                 {"stage": stage, "dtype": dtype, "adacheck": online(ck, base_interval=3),
                  "actions": [["train_dump", 6, f"A{stage}{dtype}_"]]},
                 {"stage": stage, "dtype": dtype, "seed": 5, "adacheck": online(ck, base_interval=3),
                  "actions": [["load", ck], ["steps"], ["dump", f"B{stage}{dtype}"], ["train", 2]]}]
    check(launch(2, {"runs": runs}, d))
    res = results(d)
    for i, (stage, dtype) in enumerate(LAYOUTS):
        ref, a, b = res[3 * i: 3 * i + 3]
        assert a["losses"] == ref["losses"][:6], (stage, dtype)      # recording changes nothing
        assert b["steps"] == [6, 24, 0], (stage, dtype)
        assert_same(dump(d, f"A{stage}{dtype}_6"), dump(d, f"B{stage}{dtype}"))
        assert b["losses"] == ref["losses"][6:8], (stage, dtype)
        ck = f"{d}/ck{stage}{dtype}"
        # bases every 3 steps, also in the job that recovered (it continued the chain of step 4)
        assert sorted(t for t in os.listdir(ck) if os.path.isdir(f"{ck}/{t}")) == ["global_step1", "global_step4",
                                                                        "global_step7"]
        assert open(f"{ck}/latest").read().strip() == "global_step7"
        assert deltas.step_dirs(f"{ck}/global_step1") == [2, 3]
        assert deltas.step_dirs(f"{ck}/global_step7") == [8]
        steps, why = deltas.committed_steps(f"{ck}/global_step4", 4, 2)
        assert [s.step for s in steps] == [5, 6] and why == "end of the log", why
        rec0 = steps[0].records
        if stage == 0:   # gradients replicated over DP are stored once: the two ranks split them
            k0, k1 = set(rec0[0]["tensors"]), set(rec0[1]["tensors"])
            assert k0 and k1 and not (k0 & k1), (stage, dtype)
        else:            # each rank stores the gradient of its own partition
            assert set(rec0[0]["tensors"]) == set(rec0[1]["tensors"]), (stage, dtype)
        for r in rec0.values():
            for meta in r["tensors"].values():
                assert meta["dtype"] == "float32" and meta["stored"] in ("bfloat16", "float32")
                if stage > 0 and dtype == "bf16":
                    # recorded before ZeRO clips them (gradient_clipping is 1.0 here): exact bf16
                    assert meta["stored"] == "bfloat16", (stage, dtype)


def test_bf16_gradients_stay_exact_when_clipping_scales_them(tmp_path):
    """gradient_clipping 1e-3, so DeepSpeed scales every gradient at every step: ZeRO-0 bf16
    (FP16_UnfusedOptimizer), ZeRO-1 bf16 (BF16_Optimizer), ZeRO-2 and ZeRO-3 bf16 still store
    bf16 (2 bytes; the gradients as they were before the scaling, with the norm and the clipping
    value), and the replay scales them again with DeepSpeed's own arithmetic and the recorded
    value, also in a job resumed with gradient_clipping 1.0: base 4 + delta 5 equals the
    uninterrupted run exactly."""
    d = str(tmp_path)
    runs = []
    stages = (0, 1, 2, 3)
    for stage in stages:
        ck = f"{d}/ck{stage}"
        common = {"stage": stage, "dtype": "bf16", "ds_extra": {"gradient_clipping": 1e-3}}
        runs += [dict(common, adacheck=online(ck, base_interval=3), actions=[["train_dump", 5, f"A{stage}_"]]),
                 dict(common, seed=5, adacheck=online(ck, base_interval=3), ds_extra={"gradient_clipping": 1.0},
                      actions=[["load", ck], ["steps"], ["dump", f"B{stage}"]])]
    check(launch(2, {"runs": runs}, d))
    res = results(d)
    for i, stage in enumerate(stages):
        assert res[2 * i + 1]["steps"][0] == 5, stage
        assert_same(dump(d, f"A{stage}_5"), dump(d, f"B{stage}"))
        ck = f"{d}/ck{stage}"
        steps = deltas.committed_steps(f"{ck}/global_step1", 1, 2)[0] + deltas.committed_steps(f"{ck}/global_step4", 4, 2)[0]
        assert [s.step for s in steps] == [2, 3, 5], stage
        for st in steps:
            stored = {m["stored"] for r in st.records.values() for m in r["tensors"].values()}
            assert stored == {"bfloat16"}, (stage, st.step, stored)
            for r in (0, 1):
                pre = deltas.read_extra(f"{ck}/global_step{st.step - (st.step - 1) % 3}", st, r)["preclip"]
                assert pre and all(float(a["norm"]) > 1e-3 and a["clip"] == 1e-3 for a in pre.values()), \
                    (stage, st.step)   # it clipped


FP16 = {"fp16": {"enabled": True, "initial_scale_power": 18, "hysteresis": 1, "loss_scale_window": 2}}


def test_fp16_loss_scaler_skips_replay_exactly(tmp_path):
    """DeepSpeed fp16 with dynamic loss scaling (DeepSpeed's real fp16 optimizers on CPU, see
    ds_worker.allow_fp16_on_cpu).  ZeRO 1-3: steps 1-4 overflow and are skipped, so both bases
    (steps 1 and 4) hold an optimizer that never stepped; ZeRO-0 (FP16_UnfusedOptimizer) grows
    its scale every two steps.  Recovery of step 6 (base 4 + deltas 5, 6) and, for ZeRO 1-3, of
    step 3 (base 1 + the skipped deltas 2, 3) equals the uninterrupted run: weights, masters,
    moments, counters, the loss scale and what decides its next change; training goes on with
    the uninterrupted run's losses and skips.  A 1-rank job recovers step 6 of ZeRO 1-3 too (base
    4 + deltas 5, 6): it rebuilds the saving ranks' partitions from a base whose optimizer never
    stepped (no moments yet) and replays the deltas that step it."""
    d = str(tmp_path)
    runs = []
    for stage in (0, 1, 2, 3):
        ck = f"{d}/ck{stage}"
        c = {"stage": stage, "dtype": "fp16", "ds_extra": FP16}
        runs += [dict(c, actions=[["train", 8], ["steps"]]),
                 dict(c, adacheck=online(ck, base_interval=3), actions=[["train_dump", 6, f"A{stage}_"]]),
                 dict(c, seed=5, adacheck=online(ck, base_interval=3),
                      actions=[["load", ck], ["dump", f"B{stage}"], ["train", 2], ["steps"]])]
        if stage:
            runs.append(dict(c, seed=6, adacheck=online(ck, base_interval=3),
                             actions=[["load", ck, {"tag": "global_step1"}], ["dump", f"C{stage}"]]))
    check(launch(2, {"runs": runs}, d))
    res = results(d)
    i = 0
    for stage in (0, 1, 2, 3):
        ref, rec, rcv = res[i:i + 3]
        assert rec["losses"] == ref["losses"][:6], stage
        assert_same(dump(d, f"A{stage}_6"), dump(d, f"B{stage}"))    # counters and loss scale too
        assert rcv["losses"] == ref["losses"][6:], stage
        assert rcv["steps"] == ref["steps"], stage        # the same skips after recovery
        assert dump(d, f"B{stage}")["meta/global_steps"].tolist() == [6, 24, 4 if stage else 0], stage
        if stage:
            assert dump(d, f"C{stage}")["meta/optim_step"].tolist() == [-1.0], stage   # never stepped
            assert_same(dump(d, f"A{stage}_3"), dump(d, f"C{stage}"))
        i += 4 if stage else 3
    check(launch(1, {"runs": [{"stage": stage, "dtype": "fp16", "ds_extra": FP16, "seed": 5,
                               "adacheck": online(f"{d}/ck{stage}", base_interval=3),
                               "actions": [["load", f"{d}/ck{stage}", {"tag": "global_step4"}],
                                           ["dump", f"D{stage}"]]}
                              for stage in (1, 2, 3)]}, f"{d}/one"))
    for stage in (1, 2, 3):
        assert_same(dump(d, f"A{stage}_6"), dump(f"{d}/one", f"D{stage}"))


def test_zero_offload_and_gradient_accumulation_replay_exactly(tmp_path):
    """Gradient accumulation over 2 micro-batches at every stage, and ZeRO-Offload at ZeRO 1-3
    (fp32 masters, moments and gradients on the CPU, stepped by DeepSpeedCPUAdam, whose
    gradient buffers DeepSpeed keeps between steps; at ZeRO-3 the parameters too): base 4 +
    deltas 5, 6 equal the uninterrupted run at step 6 and training goes on with its losses.
    A ZeRO-2 offload chain (the newest) loaded by an engine without offload (torch AdamW: other
    arithmetic) is not replayed: that job is at step 4 (the base's state, exactly), says which
    optimizers differ, and the deltas stay on disk after it trains on."""
    d = str(tmp_path)
    runs = []
    for stage, dtype in LAYOUTS:
        ck = f"{d}/ck{stage}{dtype}"
        common = {"stage": stage, "dtype": dtype, "ds_extra": {"gradient_accumulation_steps": 2}}
        if stage > 0:
            offload = {"offload_optimizer": {"device": "cpu"}}
            if stage == 3:
                offload["offload_param"] = {"device": "cpu"}
            common.update(optimizer="ds_adam", zero=offload)
        runs += [dict(common, actions=[["train", 16]]),
                 dict(common, adacheck=online(ck, base_interval=3), actions=[["train", 12], ["dump", f"A{stage}{dtype}"]]),
                 dict(common, seed=5, adacheck=online(ck, base_interval=3),
                      actions=[["load", ck], ["steps"], ["dump", f"B{stage}{dtype}"], ["train", 4]])]
    other = {"stage": 2, "dtype": "fp32", "adacheck": online(f"{d}/other", base_interval=3)}
    runs += [dict(other, optimizer="ds_adam", zero={"offload_optimizer": {"device": "cpu"}},
                  actions=[["train_dump", 6, "O"]]),
             dict(other, seed=5, actions=[["load", f"{d}/other"], ["steps"], ["dump", "N"], ["train", 1]])]
    out = check(launch(2, {"runs": runs}, d))
    res = results(d)
    for i, (stage, dtype) in enumerate(LAYOUTS):
        ref, a, b = res[3 * i: 3 * i + 3]
        assert a["losses"] == ref["losses"][:12], (stage, dtype)
        assert b["steps"][0] == 6, (stage, dtype)
        assert_same(dump(d, f"A{stage}{dtype}"), dump(d, f"B{stage}{dtype}"))
        assert b["losses"] == ref["losses"][12:16], (stage, dtype)
    assert res[-1]["steps"][0] == 4
    o4 = dump(d, "O4")   # the base itself loads into the other optimizer (DeepSpeedCPUAdam counts steps in ints)
    assert_same(o4, dump(d, "N"), [k for k in o4 if k.startswith(("model/", "master/", "optim/"))])
    assert "recorded by ZeRO-2/zero12 with deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam" in out[0][1]
    assert "engine with torch.optim.adamw.AdamW" in out[0][1] and "The deltas are kept" in out[0][1]
    assert deltas.step_dirs(f"{d}/other/global_step4") == [5, 6]
    assert os.path.isdir(f"{d}/other/global_step5")     # its next step took a base instead


def test_deltas_replay_on_another_number_of_ranks(tmp_path):
    """Deltas recorded at DP=2 replay in a 1-rank job, and deltas recorded on 1 rank in a DP=2
    job: base 4 + deltas 5, 6 gives exactly the recording run's state at step 6. ZeRO-0 applies
    the same full gradients on every rank; ZeRO 1/2, the BF16 optimizer (ZeRO-1 bf16) and
    ZeRO-3 step flat partitions, which the recovering ranks rebuild from the base and step with
    the saving ranks' own records (ZeRO-3 bf16 with gradient_clipping 1e-3: the recorded
    clipping applies to another rank's partition)."""
    d = str(tmp_path)
    clip = {"gradient_clipping": 1e-3}
    two = [(0, "fp32", {}), (0, "bf16", {}), (1, "fp32", {}), (1, "bf16", {}), (2, "bf16", {}), (3, "fp32", {}),
           (3, "bf16", clip)]
    one = [(1, "bf16", {}), (2, "fp32", {}), (3, "bf16", clip)]

    def record(s, t, extra, ck):
        return {"stage": s, "dtype": t, "ds_extra": extra, "adacheck": online(ck, base_interval=3),
                "actions": [["train_dump", 6, f"A{s}{t}_"]]}

    def recover(s, t, extra, ck, name):
        return {"stage": s, "dtype": t, "seed": 5, "ds_extra": extra, "adacheck": online(ck, base_interval=3),
                "actions": [["load", ck], ["steps"], ["dump", name], ["train", 1]]}
    check(launch(2, {"runs": [record(s, t, x, f"{d}/ck{s}{t}") for s, t, x in two]}, d))
    runs = [recover(s, t, x, f"{d}/ck{s}{t}", f"B{s}{t}") for s, t, x in two]
    runs += [record(s, t, x, f"{d}/one/ck{s}{t}") for s, t, x in one]
    check(launch(1, {"runs": runs}, f"{d}/one"))
    res = results(f"{d}/one")
    for i, (s, t, _) in enumerate(two):
        assert res[i]["steps"][0] == 6, (s, t)
        assert_same(dump(d, f"A{s}{t}_6"), dump(f"{d}/one", f"B{s}{t}"))
        # the 1-rank job does not continue the 2-rank chain: its next step is a new base
        assert deltas.step_dirs(f"{d}/ck{s}{t}/global_step4") == [5, 6]
        assert os.path.isdir(f"{d}/ck{s}{t}/global_step7")
    check(launch(2, {"runs": [recover(s, t, x, f"{d}/one/ck{s}{t}", f"C{s}{t}") for s, t, x in one]}, f"{d}/two"))
    res = results(f"{d}/two")
    for i, (s, t, _) in enumerate(one):
        assert res[i]["steps"][0] == 6, (s, t)
        assert_same(dump(f"{d}/one", f"A{s}{t}_6"), dump(f"{d}/two", f"C{s}{t}"))


def test_a_step_not_committed_on_every_rank_is_not_replayed(tmp_path):
    """Rank 1's record of step 5 is missing (its write was interrupted): recovery stops at
    step 4, removes the uncommitted steps, and training resumes exactly from step 4; the
    next job recovers the continued chain."""
    d = str(tmp_path)
    ck = f"{d}/ck"
    ac = online(ck, base_interval=100)
    check(launch(2, {"runs": [{"stage": 2, "dtype": "bf16", "adacheck": ac,
                               "actions": [["train_dump", 6, "A"]]}]}, d))
    os.remove(os.path.join(deltas.step_dir(f"{ck}/global_step1", 5), "rank1.json"))
    check(launch(2, {"runs": [{"stage": 2, "dtype": "bf16", "seed": 3, "adacheck": ac,
                               "actions": [["load", ck], ["steps"], ["dump", "B"], ["train_dump", 2, "B_"]]},
                              {"stage": 2, "dtype": "bf16", "seed": 4, "adacheck": ac,
                               "actions": [["load", ck], ["steps"], ["dump", "C"]]}]}, d))
    b, c = results(d)
    assert b["steps"][0] == 4
    assert_same(dump(d, "A4"), dump(d, "B"))
    assert_same(dump(d, "A6"), dump(d, "B_6"))   # the same two steps again, exactly
    assert c["steps"][0] == 6
    assert_same(dump(d, "B_6"), dump(d, "C"))


def test_a_tag_saved_again_starts_a_chain_of_its_own(tmp_path):
    """Run A records base global_step1 and deltas 2-6; run B, started over in the same directory
    (another seed, nothing loaded), takes base global_step1 again (a new generation) and records
    steps 2-3; run D, without online deltas, saves global_step1 once more (as after a crash
    between a base's commit and its new chain).  Each load recovers exactly the state of the run
    that saved last (DeepSpeed's own accessors at that step): never the steps of an earlier save
    of the tag replayed on the new base."""
    d = str(tmp_path)
    ck = f"{d}/ck"
    ac, plain = online(ck, base_interval=100), {"enabled": True, "save_dir": ck}
    check(launch(2, {"runs": [
        {"stage": 2, "dtype": "bf16", "adacheck": ac, "actions": [["train_dump", 6, "A"]]},
        {"stage": 2, "dtype": "bf16", "seed": 3, "adacheck": ac, "actions": [["train_dump", 3, "B"]]},
        {"stage": 2, "dtype": "bf16", "seed": 4, "adacheck": ac, "actions": [["load", ck], ["steps"], ["dump", "C"]]},
        {"stage": 2, "dtype": "bf16", "seed": 5, "adacheck": plain,
         "actions": [["train", 1], ["save", ck], ["dump", "D1"]]},
        {"stage": 2, "dtype": "bf16", "seed": 6, "adacheck": plain, "actions": [["load", ck], ["steps"], ["dump", "E"]]},
    ]}, d))
    res = results(d)
    assert res[2]["steps"][0] == 3 and res[4]["steps"][0] == 1, (res[2], res[4])
    assert_same(dump(d, "B3"), dump(d, "C"))
    assert_same(dump(d, "D1"), dump(d, "E"))


def test_sigkill_at_a_random_step_then_recover_and_continue(tmp_path):
    """One rank is SIGKILLed somewhere in a run with online deltas; a new job recovers the
    newest committed step (state equal to the uninterrupted run's at that step) and
    finishes the run with the uninterrupted run's losses."""
    d = str(tmp_path)
    ck = f"{d}/ck"
    model = {"stage": 2, "dtype": "bf16", "hidden": 256, "layers": 4}
    check(launch(2, {"runs": [dict(model, actions=[["train_dump", 24, "U"]])]}, f"{d}/u"))
    ref = results(f"{d}/u")[0]["losses"]
    ac = online(ck, base_interval=5)
    kill_after = random.Random(os.getpid()).randint(4, 14)
    res = launch(2, {"runs": [dict(model, adacheck=ac, actions=[["train_dump", 24, "K", "m"]])]}, f"{d}/k",
                 on_started=kill_at_marker(f"{d}/k/m{kill_after}-rank1"), grace=30)
    assert res[1][0] == -signal.SIGKILL, res[1][1][-3000:]
    check(launch(2, {"runs": [dict(model, seed=11, adacheck=ac,
                                   actions=[["load", ck], ["steps"], ["dump", "R"], ["train_to", 24]])]},
                 f"{d}/r"))
    r = results(f"{d}/r")[0]
    t = r["steps"][0]
    assert t >= kill_after - 1, (t, kill_after)
    assert_same(dump(f"{d}/u", f"U{t}"), dump(f"{d}/r", "R"))
    assert r["losses"] == ref[t:24]


def test_write_error_disables_online_mode_and_training_goes_on(tmp_path):
    """Rank 1 cannot write delta files (file size limit): it warns once, training goes on with
    unchanged losses, and recovery stops at the last step every rank committed."""
    d = str(tmp_path)
    ck = f"{d}/ck"
    ac = online(ck, base_interval=100)
    runs = [{"stage": 1, "dtype": "fp32", "actions": [["train", 6]]},
            {"stage": 1, "dtype": "fp32", "adacheck": ac,
             "actions": [["train_dump", 3, "A"], ["fsize_limit", 1, 600], ["train_dump", 3, "A"],
                         ["fsize_limit", 1, -1]]},
            {"stage": 1, "dtype": "fp32", "seed": 2, "adacheck": ac,
             "actions": [["load", ck], ["steps"], ["dump", "B"]]}]
    check(launch(2, {"runs": runs}, d))
    ref, a, b = results(d)
    assert a["losses"] == ref["losses"]
    warned = [w for w in results(d, 1)[1]["warnings"] if "online mode disabled" in w]
    assert len(warned) == 1 and "rank 1" in warned[0] and "File too large" in warned[0], warned
    assert not [w for w in a["warnings"] if "online mode disabled" in w]
    # the deltas are written in the background, so the limit hits rank 1 at step 2, 3 or 4
    t = b["steps"][0]
    assert 1 <= t <= 4
    assert_same(dump(d, f"A{t}"), dump(d, "B"))


def test_compact_and_auto_bases(tmp_path):
    """compact: fp32 gradients stored lossy in bf16; the recovery says it is approximate and by
    how much, and that is what `adacheck inspect` reports and exactly how far the recovered
    master weights and moments are from the recording run's (measured while recording).
    base_interval "auto": the interval the engine logged is the rule's answer for the numbers
    it logged (the same on both ranks), the bases follow it (saved with the partitioned exchange),
    and recovery is exact."""
    import re
    import subprocess
    import sys
    d = str(tmp_path)
    runs = [{"stage": 1, "dtype": "fp32", "adacheck": online(f"{d}/c", base_interval=100, compact=True),
             "actions": [["train_dump", 6, "C"]]},
            {"stage": 1, "dtype": "fp32", "adacheck": online(f"{d}/c", base_interval=100, compact=True),
             "actions": [["load", f"{d}/c"], ["steps"], ["dump", "D"]]},
            # (its bases saved with the partitioned exchange)
            {"stage": 2, "dtype": "bf16", "hidden": 128,
             "adacheck": dict(online(f"{d}/a", base_interval="auto"), exchange="partitioned"),
             "actions": [["train_dump", 9, "E"]]},
            {"stage": 2, "dtype": "bf16", "hidden": 128, "adacheck": online(f"{d}/a", base_interval="auto"),
             "actions": [["load", f"{d}/a"], ["steps"], ["dump", "F"]]}]
    out = check(launch(2, {"runs": runs}, d))
    c, dd, e, f = results(d)
    log0 = out[0][1]
    assert dd["steps"][0] == 6 and "APPROXIMATE recovery: 5 of these deltas" in log0
    exact, got, base = dump(d, "C6"), dump(d, "D"), dump(d, "C1")

    def far(prefix, a, b):
        return max((a[k].float() - b[k].float()).abs().max().item() for k in a if k.startswith(prefix))
    info = json.loads(subprocess.run([sys.executable, "-m", "adacheck.cli", "inspect", f"{d}/c", "--json"],
                                     capture_output=True, text=True, check=True).stdout)["deltas"]
    assert info["lossy"] and info["committed"] == 5 and info["max_abs_error"] > 0
    measured = info["deviation"]["6"]
    assert far("master/", exact, got) == measured["weights"] > 0
    assert far("optim/", exact, got) == measured["state"] > 0
    assert measured["weights"] < 0.05 * far("master/", exact, base)    # (small against what training moved)
    assert info["max_deviation"]["weights"] >= measured["weights"] and sorted(info["deviation"]) == list("23456")
    assert re.search(r"deviates from the recording run's at step 6 by at most [\d.e-]+ in the weights", log0)
    text = subprocess.run([sys.executable, "-m", "adacheck.cli", "inspect", f"{d}/c"], capture_output=True,
                          text=True, check=True).stdout
    assert "measured deviation of a load from the recording run at step 6" in text
    decided = re.findall(r"base_interval auto = (\d+) \(base (\d+) B in ([\d.e-]+)s; delta (\d+) B, "
                         r"replay ~([\d.e-]+)s\)", log0)
    assert decided, log0[-3000:]
    # every rank decided from the same numbers (a rank's own save time would differ: ranks taking
    # their bases at different steps would hang or mix chains)
    assert re.findall(r"base_interval auto = .*", out[1][1]) == re.findall(r"base_interval auto = .*", log0), \
        out[1][1][-3000:]
    for n, bb, bs, db, rs in decided:   # each chain's interval is the rule applied to its numbers
        assert int(n) == deltas.auto_interval(int(bb), float(bs), int(db), float(rs))
    # the bases: the first step, then (per chain, decided after its second delta) every n steps
    expect, base, interval, ns = [1], 1, None, [int(x[0]) for x in decided]
    for step in range(2, 10):
        if interval is not None and step - base >= interval:
            expect.append(step)
            base, interval = step, None
        elif interval is None and step == base + 2:
            interval = ns.pop(0)
    bases = sorted(int(t[len("global_step"):]) for t in os.listdir(f"{d}/a") if t.startswith("global_step"))
    assert bases == expect, (bases, decided)
    assert f["steps"][0] == 9
    assert_same(dump(d, "E9"), dump(d, "F"))
