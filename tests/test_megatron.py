"""Real megatron-core on CPU (gloo, 2 and 4 processes): resume, reshaping, flags end to end.

The models, parallel state, schedules, DDP and optimizers are megatron-core's own, built by
scripts/pretrain_gpt.py (adacheck_megatron.cpu redirects its CUDA device use to the CPU).
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from launch import ROOT, check, free_port, launch

from adacheck.checkpoint import CheckpointReader, resolve
from adacheck.storage.commit import read_manifest

pytestmark = pytest.mark.timeout(900)

TRAINED = ("model", "master", "optim")
# native saves with the optimizer state in model space, so any layout's torch_dist reads it
NATIVE = ["--dist-ckpt-optim-fully-reshardable"]


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def state(ckpt):
    """Every logical tensor of a checkpoint's model and optimizer (kind, name) -> tensor."""
    r = CheckpointReader(resolve(ckpt))
    return {n: r.read(n) for n, e in r.manifest.tensors.items() if e.kind in TRAINED}


def assert_same_tensors(a, b, names=None):
    """Two {name: full tensor} dicts (``a`` saved, ``b`` after a reshape) hold the same tensors; a
    tensor whose shapes differ only by the vocabulary padding of another TP size agrees on the
    common part, and padding ``b`` has beyond ``a``'s is zero (rows ``a`` has beyond ``b``'s, of
    token ids that never occur, are dropped)."""
    names = sorted(a) if names is None else names
    assert set(names) <= set(b), sorted(set(names) - set(b))
    for n in names:
        x, y = a[n], b[n]
        assert x.dtype == y.dtype and x.dim() == y.dim(), n
        if x.shape != y.shape:   # vocabulary padded to another multiple of the TP size
            assert "word_embeddings" in n or "output_layer" in n, (n, x.shape, y.shape)
            common = tuple(slice(0, min(i, j)) for i, j in zip(x.shape, y.shape))
            pad = y.clone()
            pad[common] = 0
            assert not pad.any(), f"{n}: the padding of the larger vocabulary is not zero"
            x, y = x[common], y[common]
        assert torch.equal(x, y), f"{n} differs (max {(x.float() - y.float()).abs().max()})"
    return len(names)


def assert_same_state(a, b, names=None):
    return assert_same_tensors(state(a), state(b), names)


def torch_dist_full(out, *ckpts):
    """Every tensor of each torch_dist checkpoint, whole, read by megatron-core's own loader in a
    process of its own (tests/torch_dist_full.py): a list of {key: tensor}."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "torch_dist_full.py"), out, *ckpts],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert p.returncode == 0, failure(p)
    return [load_file(os.path.join(out, f"{i}.safetensors")) for i in range(len(ckpts))]


def assert_same_dumps(d, a, b, world):
    """Each rank's dumps ``a`` and ``b`` (its weights, main weights, optimizer state, LR, read from
    megatron-core's objects directly) are equal."""
    for r in range(world):
        x, y = load_file(f"{d}/{a}-rank{r}.safetensors"), load_file(f"{d}/{b}-rank{r}.safetensors")
        assert x.keys() == y.keys() and len(x) > 10, (a, b, r)
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (a, b, r, k)


RESUME_2 = {   # layouts on 2 ranks
    "tp2_fp32": ["--tensor-model-parallel-size", "2"],
    "pp2_bf16": ["--pipeline-model-parallel-size", "2", "--bf16"],
    "dp2_distopt_bf16": ["--bf16", "--use-distributed-optimizer", "--hidden-size", "128"],   # (weights > objects)
    "pp2_vpp2_bf16": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                      "--num-layers-per-virtual-pipeline-stage", "1", "--bf16"],   # two chunks per rank
    "ep2_moe": ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
                "--moe-token-dispatcher-type", "alltoall"],
}


def resume_runs(tmp_path, layouts, gbs):
    """Per layout: train 3, save (AdaCheck, then megatron-core's own torch_dist save of the same
    state), train 2, dump; and: other weights, load, train 2, dump."""
    runs = []
    for name, argv in layouts.items():
        argv = list(argv) + ["--global-batch-size", str(gbs)] + NATIVE
        ck, nat = (str(tmp_path / f"{name}-{x}") for x in ("ck", "nat"))
        runs.append({"argv": argv, "actions": [["train", 3], ["save", ck], ["save_native", nat], ["train", 2],
                                               ["dump", f"{name}-a"]]})
        runs.append({"argv": argv, "actions": [["scramble"], ["load", ck], ["train", 2], ["dump", f"{name}-b"]]})
    return runs


def check_resumed(tmp_path, layouts, res, world=2):
    for i, name in enumerate(layouts):
        uninterrupted, resumed = res[2 * i], res[2 * i + 1]
        assert resumed["loaded"] == [3], name
        assert uninterrupted["losses"][3:] == resumed["losses"], name
        assert_same_dumps(str(tmp_path), f"{name}-a", f"{name}-b", world)


def reshape_runs(tmp_path, name, argv, src, nat, steps, native_loads=True):
    """In the target layout ``argv``: other weights, AdaCheck load of ``src``, megatron-core's own
    torch_dist save of what was loaded (``<name>-nat``), train; and (``native_loads``) the same with
    megatron-core's load of the saving run's torch_dist checkpoint ``nat``, then train."""
    argv = list(argv) + NATIVE
    runs = [{"argv": argv, "actions": [["scramble"], ["load", src], ["save_native", str(tmp_path / f"{name}-nat")],
                                       ["train", steps]]}]
    if native_loads:   # (RNG states are per layout: neither load restores them here)
        runs.append({"argv": argv, "actions": [["scramble"], ["set_args", {"no_load_rng": True}],
                                               ["load_native", nat], ["train", steps]]})
    return runs


def test_resume_bit_identical_and_reshape_on_2_ranks(tmp_path):
    """TP=2, PP=2, DP=2 with the distributed optimizer, PP=2 with 2 virtual stages (interleaved
    schedule), MoE EP=2: train 3, save, train 2 == other weights, load, train 2 (losses, and every
    rank's own dump of its weights, main weights and optimizer state).  Reshaping TP=2 -> PP=2,
    EP=2 -> EP=1 and the interleaved PP=2 x 2 virtual -> PP=2, judged by megatron-core alone: the
    torch_dist checkpoint it saves after AdaCheck's load holds exactly the tensors of the one it
    saved in the saving layout (both read whole by its own loader), and the next iterations'
    losses equal those of a run that loads that native checkpoint with megatron-core (where it
    can: not EP=2 -> EP=1).  The TP=2, PP=2 and EP=2 jobs save with the partitioned exchange
    (--adacheck-exchange partitioned): the same checks judge it."""
    layouts = {k: v + (["--adacheck", "--adacheck-exchange", "partitioned"] if k in ("tp2_fp32", "pp2_bf16", "ep2_moe") else [])
               for k, v in RESUME_2.items()}
    runs = resume_runs(tmp_path, layouts, gbs=4)
    # (megatron-core 0.16.1 cannot load the EP=2 job's chained dense + expert optimizer into the
    # EP=1 job's single one: KeyError 'pre_wd_mult' in _filter_and_reorder_param_groups; there
    # the oracle is its full tensors alone)
    targets = [("tp2-to-pp2", ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], "tp2_fp32", True),
               ("ep2-to-ep1", ["--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type",
                               "alltoall", "--global-batch-size", "4"], "ep2_moe", False),
               ("vpp2-to-pp2", ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--bf16",
                                "--global-batch-size", "4"], "pp2_vpp2_bf16", True)]
    first_target = len(runs)
    for name, argv, src, native in targets:
        runs += reshape_runs(tmp_path, name, argv, str(tmp_path / f"{src}-ck"), str(tmp_path / f"{src}-nat"), 2,
                             native_loads=native)
    # weights only (--no-load-optim) into the distributed optimizer: what megatron-core's own load of
    # the native checkpoint gives (module weights, the main weights made from them as Megatron-LM
    # makes them, the next losses)
    no_optim = len(runs)
    dp_argv = layouts["dp2_distopt_bf16"] + ["--global-batch-size", "4"] + NATIVE
    runs.append({"argv": dp_argv, "actions": [["scramble"], ["set_args", {"no_load_optim": True}],
                                              ["load", str(tmp_path / "dp2_distopt_bf16-ck")], ["dump", "nlo-ada"],
                                              ["train", 2]]})
    runs.append({"argv": dp_argv, "actions": [["scramble"], ["load_native", str(tmp_path / "dp2_distopt_bf16-nat"),
                                                             {"no_load_optim": True}], ["dump", "nlo-nat"], ["train", 2]]})
    runs.append({"argv": dp_argv, "actions": [["scramble"], ["set_args", {"finetune": True}],     # (iteration 0)
                                              ["load", str(tmp_path / "dp2_distopt_bf16-ck")], ["dump", "ft-ada"]]})
    # and into TP=2, whose vocabulary is padded to more rows than the checkpoint's (224 > 208): the
    # rows both have are loaded, the rest is zero, as megatron-core's load gives them
    tp_argv = ["--tensor-model-parallel-size", "2"] + dp_argv
    runs.append({"argv": tp_argv, "actions": [["scramble"], ["set_args", {"no_load_optim": True, "no_load_rng": True}],
                                              ["load", str(tmp_path / "dp2_distopt_bf16-ck")], ["dump", "nlo-tp2-ada"],
                                              ["train", 2]]})
    runs.append({"argv": tp_argv, "actions": [["scramble"], ["load_native", str(tmp_path / "dp2_distopt_bf16-nat"),
                                                             {"no_load_optim": True, "no_load_rng": True}],
                                              ["dump", "nlo-tp2-nat"], ["train", 2]]})
    tp2 = str(tmp_path / "tp2_fp32-ck")
    # an existing run switches to AdaCheck: its torch_dist checkpoint loads natively, training
    # goes on exactly, the next save is AdaCheck's
    nat = str(tmp_path / "native")
    tp2_argv = RESUME_2["tp2_fp32"] + ["--global-batch-size", "4"]
    runs.append({"argv": tp2_argv, "actions": [["train", 3], ["save_native", nat]]})
    runs.append({"argv": tp2_argv, "actions": [["scramble"], ["load", nat], ["train", 2], ["save", nat]]})
    # another model: a clear error on every rank, and the model keeps its weights
    runs.append({"argv": ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--hidden-size", "64"],
                 "actions": [["expect_error", "model configurations differ", ["load", tp2]], ["train", 1]]})
    check(launch(2, {"runs": runs}, str(tmp_path), script="megatron_worker.py"))
    res = results(str(tmp_path))
    check_resumed(tmp_path, layouts, res)
    assert res[no_optim]["loaded"] == res[no_optim + 1]["loaded"] == [3]
    assert res[no_optim]["losses"] == res[no_optim + 1]["losses"]
    assert_same_dumps(str(tmp_path), "nlo-ada", "nlo-nat", 2)
    assert res[no_optim + 2]["loaded"] == [0]
    assert_same_dumps(str(tmp_path), "ft-ada", "nlo-nat", 2)
    assert res[no_optim + 3]["losses"] == res[no_optim + 4]["losses"]
    assert_same_dumps(str(tmp_path), "nlo-tp2-ada", "nlo-tp2-nat", 2)
    assert [res[2 * i].get("exchanges") for i in range(len(layouts))] == [
        ["partitioned" if "partitioned" in argv else "auto"] for argv in layouts.values()]
    for i, (name, argv) in enumerate(layouts.items()):
        if "partitioned" in argv:
            # format 5, the layout it saved: no part, no meta file; its own rank file, and rank 1 also
            # rank 0's where the main replicas of ShardedObjects it holds were saved (TP=2, DP=2)
            size = [os.path.getsize(tmp_path / f"{name}-ck" / "iter_0000003" / f"manifest-g0-rank-{r:05d}.json")
                    for r in (0, 1)]
            want = {"tp2_fp32": [size[0], size[0] + size[1]], "pp2_bf16": size, "ep2_moe": [size[0], sum(size)]}[name]
            for rank in (0, 1):
                got = results(str(tmp_path), rank)[2 * i + 1]["manifest_read"]
                assert [{k: x[k] for k in ("parts", "meta", "rank_files")} for x in got] == [
                    {"parts": 0, "meta": 0, "rank_files": want[rank]}], (name, rank)
    # the distributed optimizer's bf16 weights are made by megatron-core from the main weights each
    # rank loads (its own shard): no rank reads the other rank's fp32 main weights for them (4 bytes
    # per weight, half of them its own: rebuilding them read 2 bytes per weight more)
    i = list(layouts).index("dp2_distopt_bf16")
    for rank in (0, 1):
        dump = load_file(str(tmp_path / f"dp2_distopt_bf16-a-rank{rank}.safetensors"))
        own = sum(v.numel() * v.element_size() for k, v in dump.items() if k.startswith(("main", "state")))
        weights = sum(v.numel() for k, v in dump.items() if k.startswith("model"))
        read = results(str(tmp_path), rank)[2 * i + 1]["manifest_read"][0]["data"]
        assert read < own + 2 * weights, (rank, read, own, weights)     # (rebuilt: + the other rank's 2N)
        # without the optimizer state: its own half of the main weights (2 bytes per weight; rebuilding
        # the weights read all of them, 4)
        for k in (no_optim, no_optim + 2):
            read = results(str(tmp_path), rank)[k]["manifest_read"][0]["data"]
            print("weights-only load, rank", rank, "read", read, "bytes;", weights, "weights")
            assert read < 3 * weights, (rank, read, weights)
    i = first_target
    for name, _, _, native in targets:
        ada = res[i]
        assert ada["loaded"] == [3] and len(ada["losses"]) == 2, name
        if native:
            assert res[i + 1]["loaded"] == [3] and ada["losses"] == res[i + 1]["losses"], name
        i += 2 if native else 1
    full = torch_dist_full(str(tmp_path / "full"), *[str(tmp_path / x) for name, _, src, _ in targets
                                                     for x in (f"{src}-nat", f"{name}-nat")])
    for i, (name, _, _, _) in enumerate(targets):
        saved, reshaped = full[2 * i], full[2 * i + 1]
        assert set(saved) == set(reshaped), name
        assert assert_same_tensors(saved, reshaped) > 10, name
    assert res[-2]["loaded"] == [3] and res[-2]["losses"] == res[0]["losses"][3:]
    assert os.path.exists(os.path.join(nat, "iter_0000005", "manifest.json"))
    for rank in (0, 1):
        err = results(str(tmp_path), rank)[-1]["errors"]
        assert len(err) == 1 and "holds shape" in err[0] and "needs" in err[0], err
    # the bf16 model weights are proven casts of the fp32 masters: stored once
    man = read_manifest(resolve(str(tmp_path / "pp2_bf16-ck")))     # (partitioned: format 6, in parts)
    model = {n: t for n, t in man.tensors.items() if t.kind == "model"}
    assert man.format_version == 6 and model and all(t.derived is not None for t in model.values())


def test_reshape_on_4_ranks(tmp_path):
    """TP=2 x DP=2 (bf16) -> PP=2 x DP=2, TP=1 x DP=4, TP=2 x PP=2; TP=2 x DP=2 with the
    distributed optimizer -> DP=4 with it.  Judged by megatron-core alone, as on 2 ranks: its
    torch_dist save after AdaCheck's load holds exactly the tensors of its save in the saving
    layout; the losses after the load equal those after megatron-core's own load of that native
    checkpoint (not for the distributed optimizer to another TP size: megatron-core 0.16.1's
    loader fails there, KeyError 'step' with torch's Adam)."""
    src, nat = str(tmp_path / "src"), str(tmp_path / "src-nat")
    dsrc, dnat = str(tmp_path / "dsrc"), str(tmp_path / "dsrc-nat")
    g = ["--global-batch-size", "8", "--bf16"] + NATIVE
    targets = {"pp2dp2": ["--pipeline-model-parallel-size", "2"], "dp4": [],
               "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]}
    runs = [{"argv": g + ["--tensor-model-parallel-size", "2"],
             "actions": [["train", 2], ["save", src], ["save_native", nat]]},
            {"argv": g + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
             "actions": [["train", 2], ["save", dsrc], ["save_native", dnat]]}]
    for name, argv in targets.items():
        runs += reshape_runs(tmp_path, name, g + argv, src, nat, 1)
    runs += reshape_runs(tmp_path, "ddp4", g + ["--use-distributed-optimizer"], dsrc, dnat, 1, native_loads=False)
    check(launch(4, {"runs": runs}, str(tmp_path), script="megatron_worker.py"))
    res = results(str(tmp_path))
    for i, name in enumerate(targets):
        ada, native = res[2 + 2 * i], res[3 + 2 * i]
        assert ada["loaded"] == native["loaded"] == [2] and ada["losses"] == native["losses"], name
    names = list(targets) + ["ddp4"]
    full = torch_dist_full(str(tmp_path / "full"), nat, dnat, *[str(tmp_path / f"{n}-nat") for n in names])
    for i, name in enumerate(names):
        saved = full[1] if name == "ddp4" else full[0]
        assert set(saved) == set(full[2 + i]), name
        assert assert_same_tensors(saved, full[2 + i]) > 10, name


def torchrun(n, argv, cwd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for _ in range(3):   # another process took the free port before torchrun's store bound it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
               "--master_port", str(free_port()), os.path.join(ROOT, "scripts", "pretrain_gpt.py")] + argv
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode == 0 or "name: EADDRINUSE" not in p.stderr or "_rendezvous" not in p.stderr:
            return p
    return p


def failure(p) -> str:
    """What a failed torchrun shows: its output's end and each rank's first traceback (torchrun's
    own summary at the end of stderr would push them out of a plain tail)."""
    err, tracebacks = p.stderr, []
    for start in [m.start() for m in re.finditer("Traceback", err)][:4]:
        tracebacks.append(err[start:start + 4000])
    return p.stdout[-2000:] + "\n" + "\n".join(tracebacks) + "\n" + err[-2000:]


SCRIPT = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
          "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "200", "--lr", "1e-3",
          "--train-iters", "4", "--bf16"]


def losses(text):
    return [line.split(" time ")[0] + " " + line.split("exact-loss")[1] for line in text.splitlines()
            if line.startswith("iteration ")]


def test_pretrain_script_flags_end_to_end(tmp_path, monkeypatch):
    """scripts/pretrain_gpt.py --adacheck: a job that stops at iteration 3 (saving every iteration
    into the memory tier, --adacheck-tiers-memory; Megatron-LM's --non-persistent-save-interval 1
    with --save-interval 2: only iteration 2 is copied to --adacheck-dir before it ends, the
    newest at its clean exit) and a new job that resumes from there by itself log the same losses
    as one uninterrupted job (saving into --adacheck-dir directly); bad flags are clear errors."""
    monkeypatch.setenv("ADACHECK_JOB", "pretrain-flags")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", str(tmp_path / "shm"))

    def run(n, argv, **kw):
        p = torchrun(n, argv, str(tmp_path), **kw)
        assert p.returncode == 0, failure(p)
        return p.stdout

    whole = run(2, SCRIPT + ["--adacheck", "--adacheck-dir", str(tmp_path / "a"), "--save-interval", "2",
                             "--adacheck-keep-last", "1"])
    assert "saved AdaCheck checkpoint iteration 4" in whole
    with open(tmp_path / "a" / "latest") as f:
        assert f.read().strip() == "iter_0000004"
    tiers = ["--adacheck-tiers-memory", "--adacheck-tiers-persist-interval", "5"]
    # Megatron-LM's --non-persistent-save-interval: iterations 1 and 3 go to the memory tier only,
    # iteration 2 (--save-interval) to memory and the checkpoint directory at once; the newest
    # (3) is persisted at the clean exit
    first = run(2, SCRIPT + ["--adacheck", "--adacheck-dir", str(tmp_path / "b"), "--exit-interval", "3",
                             "--save-interval", "2", "--non-persistent-save-interval", "1"] + tiers)
    assert "exiting at iteration 3" in first
    with open(tmp_path / "b" / "latest") as f:
        assert f.read().strip() == "iter_0000003"        # (persisted at the clean exit)
    assert sorted(os.listdir(tmp_path / "b")) == ["README", "iter_0000002", "iter_0000003", "latest"]
    assert not os.listdir(tmp_path / "shm")               # (the job's memory files went at its exit)
    second = run(2, SCRIPT + ["--adacheck", "--adacheck-dir", str(tmp_path / "b")] + tiers)
    assert "loaded AdaCheck checkpoint iteration 3" in second
    assert losses(first) + losses(second) == losses(whole)
    assert len(losses(whole)) == 4
    bad = torchrun(1, SCRIPT[2:] + ["--adacheck", "--adacheck-keep-last", "-1"], str(tmp_path), timeout=120)
    assert bad.returncode != 0
    assert "--adacheck-keep-last must be >= 0" in bad.stderr
    bad = torchrun(1, SCRIPT[2:] + ["--adacheck", "--non-persistent-save-interval", "1"], str(tmp_path), timeout=120)
    assert bad.returncode != 0 and "add --adacheck --adacheck-tiers-memory" in bad.stderr, bad.stderr[-2000:]
    orphan = torchrun(1, SCRIPT[2:] + ["--adacheck-exchange", "ring"], str(tmp_path), timeout=120)
    assert orphan.returncode != 0 and "without --adacheck" in orphan.stderr


def cli(*argv):
    p = subprocess.run([sys.executable, "-m", "adacheck.cli", *argv], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert p.returncode == 0, failure(p)
    return p.stdout


def test_torch_dist_conversion_both_ways(tmp_path):
    """AdaCheck <-> megatron-core torch_dist, plain and distributed optimizer: the converted
    checkpoints are loaded by megatron-core's own dist_checkpointing.load (into PP=2) and by
    AdaCheck (into PP=2 and DP=2), and every logical tensor equals the state AdaCheck saved directly."""
    d = {k: str(tmp_path / k) for k in ("ada", "nat", "dada", "dnat", "T1", "T2", "A1", "A2",
                                         "ada_T1", "ada_T2", "ada_A1", "ada_A2")}
    g = ["--global-batch-size", "4", "--bf16"]
    dopt = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
    check(launch(2, {"runs": [
        {"argv": g + ["--tensor-model-parallel-size", "2"],
         "actions": [["train", 2], ["save", d["ada"]], ["save_native", d["nat"]]]},
        {"argv": g + dopt, "actions": [["train", 2], ["save", d["dada"]], ["save_native", d["dnat"]]]},
    ]}, str(tmp_path / "l1"), script="megatron_worker.py"))
    cli("convert", d["ada"], d["T1"], "--to", "torch-dist")
    cli("convert", d["dada"], d["T2"], "--to", "torch-dist")
    cli("convert", d["nat"], d["A1"], "--from", "torch-dist")
    cli("convert", d["dnat"], d["A2"], "--from", "torch-dist")
    assert_same_state(d["ada"], d["A1"])     # torch_dist -> AdaCheck holds exactly that state
    assert_same_state(d["dada"], d["A2"])
    no_rng = {"no_load_rng": True}
    check(launch(2, {"runs": [
        {"argv": g + ["--pipeline-model-parallel-size", "2"],
         "actions": [["scramble"], ["load_native", d["T1"], no_rng], ["save", d["ada_T1"]], ["train", 1]]},
        {"argv": g + ["--pipeline-model-parallel-size", "2"],
         "actions": [["scramble"], ["load", d["A1"]], ["save", d["ada_A1"]], ["train", 1]]},
        {"argv": g + dopt, "actions": [["scramble"], ["load", d["A2"]], ["save", d["ada_A2"]]]},
    ]}, str(tmp_path / "l2"), script="megatron_worker.py"))
    res = results(str(tmp_path / "l2"))
    assert [r["loaded"] for r in res] == [[2], [2], [2]]
    assert_same_state(d["ada"], d["ada_T1"])
    # megatron-core 0.16.1 cannot load a 'fully_reshardable' DistributedOptimizer checkpoint
    # with torch's Adam (KeyError 'step' in _set_main_param_and_optimizer_states, also for its
    # own saves), so T2 is read back with dist_checkpointing.load by the reverse conversion
    cli("convert", d["T2"], d["ada_T2"], "--from", "torch-dist")
    assert_same_state(d["dada"], d["ada_T2"])
    assert_same_state(d["ada"], d["ada_A1"])
    assert_same_state(d["dada"], d["ada_A2"])


SHARDED_OBJECTS = """
import argparse, json, sys, warnings
import torch
from adacheck_megatron import convert


def main():
    done = convert._solo_group()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=0),
                             "iteration": 3, "args": argparse.Namespace(lr=0.1),
                             "extra": ShardedObject("extra", {"a": 1}, (1,), (0,), replica_id=0)},
                            sys.argv[1])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = convert._plain_sharded_objects(sys.argv[1])
    done()
    print(json.dumps({"objects": got, "warnings": [str(x.message) for x in w
                                                   if "AdaCheck" in str(x.message)]}))


if __name__ == "__main__":
    main()
"""


def test_torch_dist_sharded_objects_are_converted_without_the_common_state(tmp_path):
    # megatron-core's dist_checkpointing.load returns the common state merged into what was
    # asked for, and from 0.19 the common state is itself a ShardedObject ('common_state'):
    # neither may come back as a sharded object of the rank (nor warn that args is not plain)
    script = tmp_path / "objects.py"
    script.write_text(SHARDED_OBJECTS)
    (tmp_path / "ckpt").mkdir()
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert p.returncode == 0, failure(p)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"objects": {"extra/shard_0_1": {"a": 1}}, "warnings": []}
