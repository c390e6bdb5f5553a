"""Real DeepSpeed engines on CPU (gloo, 2 and 4 processes): resume, resharding, faults."""
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from adacheck.checkpoint import human
from launch import check, kill_when_written, launch

from adacheck.storage.commit import read_manifest
from adacheck.format.manifest import tensors_json

pytestmark = pytest.mark.timeout(900)

LAYOUTS = [(0, "fp32"), (0, "bf16"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"),
           (3, "fp32"), (3, "bf16")]


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def assert_same(a, b, keys=None):
    keys = keys if keys is not None else sorted(a)
    assert set(keys) <= set(b), sorted(set(keys) - set(b))
    for k in keys:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"{k} differs (max {(a[k].float() - b[k].float()).abs().max()})"


def test_resume_is_bit_identical_for_every_stage_and_dtype(tmp_path):
    """train 3, save, train 2  ==  load, train 2: same losses and every logical tensor equal;
    ZeRO-1/2 module weights rebuilt either way: read and cast on each rank (gloo's default) or
    cast and all-gathered by DeepSpeed."""
    runs = []
    model = {"hidden": 128, "layers": 3}     # (36k parameters: the weights outweigh the saved objects)
    for stage, dtype in LAYOUTS:
        ck = str(tmp_path / f"ck{stage}{dtype}")
        runs.append(dict(model, stage=stage, dtype=dtype, adacheck={"enabled": True},
                         actions=[["train", 3], ["save", ck], ["train", 2], ["dump", f"A{stage}{dtype}"]]))
        runs.append(dict(model, stage=stage, dtype=dtype, seed=7, adacheck={"enabled": True},
                         actions=[["load", ck], ["train", 2], ["dump", f"B{stage}{dtype}"]]))
    gathered = [(1, "bf16"), (2, "fp32")]
    for stage, dtype in gathered:
        runs.append(dict(model, stage=stage, dtype=dtype, seed=7, adacheck={"enabled": True}, gather=True,
                         actions=[["load", str(tmp_path / f"ck{stage}{dtype}")], ["train", 2],
                                  ["dump", f"G{stage}{dtype}"]]))
    check(launch(2, {"runs": runs}, str(tmp_path)))
    res = results(str(tmp_path))

    def read_by_each(i):
        return [results(str(tmp_path), r)[i]["manifest_read"][0]["data"] for r in (0, 1)]

    for i, (stage, dtype) in enumerate(LAYOUTS):
        uninterrupted, resumed = res[2 * i], res[2 * i + 1]
        assert uninterrupted["losses"][3:] == resumed["losses"], (stage, dtype)
        assert resumed["loaded"][0][1] == {"epoch": 3, "note": "hi", "vec": [0.0, 1.0, 2.0, 3.0]}
        gathered_now, persistent = resumed["persistent_gathered"][0]
        assert gathered_now == persistent and (persistent > 0) == (stage == 3), (stage, dtype)
        a = load_file(str(tmp_path / f"A{stage}{dtype}.safetensors"))
        b = load_file(str(tmp_path / f"B{stage}{dtype}.safetensors"))
        assert_same(a, b)
        assert a["meta/global_steps"].tolist() == [5, 20, 0]
        man = json.load(open(os.path.join(tmp_path, f"ck{stage}{dtype}", "global_step3", "manifest.json")))
        model = [t for n, t in man["tensors"].items() if n.startswith("model/")]
        has_master = any(n.startswith("master/") for n in man["tensors"])
        # module weights are never stored twice: either they are the master, or proven casts of it
        assert has_master == (stage > 0 or dtype == "bf16"), (stage, dtype)
        assert all(("derived" in t) == has_master for t in model), (stage, dtype)
        # what each rank read, of the master weights and moments (unique): ZeRO-3 its own
        # partition (about half), its module partition cast from it by DeepSpeed, not read again
        # (0.67); ZeRO-1/2 over gloo every master weight (cast into the module's) and its own
        # half of the moments (0.67-0.70); with DeepSpeed's all-gather, its own half (0.50-0.53)
        unique = sum(v.numel() * v.element_size() for k, v in a.items() if k.startswith(("master/", "optim/")))
        read = read_by_each(2 * i + 1)
        if stage == 3:
            assert max(read) < 0.6 * unique, (stage, dtype, read, unique)
        elif stage in (1, 2):
            assert 0.6 * unique < min(read) and max(read) < 0.75 * unique, (stage, dtype, read, unique)
        if (stage, dtype) in gathered:
            g = len(LAYOUTS) * 2 + gathered.index((stage, dtype))
            assert uninterrupted["losses"][3:] == res[g]["losses"], (stage, dtype)
            assert_same(a, load_file(str(tmp_path / f"G{stage}{dtype}.safetensors")))
            read = read_by_each(g)
            assert max(read) < 0.6 * unique, (stage, dtype, read, unique)


def logical(d):
    return {k: v for k, v in load_file(d).items() if not k.startswith("model/")}


@pytest.mark.parametrize("target_world", [4, 1])
def test_load_into_other_layouts(tmp_path, target_world):
    """Saved by DP=2 ZeRO-2 bf16 (and DP=2 ZeRO-3 / ZeRO-0), loaded by DP=4 / DP=1 in other stages."""
    src = str(tmp_path / "src")
    saves = [(2, "bf16"), (3, "bf16"), (0, "fp32")]
    runs = [{"stage": s, "dtype": dt, "adacheck": {"enabled": True},
             "actions": [["train", 3], ["save", f"{src}/ck{s}{dt}"], ["dump", f"{src}/S{s}{dt}"]]}
            for s, dt in saves]
    check(launch(2, {"runs": runs}, src))
    targets = {4: [((2, "bf16"), (3, "bf16")), ((3, "bf16"), (2, "bf16")), ((2, "bf16"), (0, "bf16")),
                   ((0, "fp32"), (1, "fp32"))],
               1: [((2, "bf16"), (1, "bf16")), ((3, "bf16"), (0, "bf16")), ((0, "fp32"), (2, "fp32")),
                   ((2, "bf16"), (2, "fp32"))]}   # (another dtype: the fp32 masters are the state)
    pairs = targets[target_world]
    dst = str(tmp_path / "dst")
    runs = [{"stage": t[0], "dtype": t[1], "seed": 9, "adacheck": {"enabled": True},
             "actions": [["load", f"{src}/ck{s[0]}{s[1]}"], ["dump", f"{dst}/L{i}"], ["train", 1]]}
            for i, (s, t) in enumerate(pairs)]
    check(launch(target_world, {"runs": runs}, dst))
    res = results(dst)
    for i, (s, t) in enumerate(pairs):
        saved = load_file(f"{src}/S{s[0]}{s[1]}.safetensors")
        loaded = load_file(f"{dst}/L{i}.safetensors")
        keys = [k for k in saved if k.startswith(("master/", "optim/", "buffer/"))]
        assert_same(saved, loaded, keys)
        assert loaded["meta/optim_step"].tolist() == saved["meta/optim_step"].tolist()
        assert loaded["meta/lr"].tolist() == saved["meta/lr"].tolist()
        for k in saved:
            if k.startswith("model/"):   # module weights = the master cast to the module dtype
                assert torch.equal(loaded[k], saved[k.replace("model/", "master/")].to(loaded[k].dtype)), k
        assert len(res[i]["losses"]) == 1 and res[i]["losses"][0] == res[i]["losses"][0]


def test_failed_save_on_one_rank_fails_everywhere_and_keeps_previous(tmp_path):
    """Rank 1 cannot write (file size limit, EFBIG): both ranks raise the same error naming
    the cause and path, no temporary file stays, 'latest' still names the previous save right
    after the failure, training goes on and a later save succeeds."""
    ck = str(tmp_path / "ck")
    runs = [{"stage": 2, "dtype": "bf16", "hidden": 64, "adacheck": {"enabled": True},
             "actions": [["train", 2], ["save", ck, "first"], ["dump", "first"], ["train", 1],
                         ["fsize_limit", 1, 4096],
                         ["expect_error", "File too large", "save", ck, "second"], ["latest", ck],
                         ["fsize_limit", 1, -1], ["train", 1], ["save", ck, "third"]]}]
    check(launch(2, {"runs": runs}, str(tmp_path)))
    errs = [results(str(tmp_path), r)[0]["errors"][0] for r in (0, 1)]
    assert errs[0] == errs[1]
    assert [results(str(tmp_path), r)[0]["latest"] for r in (0, 1)] == [["first"], ["first"]]
    assert "rank 1: OSError: [Errno 27] File too large" in errs[0] and str(tmp_path) in errs[0]
    assert not os.path.exists(os.path.join(ck, "second", "manifest.json"))
    leftovers = [f for f in os.listdir(os.path.join(ck, "second")) if "safetensors" in f]
    assert leftovers == []
    assert open(os.path.join(ck, "latest")).read().strip() == "third"


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    """Rank 1 is SIGKILLed the moment its shard file of a save appears under its temporary name:
    the kill lands inside the write phase, which the test shows (the temporary file is still
    there afterwards: nobody renamed it).  That save never committed, 'latest' names the one
    before, and a new job loads it exactly (DeepSpeed's own accessors, dumped after it was saved)."""
    ck = str(tmp_path / "ck")
    # every save rewrites everything (no references), so the kill lands inside real writes
    big = {"stage": 1, "dtype": "fp32", "hidden": 700, "layers": 6,
           "adacheck": {"enabled": True, "reference_previous": False}}
    runs = [dict(big, actions=[["train", 1], ["save", ck, "good"], ["dump", "good"], ["train", 1], ["dump", "two"],
                               ["marker", "saving"]] + [["save", ck, f"doomed{i}"] for i in range(30)])]
    started, seen = kill_when_written(os.path.join(ck, "doomed*", "rank00001-*.safetensors.tmp"),
                                      str(tmp_path / "saving-rank1"))
    res = launch(2, {"runs": runs}, str(tmp_path), on_started=started, grace=30)
    assert res[1][0] == -signal.SIGKILL
    assert os.path.exists(seen["path"]), "the kill did not land inside the write phase"
    doomed = os.path.basename(os.path.dirname(seen["path"]))
    assert not os.path.exists(os.path.join(ck, doomed, "manifest.json"))
    latest = open(os.path.join(ck, "latest")).read().strip()
    assert latest != doomed
    # whatever 'latest' names is complete and loads bit-exactly into a new job
    load_dir = str(tmp_path / "reload")
    runs = [dict(big, seed=3, actions=[["load", ck], ["dump", "reloaded"]])]
    check(launch(2, {"runs": runs}, load_dir))
    assert results(load_dir)[0]["loaded"][0][0].endswith(latest)
    assert_same(load_file(str(tmp_path / ("good.safetensors" if latest == "good" else "two.safetensors"))),
                load_file(os.path.join(load_dir, "reloaded.safetensors")))


def test_config_block_validation_and_disabled_block(tmp_path):
    """A disabled block saves natively.  Config mistakes are ConfigErrors raised while the engine
    is being built, before any of DeepSpeed's engine code runs (no frame of
    deepspeed/runtime/engine.py in the traceback): an unknown key (with a suggestion), a value of
    the wrong type, top-level keys that look like a misspelt "adacheck" (DeepSpeed ignores
    unknown keys, so the block would be silently lost), and a save_dir that cannot be written."""
    d = str(tmp_path)
    bad = [({"adacheck": {"enabled": True, "keep_lats": 2}}, "unknown key adacheck.'keep_lats'. Did you mean 'keep_last'?"),
           ({"adacheck": {"enabled": True, "keep_last": "2"}}, "adacheck.keep_last must be an integer, got '2'"),
           ({"adacheck": {"enabled": "yes"}}, "adacheck.enabled must be true or false, got 'yes'"),
           ({"adacheck": {"enabled": True, "on_corrupt": "ignore"}}, "adacheck.on_corrupt must be one of"),
           ({"adacheck": {"enabled": True, "online": {"enabled": True, "base_interval": 0}}}, "base_interval"),
           ({"adacheck": {"enabled": True, "online": []}}, "adacheck.online must be an object"),
           ({"adacheck": {"enabled": True, "tiers": {"memory": "yes"}}}, "adacheck.tiers.memory must be true or false"),
           ({"adacheck": {"enabled": True, "tiers": {"peer": True}}}, "it needs tiers.memory true as well"),
           ({"adachek": {"enabled": True}}, "top-level key 'adachek'; did you mean \"adacheck\"?"),
           ({"AdaCheck": {"enabled": True}}, "top-level key 'AdaCheck'; did you mean \"adacheck\"?"),
           # a save_dir no rank can create (its parent is a file): found here, not at the first save
           ({"adacheck": {"enabled": True, "save_dir": d + "/a-file/ckpt"}},
            f"the checkpoint directory {d}/a-file/ckpt is not writable from")]
    open(d + "/a-file", "w").close()
    runs = [{"stage": 1, "dtype": "fp32", "adacheck": {"enabled": False},
             "actions": [["train", 1], ["save", d + "/native"]]}]
    runs += [{"stage": 1, "dtype": "fp32", "ds_extra": extra, "init_error": msg, "actions": []} for extra, msg in bad]
    check(launch(2, {"runs": runs}, d))
    assert os.path.isdir(d + "/native/global_step1") and not os.path.exists(d + "/native/global_step1/manifest.json")
    for r in (0, 1):
        res = results(d, r)[1:]
        for (_, msg), rec in zip(bad, res):
            kind = rec["errors"][0].split(":")[0]     # (ConfigError, or DistributedConfigError from all ranks)
            assert kind.endswith("ConfigError") and msg in rec["errors"][0], (msg, rec["errors"])
            assert rec["engine_code_ran"] is False, msg


def test_tag_validation_and_an_empty_save_dir_as_deepspeed_does(tmp_path):
    """DeepSpeed's ``checkpoint.tag_validation`` with ranks that name different tags: FAIL raises
    on every rank an error that is also an AssertionError (DeepSpeed's own tests expect that
    type) and saves nothing; WARN saves under rank 0's tag with a warning, IGNORE silently; the
    checkpoint loads. An empty save_dir is a ValueError, as DeepSpeed raises."""
    d = str(tmp_path)
    runs = [{"stage": 1, "dtype": "fp32", "adacheck": {"enabled": True},
             "ds_extra": {"checkpoint": {"tag_validation": mode}},
             "actions": [["train", 1]] + ([["expect_error", "different checkpoint tags", "save", f"{d}/{mode}",
                                            "tag-{rank}"]] if mode == "FAIL" else
                                          [["save", f"{d}/{mode}", "tag-{rank}"], ["latest", f"{d}/{mode}"]])}
            for mode in ("FAIL", "WARN", "IGNORE")]
    runs.append({"stage": 1, "dtype": "fp32", "adacheck": {"enabled": True},
                 "actions": [["train", 1], ["expect_error", "", "save", ""], ["load", f"{d}/IGNORE"]]})
    out = check(launch(2, {"runs": runs}, d))
    for r in (0, 1):
        fail, warn, ignore, empty = results(d, r)
        assert "rank 0: 'tag-0', rank 1: 'tag-1'" in fail["errors"][0], fail
        assert {"AssertionError", "ConfigError"} <= set(fail["error_classes"][0]), fail
        assert warn["latest"] == ["tag-0"] and ignore["latest"] == ["tag-0"], (warn, ignore)
        assert "ValueError" in empty["error_classes"][0], empty
        assert empty["loaded"][0][0].endswith("tag-0"), empty
        said = out[r][1].count("saving under rank 0's, 'tag-0' (checkpoint.tag_validation: WARN)")
        assert said == 1, out[r][1][-3000:]      # (WARN says it on every rank; IGNORE does not)
    assert not os.path.exists(f"{d}/FAIL/latest") and not os.path.exists(f"{d}/WARN/tag-1")


def test_switching_a_native_run_to_adacheck(tmp_path):
    """An existing run's last checkpoint is DeepSpeed's own: with the adacheck block enabled,
    load_checkpoint loads it natively and training goes on exactly; the next save is AdaCheck's
    (in the same directory) and the run after that resumes from it."""
    ck = str(tmp_path / "ck")
    runs = [{"stage": 2, "dtype": "bf16", "actions": [["train", 3], ["train", 4]]},
            {"stage": 2, "dtype": "bf16", "adacheck": {"enabled": False},
             "actions": [["train", 3], ["save", ck]]},
            {"stage": 2, "dtype": "bf16", "seed": 7, "adacheck": {"enabled": True},
             "actions": [["load", ck], ["train", 2], ["save", ck]]},
            {"stage": 2, "dtype": "bf16", "seed": 7, "adacheck": {"enabled": True},
             "actions": [["load", ck], ["train", 2]]},
            # and a script that forgot adacheck_ds (its block ignored): DeepSpeed's own load fails
            {"stage": 2, "dtype": "bf16", "adacheck": {"enabled": False},
             "actions": [["expect_error", "", "load", ck]]}]
    check(launch(2, {"runs": runs}, str(tmp_path)))
    whole, _, switched, resumed, forgot = results(str(tmp_path))
    assert switched["losses"] == whole["losses"][3:5]
    assert resumed["losses"] == whole["losses"][5:7]
    assert os.path.exists(os.path.join(ck, "global_step5", "manifest.json"))
    assert not os.path.exists(os.path.join(ck, "global_step3", "manifest.json"))
    # DeepSpeed's error says nothing of AdaCheck; the README AdaCheck left in the directory names the
    # line that failed and what to do
    assert forgot["errors"][0].startswith("AssertionError"), forgot
    readme = open(os.path.join(ck, "README")).read()
    assert forgot["error_lines"][0] in readme and "import adacheck_ds" in readme, (forgot, readme)
    assert "adacheck convert" in readme


def test_retention_keeps_last_k(tmp_path):
    ck = str(tmp_path / "ck")
    runs = [{"stage": 2, "dtype": "fp32", "adacheck": {"enabled": True, "keep_last": 2},
             "actions": [a for i in range(4) for a in (["train", 1], ["save", ck])]}]
    check(launch(2, {"runs": runs}, str(tmp_path)))
    committed = sorted(x for x in os.listdir(ck) if os.path.exists(os.path.join(ck, x, "manifest.json")))
    assert committed == ["global_step3", "global_step4"]
    # what is left of older saves is exactly what the kept ones still read (unchanged buffers, RNG)
    needed = {b["file"] for t in committed for e in json.load(open(os.path.join(ck, t, "manifest.json")))[
        "tensors"].values() for b in e.get("boxes", []) if "/" in b["file"]}
    left = {f"{t}/{f}" for t in os.listdir(ck) if t not in committed and os.path.isdir(os.path.join(ck, t))
            for f in os.listdir(os.path.join(ck, t))}
    assert left == needed


def test_deepspeed_adam_frozen_parameters_and_round_robin_gradients(tmp_path):
    """DeepSpeed's own Adam (steps as Python ints), frozen parameters (no master, no optimizer
    state; restored from the module weights) and round_robin_gradients (a flat buffer in another
    parameter order than DeepSpeed's own fragment table assumes)."""
    d = str(tmp_path)
    resume = [dict(stage=s, dtype=dt, optimizer="ds_adam") for s, dt in [(0, "fp32"), (2, "bf16"), (3, "bf16")]]
    resume += [dict(stage=s, dtype=dt, frozen=["inp."]) for s, dt in [(0, "bf16"), (1, "bf16"), (3, "fp32")]]
    runs = []
    for i, c in enumerate(resume):
        runs.append(dict(c, adacheck={"enabled": True},
                         actions=[["train", 3], ["save", f"{d}/ck{i}"], ["train", 2], ["dump", f"A{i}"]]))
        runs.append(dict(c, seed=7, adacheck={"enabled": True},
                         actions=[["load", f"{d}/ck{i}"], ["train", 2], ["dump", f"B{i}"]]))
    rr = dict(stage=2, dtype="fp32", layers=3, hidden=19, adacheck={"enabled": True})
    runs += [dict(rr, zero={"round_robin_gradients": True}, actions=[["train", 3], ["save", f"{d}/rr"]]),
             dict(rr, actions=[["train", 3], ["dump", "plain"]])]
    runs += [dict(rr, stage=s, seed=5, actions=[["load", f"{d}/rr"], ["dump", f"rr{s}"]]) for s in (0, 3)]
    check(launch(2, {"runs": runs}, d))
    res = results(d)
    for i, c in enumerate(resume):
        assert res[2 * i]["losses"][3:] == res[2 * i + 1]["losses"], c
        a, b = load_file(f"{d}/A{i}.safetensors"), load_file(f"{d}/B{i}.safetensors")
        assert_same(a, b)   # includes the frozen model/inp.* (the resumed model started from seed 7)
        assert bool(b["meta/optim_step_is_int"]) == (c.get("optimizer") == "ds_adam"), c
        man = json.load(open(f"{d}/ck{i}/global_step3/manifest.json"))
        if c.get("frozen"):
            assert not any(n.endswith("/inp.weight") for n in man["tensors"] if not n.startswith("model/"))
            assert "derived" not in man["tensors"]["model/inp.weight"]
    # saved with round-robin order, loaded without it: the same state as a run that never used it
    plain = load_file(f"{d}/plain.safetensors")
    for s in (0, 3):
        loaded = load_file(f"{d}/rr{s}.safetensors")
        assert_same(plain, loaded, [k for k in plain if k.startswith(("model/", "master/", "optim/"))])


def test_checkpoint_saved_by_a_single_rank_loads_into_two(tmp_path):
    d = str(tmp_path)
    c = dict(stage=1, dtype="bf16", adacheck={"enabled": True})
    check(launch(1, {"runs": [dict(c, actions=[["train", 2], ["save", f"{d}/ck"], ["dump", "one"]])]}, d))
    check(launch(2, {"runs": [dict(c, stage=s, seed=4, actions=[["load", f"{d}/ck"], ["dump", f"two{s}"], ["train", 1]])
                              for s in (2, 3)]}, d + "/two"))
    one = load_file(f"{d}/one.safetensors")
    for s in (2, 3):
        assert_same(one, load_file(f"{d}/two/two{s}.safetensors"),
                    [k for k in one if k.startswith(("model/", "master/", "optim/", "buffer/"))])


def test_exclude_frozen_parameters_and_load_module_strict(tmp_path):
    """Without the frozen weights in the checkpoint a strict load is refused with a hint;
    load_module_strict=False restores the rest and keeps the model's own frozen weights."""
    d = str(tmp_path)
    c = dict(stage=2, dtype="bf16", frozen=["inp."], adacheck={"enabled": True})
    runs = [dict(c, actions=[["train", 2], ["save", f"{d}/ck", "t", {"exclude_frozen_parameters": True}],
                             ["dump", "A"]]),
            dict(c, hidden=37, actions=[["expect_error", "exclude_frozen_parameters", "load", f"{d}/ck"],
                                        ["load", f"{d}/ck", {"load_module_strict": False}], ["dump", "B"]])]
    check(launch(2, {"runs": runs}, d))
    man = json.load(open(f"{d}/ck/t/manifest.json"))
    assert not any("inp." in n for n in man["tensors"])
    assert_same(load_file(f"{d}/A.safetensors"), load_file(f"{d}/B.safetensors"))
    err = results(d)[1]["errors"][0]
    assert "missing ['inp.weight', 'inp.bias']" in err and "load_module_strict=False" in err


def test_four_ranks_resume_and_load_back_into_two(tmp_path):
    """DP=4 resumes bit-identically; a DP=4 ZeRO-3 checkpoint loads into DP=2 ZeRO-2 and ZeRO-0."""
    d = str(tmp_path)
    runs = []
    for s, dt in [(3, "fp32"), (1, "bf16")]:
        c = dict(stage=s, dtype=dt, adacheck={"enabled": True})
        runs += [dict(c, actions=[["train", 2], ["save", f"{d}/ck{s}"], ["dump", f"S{s}"], ["train", 2],
                                  ["dump", f"A{s}"]]),
                 dict(c, seed=5, actions=[["load", f"{d}/ck{s}"], ["train", 2], ["dump", f"B{s}"]])]
    check(launch(4, {"runs": runs}, d))
    res = results(d)
    for i, s in enumerate((3, 1)):
        assert res[2 * i]["losses"][2:] == res[2 * i + 1]["losses"], s
        assert_same(load_file(f"{d}/A{s}.safetensors"), load_file(f"{d}/B{s}.safetensors"))
    two = d + "/two"
    check(launch(2, {"runs": [dict(stage=s, dtype="fp32", seed=6, adacheck={"enabled": True},
                                   actions=[["load", f"{d}/ck3"], ["dump", f"L{s}"], ["train", 1]])
                              for s in (2, 0)]}, two))
    saved = load_file(f"{d}/S3.safetensors")
    for s in (2, 0):
        assert_same(saved, load_file(f"{two}/L{s}.safetensors"),
                    [k for k in saved if k.startswith(("model/", "master/", "optim/", "buffer/", "meta/lr"))])


def test_second_checkpoint_stores_only_what_changed(tmp_path):
    """ZeRO-0 on 4 ranks with a frozen layer: the second checkpoint references the frozen
    weights and unchanged buffers in the first instead of writing them again, and loads.
    Each save says what it wrote: one log line on rank 0, and ``engine.adacheck.last_save`` on
    every rank, whose stored bytes are the sizes of the files the save left (the filesystem's)."""
    d = str(tmp_path)
    c = dict(stage=0, dtype="fp32", frozen=["inp.", "norm."], hidden=64, adacheck={"enabled": True})
    out = check(launch(4, {"runs": [dict(c, actions=[["train", 2], ["save", f"{d}/ck", "a"], ["train", 2],
                                                     ["save", f"{d}/ck", "b"], ["dump", "B"]]),
                                    dict(c, seed=3, actions=[["load", f"{d}/ck"], ["dump", "L"]])]}, d))
    for tag in ("a", "b"):
        on_disk = sum(os.path.getsize(f"{d}/ck/{tag}/{f}") for f in os.listdir(f"{d}/ck/{tag}")
                      if f.endswith(".safetensors"))
        for r in range(4):
            report = results(d, r)[0]["last_save"][("a", "b").index(tag)]
            assert report["tag"] == tag and report["dir"] == f"{d}/ck/{tag}" and not report["async"], report
            assert report["stored_bytes"] == on_disk, (report, on_disk)
            assert report["logical_bytes"] > 0 and report["held_bytes"] >= report["logical_bytes"], report
        line = f"AdaCheck: saved {tag} (step {2 if tag == 'a' else 4}) to {d}/ck/{tag}: {human(on_disk)} written"
        assert out[0][1].count(line) == 1 and not any(line in text for _, text in out[1:]), line
    a = json.load(open(f"{d}/ck/a/manifest.json"))
    b = json.load(open(f"{d}/ck/b/manifest.json"))
    frozen = [n for n in b["tensors"] if n.startswith(("model/inp.", "model/norm.", "buffer/"))]
    assert len(frozen) == 5
    for n, t in b["tensors"].items():
        files = {x["file"] for x in t["boxes"]}
        if n in frozen:
            assert all(f.startswith("a/") for f in files), n
        if n.startswith(("model/out.", "optim/")):   # trained: written again
            assert not any(f.startswith("a/") for f in files), n
    expect = sum(4 * torch.Size(b["tensors"][n]["shape"]).numel() for n in frozen)
    assert b["stats"]["referenced_bytes"] >= expect
    assert b["stats"]["stored_bytes"] == a["stats"]["stored_bytes"] - b["stats"]["referenced_bytes"]
    assert_same(load_file(f"{d}/B.safetensors"), load_file(f"{d}/L.safetensors"))


def test_redundancy_factor_two_survives_a_damaged_copy(tmp_path):
    """redundancy_factor 2 on 4 ranks over 2 (pretend) nodes: every replicated box is written on
    both nodes; with one shard file damaged the load reads the other copy on every rank."""
    d = str(tmp_path)
    c = dict(stage=0, dtype="fp32", hidden=32, adacheck={"enabled": True, "redundancy_factor": 2})
    check(launch(4, {"nodes": ["n0", "n0", "n1", "n1"],
                     "runs": [dict(c, actions=[["train", 2], ["save", f"{d}/ck", "t"], ["dump", "S"]])]}, d))
    man = json.load(open(f"{d}/ck/t/manifest.json"))
    assert man["topology"]["nodes"] == ["n0", "n0", "n1", "n1"]
    for n, t in man["tensors"].items():
        if n.startswith(("model/", "optim/")):
            writers = [int(b["file"][4:9]) for b in t["boxes"]]
            assert len(writers) == 2 and {w // 2 for w in writers} == {0, 1}, n
    # damage the first model weight in one file (rank-private RNG state has only one copy)
    victim = os.path.join(d, "ck", "t", sorted(man["files"])[0])
    data = bytearray(open(victim, "rb").read())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = min(k for k in header if k.startswith("model/"))
    data[8 + n + header[key]["data_offsets"][0]] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    check(launch(4, {"runs": [dict(c, seed=4, actions=[["load", f"{d}/ck"], ["dump", "L"]])]}, d + "/l"))
    assert_same(load_file(f"{d}/S.safetensors"), load_file(f"{d}/l/L.safetensors"))
    from adacheck.cli import main as cli
    assert cli(["verify", "--quiet", f"{d}/ck"]) == 1   # the damaged copy is still reported


def test_ring_allgather_and_partitioned_exchanges_give_the_same_checkpoint(tmp_path):
    """Both exchanges give the same manifests; after the first save, ranks whose boxes did not
    change send only a digest and their hashes (fewer bytes, same manifests); a rank whose
    boxes changed sends its structure again (tests/test_core_references.py).  The partitioned
    exchange stores the same boxes (writers aside), and ZeRO-2 (saved asynchronously, by writer
    processes) and ZeRO-3 checkpoints saved with it load into a new engine with every tensor equal (DeepSpeed's own accessors) and the next
    step's loss equal to the saving run's."""
    d = str(tmp_path)
    c = dict(stage=1, dtype="bf16", frozen=["inp."])
    runs = [dict(c, adacheck={"enabled": True, "exchange": how},
                 actions=[["exchange_check"], ["train", 2], ["save", f"{d}/{how}", "t"], ["train", 1],
                          ["save", f"{d}/{how}", "t2"]])
            for how in ("ring", "allgather")]
    runs.append(dict(c, hidden=41, adacheck={"enabled": True}, actions=[["train", 1], ["save", f"{d}/other", "t"]]))
    part = {"enabled": True, "exchange": "partitioned"}
    runs.append(dict(c, adacheck=part, actions=[["train", 2], ["save", f"{d}/partitioned", "t"], ["train", 1],
                                                ["save", f"{d}/partitioned", "t2"]]))
    for stage in (2, 3):     # (ZeRO-2 saves asynchronously, in a writer process)
        runs.append(dict(stage=stage, dtype="bf16", adacheck=dict(part, async_save=stage == 2),
                         actions=[["train", 2], ["dump", f"z{stage}_saved"], ["save", f"{d}/z{stage}"], ["train", 1]]))
        runs.append(dict(stage=stage, dtype="bf16", seed=9, adacheck=part,
                         actions=[["load", f"{d}/z{stage}"], ["dump", f"z{stage}_loaded"], ["train", 1]]))
    # another layout: ZeRO-2's checkpoint into ZeRO-3 (format 6: each rank reads the pages of the parts
    # that meet the regions it loads)
    runs.append(dict(stage=3, dtype="bf16", seed=9, adacheck=part, actions=[["load", f"{d}/z2"], ["dump", "z2_in_z3"]]))
    check(launch(4, {"runs": runs}, d))
    assert_same(load_file(f"{d}/z2_saved.safetensors"), load_file(f"{d}/z2_in_z3.safetensors"))
    for r in range(4):
        ex = results(d, r)[0]["exchange"]
        assert ex["ring"] == ex["allgather"] == ex["expected"]
    for t in ("t", "t2"):
        ring, gather = (json.load(open(f"{d}/{how}/{t}/manifest.json")) for how in ("ring", "allgather"))
        assert ring["tensors"] == gather["tensors"] and ring["files"] == gather["files"], t
        part_m = read_manifest(f"{d}/partitioned/{t}")      # (format 6: its tensor table in parts)
        without_files = lambda tensors: {n: {k: v if k != "boxes" else [dict(b, file="/" in b["file"]) for b in v]  # noqa: E731
                                             for k, v in e.items()} for n, e in tensors.items()}
        assert without_files(ring["tensors"]) == without_files(tensors_json(part_m.tensors)), t
        assert part_m.format_version == 6 and ring["stats"]["stored_bytes"] == part_m.stats["stored_bytes"]
    # format 5 converts as the ring's format does: the same weights, bit for bit
    from adacheck.cli import main as cli
    for how in ("ring", "partitioned"):
        assert cli(["convert", f"{d}/{how}", f"{d}/{how}-weights", "--tag", "t2", "--to", "weights"]) == 0
    got = [load_file(f"{d}/{how}-weights/model.safetensors") for how in ("ring", "partitioned")]
    assert sorted(got[0]) == sorted(got[1]) and len(got[0]) > 3 and all(torch.equal(got[0][k], got[1][k]) for k in got[0])
    ring, gather, other = (results(d)[i]["exchanges"] for i in range(3))
    # caches are per job (engine): each engine's first save sends its structure
    assert [e["ranks_sent_digest_only"] for e in ring + gather + other] == [0, 4, 0, 4, 0]
    assert ring[1]["bytes_received"] < ring[0]["bytes_received"] / 2, ring
    assert other[0]["bytes_received"] > ring[1]["bytes_received"]
    for stage, i in ((2, 4), (3, 6)):
        assert_same(load_file(f"{d}/z{stage}_saved.safetensors"), load_file(f"{d}/z{stage}_loaded.safetensors"))
        saved, loaded = results(d)[i], results(d)[i + 1]
        # format 5, a load in the layout it saved: a rank reads its own rank file; it reads parts only
        # for what it did not hold (rank 0's objects), not the whole table (ZeRO-2's bf16 weights,
        # derived from every rank's fp32 partitions, DeepSpeed makes from the loaded partitions)
        parts = sum(os.path.getsize(f"{d}/z{stage}/global_step2/{f}") for f in os.listdir(f"{d}/z{stage}/global_step2")
                    if "-part-" in f)
        for r in range(4):
            own = os.path.getsize(f"{d}/z{stage}/global_step2/manifest-g0-rank-{r:05d}.json")
            (read,) = results(d, r)[i + 1]["manifest_read"]
            assert read["rank_files"] == own and read["parts"] < parts / 2, (stage, r, read, parts)
        assert loaded["losses"] == saved["losses"][-1:], stage
        assert not [w for w in saved["warnings"] if "AdaCheck" in w] and not saved["errors"], saved  # (the async save committed)


def test_diverged_replica_is_reported_and_both_copies_kept(tmp_path):
    d = str(tmp_path)
    c = dict(stage=0, dtype="fp32", adacheck={"enabled": True})
    res = check(launch(4, {"runs": [dict(c, actions=[["train", 1], ["perturb", 2, "out.weight"],
                                                    ["save", f"{d}/ck", "t"]])]}, d))
    assert "declared replicas diverged: model/out.weight" in res[0][1]
    man = json.load(open(f"{d}/ck/t/manifest.json"))
    boxes = man["tensors"]["model/out.weight"]["boxes"]
    assert sorted(b["holders"] for b in boxes) == [[0, 1, 3], [2]]
    assert len({b["hash"] for b in boxes}) == 2
    from adacheck.cli.commands import redundancy
    from adacheck.storage.commit import read_manifest
    div = redundancy(read_manifest(f"{d}/ck/t"))["diverged"]
    assert any(x.startswith("model/out.weight") and "rank 2" in x for x in div)
