"""Real megatron-core on CPU (gloo, 2 and 4 processes): resume, reshaping, flags end to end.

The models, parallel state, schedules, DDP and optimizers are megatron-core's own, built by
scripts/pretrain_gpt.py (adacheck_megatron.cpu redirects its CUDA device use to the CPU).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from launch import ROOT, check, free_port, launch

from adacheck.checkpoint import CheckpointReader, resolve

pytestmark = pytest.mark.timeout(900)

TRAINED = ("model", "master", "optim")


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def state(ckpt):
    """Every logical tensor of a checkpoint's model and optimizer (kind, name) -> tensor."""
    r = CheckpointReader(resolve(ckpt))
    return {n: r.read(n) for n, e in r.manifest.tensors.items() if e.kind in TRAINED}


def assert_same_state(a, b, names=None):
    a, b = state(a), state(b)
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


RESUME_2 = {   # layouts on 2 ranks
    "tp2_fp32": ["--tensor-model-parallel-size", "2"],
    "pp2_bf16": ["--pipeline-model-parallel-size", "2", "--bf16"],
    "dp2_distopt_bf16": ["--bf16", "--use-distributed-optimizer"],
    "pp2_vpp2_bf16": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                      "--num-layers-per-virtual-pipeline-stage", "1", "--bf16"],   # two chunks per rank
    "ep2_moe": ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
                "--moe-token-dispatcher-type", "alltoall"],
}


def resume_runs(tmp_path, layouts, gbs):
    runs = []
    for name, argv in layouts.items():
        argv = list(argv) + ["--global-batch-size", str(gbs)]
        ck, a, b = (str(tmp_path / f"{name}-{x}") for x in ("ck", "a", "b"))
        runs.append({"argv": argv, "actions": [["train", 3], ["save", ck], ["train", 2], ["save", a]]})
        runs.append({"argv": argv, "actions": [["scramble"], ["load", ck], ["train", 2], ["save", b]]})
    return runs


def check_resumed(tmp_path, layouts, res):
    for i, name in enumerate(layouts):
        uninterrupted, resumed = res[2 * i], res[2 * i + 1]
        assert resumed["loaded"] == [3], name
        assert uninterrupted["losses"][3:] == resumed["losses"], name
        n = assert_same_state(str(tmp_path / f"{name}-a"), str(tmp_path / f"{name}-b"))
        assert n > 10, name


def test_resume_bit_identical_and_reshape_on_2_ranks(tmp_path):
    """TP=2, PP=2, DP=2 with the distributed optimizer, PP=2 with 2 virtual stages (interleaved
    schedule), MoE EP=2: train 3, save, train 2 == scramble the weights, load, train 2 (losses
    and every tensor equal). Then reshaping: TP=2 -> PP=2, EP=2 -> EP=1 and the interleaved
    PP=2 x 2 virtual -> PP=2, exact equality of every logical tensor after the load."""
    runs = resume_runs(tmp_path, RESUME_2, gbs=4)
    tp2 = str(tmp_path / "tp2_fp32-ck")
    moe = str(tmp_path / "ep2_moe-ck")
    runs.append({"argv": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
                 "actions": [["scramble"], ["load", tp2], ["save", str(tmp_path / "tp2-to-pp2")], ["train", 1]]})
    runs.append({"argv": ["--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type",
                          "alltoall", "--global-batch-size", "4"],
                 "actions": [["scramble"], ["load", moe], ["save", str(tmp_path / "ep2-to-ep1")], ["train", 1]]})
    vpp = str(tmp_path / "pp2_vpp2_bf16-ck")
    runs.append({"argv": ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--bf16", "--global-batch-size", "4"],
                 "actions": [["scramble"], ["load", vpp], ["save", str(tmp_path / "vpp2-to-pp2")], ["train", 1]]})
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
    check_resumed(tmp_path, RESUME_2, res)
    assert res[-2]["loaded"] == [3] and res[-2]["losses"] == res[0]["losses"][3:]
    assert os.path.exists(os.path.join(nat, "iter_0000005", "manifest.json"))
    for rank in (0, 1):
        err = results(str(tmp_path), rank)[-1]["errors"]
        assert len(err) == 1 and "holds shape" in err[0] and "needs" in err[0], err
    assert_same_state(tp2, str(tmp_path / "tp2-to-pp2"))
    assert_same_state(moe, str(tmp_path / "ep2-to-ep1"))
    assert_same_state(vpp, str(tmp_path / "vpp2-to-pp2"))
    # the bf16 model weights are proven casts of the fp32 masters: stored once
    man = json.load(open(os.path.join(resolve(str(tmp_path / "pp2_bf16-ck")), "manifest.json")))
    model = {n: t for n, t in man["tensors"].items() if t["kind"] == "model"}
    assert model and all("derived" in t for t in model.values())


def test_reshape_on_4_ranks(tmp_path):
    """TP=2 x DP=2 (bf16) -> PP=2 x DP=2, TP=1 x DP=4, TP=2 x PP=2; TP=2 x DP=2 with the
    distributed optimizer -> DP=4 with it; every logical tensor exactly equal after the
    load, and training goes on."""
    src = str(tmp_path / "src")
    dsrc = str(tmp_path / "dsrc")
    g = ["--global-batch-size", "8", "--bf16"]
    targets = {"pp2dp2": ["--pipeline-model-parallel-size", "2"], "dp4": [],
               "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]}
    runs = [{"argv": g + ["--tensor-model-parallel-size", "2"], "actions": [["train", 2], ["save", src]]},
            {"argv": g + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
             "actions": [["train", 2], ["save", dsrc]]}]
    for name, argv in targets.items():
        runs.append({"argv": g + argv, "actions": [["scramble"], ["load", src], ["save", str(tmp_path / name)], ["train", 1]]})
    runs.append({"argv": g + ["--use-distributed-optimizer"],
                 "actions": [["scramble"], ["load", dsrc], ["save", str(tmp_path / "ddp4")], ["train", 1]]})
    check(launch(4, {"runs": runs}, str(tmp_path), script="megatron_worker.py"))
    for name in targets:
        assert_same_state(src, str(tmp_path / name))
    assert_same_state(dsrc, str(tmp_path / "ddp4"))


def torchrun(n, argv, cwd, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
           "--master_port", str(free_port()), os.path.join(ROOT, "scripts", "pretrain_gpt.py")] + argv
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


SCRIPT = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
          "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "200", "--lr", "1e-3",
          "--train-iters", "4", "--bf16"]


def losses(text):
    return [line.split(" time ")[0] + " " + line.split("exact-loss")[1] for line in text.splitlines()
            if line.startswith("iteration ")]


def test_pretrain_script_flags_end_to_end(tmp_path):
    """scripts/pretrain_gpt.py --adacheck: a job that stops at iteration 2 (saving into
    --adacheck-dir) and a new job that resumes from there by itself log the same losses as
    one uninterrupted job; bad flags are clear errors."""
    def run(n, argv, **kw):
        p = torchrun(n, argv, str(tmp_path), **kw)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout

    whole = run(2, SCRIPT + ["--adacheck", "--adacheck-dir", str(tmp_path / "a"), "--save-interval", "2",
                             "--adacheck-keep-last", "1"])
    assert "saved AdaCheck checkpoint iteration 4" in whole
    with open(tmp_path / "a" / "latest") as f:
        assert f.read().strip() == "iter_0000004"
    first = run(2, SCRIPT + ["--adacheck", "--adacheck-dir", str(tmp_path / "b"), "--exit-interval", "2",
                             "--save-interval", "2"])
    assert "exiting at iteration 2" in first
    second = run(2, SCRIPT + ["--adacheck", "--adacheck-dir", str(tmp_path / "b")])
    assert "loaded AdaCheck checkpoint iteration 2" in second
    assert losses(first) + losses(second) == losses(whole)
    assert len(losses(whole)) == 4
    bad = torchrun(1, SCRIPT[2:] + ["--adacheck", "--adacheck-keep-last", "-1"], str(tmp_path), timeout=120)
    assert bad.returncode != 0
    assert "--adacheck-keep-last must be >= 0" in bad.stderr
    orphan = torchrun(1, SCRIPT[2:] + ["--adacheck-exchange", "ring"], str(tmp_path), timeout=120)
    assert orphan.returncode != 0 and "without --adacheck" in orphan.stderr


def cli(*argv):
    p = subprocess.run([sys.executable, "-m", "adacheck.cli", *argv], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
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
