"""Online gradient deltas with real megatron-core (CPU, gloo, 2 processes): recovery
replays the committed deltas to exactly the state of the uninterrupted run."""
import json
import math
import os
import random
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from adacheck.storage.lease import LEASE_NAME
from adacheck.types import torch_dtype
from launch import ROOT, check, free_port, kill_at_marker, launch
from megatron_worker import BASE, pretrain_gpt

pytestmark = pytest.mark.timeout(900)

LAYOUTS = {"tp2-fp32": ["--tensor-model-parallel-size", "2", "--global-batch-size", "2"],
           "pp2-bf16": ["--pipeline-model-parallel-size", "2", "--bf16", "--global-batch-size", "4"],
           "dp2-distopt-bf16": ["--use-distributed-optimizer", "--bf16", "--global-batch-size", "4"],
           # the interleaved schedule: two model chunks of one layer per rank
           "pp2-vpp2-bf16": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                             "--num-layers-per-virtual-pipeline-stage", "1", "--bf16", "--global-batch-size", "4"]}


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def same(a, b, what):
    assert sorted(a) == sorted(b), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _resume_runs(d, name, argv):
    """2-rank runs of one layout: uninterrupted (8 iterations), recording 6 with bases every 3
    (into d/ck-<name>), and a new job that recovers from it and trains 2 more (checked by
    :func:`_check_resumed`)."""
    on = argv + ["--adacheck", "--adacheck-dir", f"{d}/ck-{name}", "--adacheck-online",
                 "--adacheck-online-base-interval", "3"]
    if name == "dp2-distopt-bf16":      # (its bases saved with the partitioned exchange)
        on += ["--adacheck-exchange", "partitioned"]
    return [{"argv": argv, "actions": [["train", 8]]},
            {"argv": on, "actions": [["online"], ["train", 6], ["dump", f"A-{name}"], ["online", False]]},
            {"argv": on, "actions": [["online"], ["scramble"], ["load", f"{d}/ck-{name}"], ["dump", f"B-{name}"],
                                     ["train", 2], ["online", False]]}]


def _check_resumed(d, name, i):
    """For the ``i``-th layout's :func:`_resume_runs`: recording changed no loss, the recovered
    job reached iteration 6 with every rank's state equal to the recording run's there, and went
    on with the uninterrupted run's losses."""
    ref, a, b = results(d)[3 * i: 3 * i + 3]
    assert a["losses"] == ref["losses"][:6], name          # recording changes nothing
    assert b["loaded"] == [6], name
    for r in (0, 1):
        same(load_file(f"{d}/A-{name}-rank{r}.safetensors"), load_file(f"{d}/B-{name}-rank{r}.safetensors"),
             f"{name} rank {r}")
    assert b["losses"] == ref["losses"][6:8], name


def test_recovery_replays_deltas_bit_exactly(tmp_path):
    """Bases every 3 iterations (1, 4), deltas 2-3 and 5-6; a new job's load replays base 4 +
    deltas 5, 6: every rank's weights, main weights, optimizer state and LR equal the
    uninterrupted run's, and the next losses equal those of a run never checkpointed.  (The
    distributed-optimizer layout saves its bases with the partitioned exchange: a manifest in
    parts.)"""
    d = str(tmp_path)
    check(launch(2, {"runs": [run for name, argv in LAYOUTS.items() for run in _resume_runs(d, name, argv)]}, d,
                 script="megatron_worker.py"))
    for i, name in enumerate(LAYOUTS):
        _check_resumed(d, name, i)
        ck = f"{d}/ck-{name}"
        # (the layouts run one after another in the same processes; a layout's checkpointer is let
        # go when the next one starts, and the lease of its directory is left to expire)
        listed = sorted(f for f in os.listdir(ck) if f != LEASE_NAME)
        assert listed == ["README", "iter_0000001", "iter_0000004", "iter_0000007", "latest"], name
        parts = [f for f in os.listdir(f"{ck}/iter_0000004") if f.startswith("manifest-g")]
        assert bool(parts) == (name == "dp2-distopt-bf16"), (name, parts)


def test_bf16_reduced_gradients_are_stored_in_bf16_before_clipping(tmp_path):
    """bf16 with --grad-reduce-in-bf16 (DP=2 with the distributed optimizer, and PP=2 without):
    the main gradients are exact bf16 values until Megatron scales them for clipping, which it
    does at every recorded iteration here (norm > --clip-grad). The deltas hold them as they were
    before (2 bytes each, every one) with the norm, and recovery clips them again with
    megatron-core's function: base 4 + deltas 5, 6 equal the uninterrupted run at iteration 6,
    training goes on with its losses, and the distributed optimizer's deltas also replay on one
    rank (the shards rebuilt and clipped) to the state of an uninterrupted run's checkpoint
    (iteration 6 of the chain that the resumed job extended to 8)."""
    from adacheck.online import deltas
    d = str(tmp_path)
    layouts = {"distopt": ["--use-distributed-optimizer", "--bf16", "--grad-reduce-in-bf16", "--global-batch-size", "4"],
               "pp2": ["--pipeline-model-parallel-size", "2", "--bf16", "--grad-reduce-in-bf16",
                       "--global-batch-size", "4"]}
    runs = [run for name, argv in layouts.items() for run in _resume_runs(d, name, argv)]
    runs.append({"argv": layouts["distopt"] + ["--adacheck"], "actions": [["train", 6], ["save", f"{d}/ref"]]})
    check(launch(2, {"runs": runs}, d, script="megatron_worker.py"))
    for i, name in enumerate(layouts):
        _check_resumed(d, name, i)
        ck = f"{d}/ck-{name}/iter_0000004"
        steps, _ = deltas.committed_steps(ck, 4, 2)
        assert [s.step for s in steps] == [5, 6], name
        assert deltas.summary(ck, 4, 2)["bf16_share"] == 1.0, name      # (what `adacheck inspect` shows)
        for st in steps:
            metas = [m for r in (0, 1) for m in st.records[r]["tensors"].values()]
            assert metas and {(m["dtype"], m["stored"]) for m in metas} == {("float32", "bfloat16")}, (name, st.step)
            for r in (0, 1):
                pre = deltas.read_extra(ck, st, r)["preclip"]
                assert set(pre) >= set(st.records[r]["tensors"]), (name, st.step, r)
                assert all(v["norm"] > v["clip"] for v in pre.values()), (name, st.step, r)   # it did clip
    check(launch(1, {"runs": [{"argv": layouts["distopt"] + ["--adacheck", "--ckpt-step", "6"],
                               "actions": [["scramble"], ["load", f"{d}/ck-distopt"], ["save", f"{d}/one/out"]]}]},
                 f"{d}/one", script="megatron_worker.py"))
    assert results(f"{d}/one")[0]["loaded"] == [6]
    same_checkpoint(f"{d}/ref", f"{d}/one/out", "bf16-reduced gradients, distributed optimizer, DP=2 -> 1")


def test_grad_reduce_in_bf16_needs_bf16(capsys):
    assert pretrain_gpt.parse_args(argv=BASE + ["--global-batch-size", "4", "--bf16", "--grad-reduce-in-bf16"]).grad_reduce_in_bf16
    with pytest.raises(SystemExit):
        pretrain_gpt.parse_args(argv=BASE + ["--global-batch-size", "4", "--grad-reduce-in-bf16"])
    assert "--grad-reduce-in-bf16 needs --bf16" in capsys.readouterr().err


def test_sigkill_at_a_random_iteration_then_recover_and_continue(tmp_path):
    """PP=2 bf16 with online deltas (bases every 5 iterations); rank 1 is SIGKILLed after a random
    iteration; a new job recovers the newest committed iteration with every rank's state equal to
    the uninterrupted run's there, and finishes with the uninterrupted run's losses."""
    d = str(tmp_path)
    argv = LAYOUTS["pp2-bf16"]
    on = argv + ["--adacheck", "--adacheck-dir", f"{d}/ck", "--adacheck-online", "--adacheck-online-base-interval", "5"]
    check(launch(2, {"runs": [{"argv": argv, "actions": [["train_dump", 16, "U"]]}]}, f"{d}/u",
                 script="megatron_worker.py"))
    ref = results(f"{d}/u")[0]["losses"]
    kill_after = random.Random(os.getpid()).randint(3, 11)
    res = launch(2, {"runs": [{"argv": on, "actions": [["online"], ["train_dump", 16, "K", "m"]]}]}, f"{d}/k",
                 script="megatron_worker.py", grace=30, on_started=kill_at_marker(f"{d}/k/m{kill_after}-rank1", jitter=0.2))
    assert res[1][0] == -signal.SIGKILL, res[1][1][-3000:]
    check(launch(2, {"runs": [{"argv": on, "actions": [["online"], ["scramble"], ["load", f"{d}/ck"],
                                                       ["dump", "R"], ["train_to", 16], ["online", False]]}]},
                 f"{d}/r", script="megatron_worker.py"))
    r = results(f"{d}/r")[0]
    t = r["loaded"][0]
    assert kill_after - 1 <= t <= 16, (t, kill_after)
    for rank in (0, 1):
        same(load_file(f"{d}/u/U{t}-rank{rank}.safetensors"), load_file(f"{d}/r/R-rank{rank}.safetensors"),
             f"iteration {t} rank {rank}")
    assert r["losses"] == ref[t:16]


def test_training_script_materialises_deltas_offline(tmp_path):
    """The user's route to a checkpoint that holds online deltas as one state: run the training
    script with the conversion flags (as Megatron-LM's --ckpt-convert-format). PP=2 bf16, bases at
    iterations 1 and 6, deltas 7-8: --adacheck-convert-save makes one AdaCheck checkpoint of the
    newest iteration (8), --ckpt-step 7 --ckpt-convert-format torch_dist a native one of
    iteration 7; loaded into a new job, each equals the training run's state there exactly."""
    d = str(tmp_path)
    flags = LAYOUTS["pp2-bf16"]
    ck = f"{d}/ck"
    on = flags + ["--adacheck", "--adacheck-dir", ck, "--adacheck-online", "--adacheck-online-base-interval", "5"]
    check(launch(2, {"runs": [{"argv": on, "actions": [["online"], ["train", 7], ["dump", "A7"], ["train", 1],
                                                        ["dump", "A8"], ["online", False]]}]}, d,
                 script="megatron_worker.py"))
    assert sorted(os.listdir(ck)) == ["README", "iter_0000001", "iter_0000006", "latest"]
    script = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(free_port()), os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *BASE, *flags, "--adacheck",
              "--load", ck]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(*extra):
        p = subprocess.run([*script, *extra], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout

    assert "converted checkpoint iteration 8" in run("--adacheck-convert-save", f"{d}/out8")
    assert "converted checkpoint iteration 7" in run("--ckpt-step", "7", "--ckpt-convert-format", "torch_dist",
                                                      "--ckpt-convert-save", f"{d}/nat")
    assert sorted(os.listdir(f"{d}/out8")) == ["README", "iter_0000008", "latest"]
    assert not os.path.exists(f"{d}/out8/iter_0000008/deltas")        # one state, no chain
    assert sorted(os.listdir(ck)) == ["README", "iter_0000001", "iter_0000006", "latest"]   # the source is untouched
    bad = subprocess.run([*script, "--ckpt-step", "9", "--adacheck-convert-save", f"{d}/out9"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode != 0 and "step 9" in bad.stdout + bad.stderr and not os.path.exists(f"{d}/out9")
    before = sorted(os.listdir(f"{d}/out8/iter_0000008"))
    again = subprocess.run([*script, "--adacheck-convert-save", f"{d}/out8"], capture_output=True, text=True,
                           timeout=300, env=env)            # never over an existing checkpoint
    assert again.returncode != 0 and "already exists; nothing was written" in again.stdout + again.stderr
    assert sorted(os.listdir(f"{d}/out8/iter_0000008")) == before
    check(launch(2, {"runs": [
        {"argv": flags + ["--adacheck"], "actions": [["scramble"], ["load", f"{d}/out8"], ["dump", "C8"]]},
        {"argv": flags, "actions": [["scramble"], ["load_native", f"{d}/nat/torch_dist"], ["dump", "C7"]]},
    ]}, f"{d}/l2", script="megatron_worker.py"))
    assert [r["loaded"] for r in results(f"{d}/l2")] == [[8], [7]]
    for r in (0, 1):
        same(load_file(f"{d}/A8-rank{r}.safetensors"), load_file(f"{d}/l2/C8-rank{r}.safetensors"), f"8 rank {r}")
        same(load_file(f"{d}/A7-rank{r}.safetensors"), load_file(f"{d}/l2/C7-rank{r}.safetensors"), f"7 rank {r}")


def test_overlapped_param_gather_bases_hold_the_step_s_weights(tmp_path):
    """--overlap-grad-reduce --overlap-param-gather with the distributed optimizer (DP=2, bf16),
    through the training script, which runs the first iteration after a start without the
    forward pre-hooks, as Megatron-LM does: a step updates only each rank's own shard of the
    weights, so an online base taken right after it must all-gather the rest first.  Resuming
    from base 4 and from base 4 + delta 5 gives the uninterrupted run's losses exactly, and no
    base saw diverged replicas."""
    d = str(tmp_path)
    flags = [*BASE, "--use-distributed-optimizer", "--bf16", "--global-batch-size", "4", "--overlap-grad-reduce",
             "--overlap-param-gather", "--train-iters", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(*extra):
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(free_port()), os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *flags, *extra],
                           capture_output=True, text=True, timeout=300, env=env)
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-4000:]
        assert "replicas diverged" not in out, out[-4000:]
        return {int(m[1]): m[2] for m in re.finditer(r"^iteration (\d+) loss .* exact-loss (\S+)", out, re.M)}

    ref = run()
    ada = ["--adacheck", "--adacheck-dir", f"{d}/ck"]
    assert run(*ada, "--adacheck-online", "--adacheck-online-base-interval", "3") == ref
    assert run(*ada, "--ckpt-step", "4") == {i: ref[i] for i in range(5, 9)}
    assert run(*ada, "--ckpt-step", "5") == {i: ref[i] for i in range(6, 9)}


def same_checkpoint(a, b, what):
    """Every logical tensor (per-rank RNG states aside), the iteration and the scheduler of two
    AdaCheck checkpoints are equal."""
    from adacheck.checkpoint import CheckpointReader, resolve
    ra, rb = CheckpointReader(resolve(a)), CheckpointReader(resolve(b))
    names = sorted(n for n in ra.manifest.tensors if not n.startswith("rank"))
    assert names == sorted(n for n in rb.manifest.tensors if not n.startswith("rank")), what
    assert any(n.startswith("optimizer.state.exp_avg_sq.") for n in names), what
    for name in names:
        x, y = ra.read(name), rb.read(name)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {name} differs"
    oa, ob = ra.objects(), rb.objects()
    for k in ("iteration", "opt_param_scheduler"):
        assert oa[k] == ob[k], (what, k)


def test_deltas_replay_on_another_number_of_data_parallel_ranks(tmp_path):
    """Deltas recorded at DP=2 replay in a 1-rank job (bf16): base 4 + deltas 5, 6 equal the DP=2
    run's state at iteration 6 exactly. Without the distributed optimizer every data-parallel
    rank steps the same optimizer; with it, each recovering rank rebuilds the saving ranks'
    shards that overlap its own from the base and steps them with their records: also exact,
    from DP=2 to 1 and from 1 to 2 (compared as checkpoints saved after the recovery and by an
    uninterrupted run).  In another tensor-parallel size they do not replay: the base loads."""
    d = str(tmp_path)
    dp = ["--bf16", "--global-batch-size", "4"]
    dist = dp + ["--use-distributed-optimizer"]
    on = ["--adacheck-online", "--adacheck-online-base-interval", "3"]
    check(launch(2, {"runs": [
        {"argv": dp + ["--adacheck", "--adacheck-dir", f"{d}/ck"] + on,
         "actions": [["online"], ["train", 6], ["dump", "A"], ["online", False]]},
        {"argv": dist + ["--adacheck", "--adacheck-dir", f"{d}/dk"] + on,
         "actions": [["online"], ["train", 6], ["online", False]]},
        {"argv": dist + ["--adacheck"], "actions": [["train", 6], ["save", f"{d}/ref"]]},
    ]}, d, script="megatron_worker.py"))
    check(launch(1, {"runs": [
        {"argv": dp + ["--adacheck"], "actions": [["scramble"], ["load", f"{d}/ck"], ["dump", "B"]]},
        {"argv": dist + ["--adacheck"], "actions": [["scramble"], ["load", f"{d}/dk"], ["save", f"{d}/one/out"]]},
        {"argv": dist + ["--adacheck", "--adacheck-dir", f"{d}/one/dk"] + on,
         "actions": [["online"], ["train", 6], ["online", False]]},
        {"argv": dist + ["--adacheck"], "actions": [["train", 6], ["save", f"{d}/one/ref"]]},
    ]}, f"{d}/one", script="megatron_worker.py"))
    assert [r["loaded"] for r in results(f"{d}/one")][:2] == [[6], [6]]
    same(load_file(f"{d}/A-rank0.safetensors"), load_file(f"{d}/one/B-rank0.safetensors"), "DP=2 -> 1")
    same_checkpoint(f"{d}/ref", f"{d}/one/out", "distributed optimizer, DP=2 -> 1")
    check(launch(2, {"runs": [
        {"argv": dist + ["--adacheck"], "actions": [["scramble"], ["load", f"{d}/one/dk"], ["save", f"{d}/two/out"]]},
        # TP=2 is another layout, where these deltas do not replay: the job holds base 4, and
        # asking for iteration 6 is an error that says why
        {"argv": dp + ["--tensor-model-parallel-size", "2", "--adacheck"],
         "actions": [["load", f"{d}/ck"], ["set_args", {"ckpt_step": 6}],
                     ["expect_error", "step 6 is reached by replaying the online deltas", ["load", f"{d}/ck"]]]},
    ]}, f"{d}/two", script="megatron_worker.py"))
    assert [r["loaded"] for r in results(f"{d}/two")] == [[6], [4]]
    assert "in another layout (TP=1" in results(f"{d}/two")[1]["errors"][0]
    same_checkpoint(f"{d}/one/ref", f"{d}/two/out", "distributed optimizer, DP=1 -> 2")


MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
       "--moe-token-dispatcher-type", "alltoall", "--bf16", "--global-batch-size", "8",
       "--use-distributed-optimizer", "--adacheck"]


@pytest.mark.parametrize("world,extra", [
    (4, []),
    # expert tensor parallelism 2 (Megatron-LM's default: = TP), which MoE runs only with
    # sequence parallelism; a rank's TP and expert-TP ranks come from two separate grids
    (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
], ids=["ep2", "tp2-ep2-etp2"])
def test_expert_parallel_deltas_replay_on_fewer_data_parallel_ranks(tmp_path, world, extra):
    """MoE with 4 experts at expert parallelism 2 and the distributed optimizer (bf16): recorded
    on ``world`` ranks (dense data parallelism 4, expert data parallelism 2), the deltas replay
    on half as many (2 and 1). The dense shards come from the saving ranks of every
    expert-parallel rank at this rank's TP rank, the expert shards from those at its expert
    and expert-TP ranks: the checkpoint saved after the recovery equals the one of an
    uninterrupted run at iteration 6."""
    d = str(tmp_path)
    moe = MOE + extra
    on = ["--adacheck-dir", f"{d}/ck", "--adacheck-online", "--adacheck-online-base-interval", "3"]
    check(launch(world, {"runs": [
        {"argv": moe + on, "actions": [["online"], ["train", 6], ["online", False]]},
        {"argv": moe, "actions": [["train", 6], ["save", f"{d}/ref"]]},
    ]}, d, script="megatron_worker.py"))
    check(launch(world // 2, {"runs": [{"argv": moe, "actions": [["scramble"], ["load", f"{d}/ck"],
                                                                ["save", f"{d}/half/out"]]}]},
                 f"{d}/half", script="megatron_worker.py"))
    assert results(f"{d}/half")[0]["loaded"] == [6]
    same_checkpoint(f"{d}/ref", f"{d}/half/out", f"MoE {' '.join(extra)} EP=2, distributed optimizer, DP=4 -> 2")


def _record_and_recover(d, argv, what, half=True):
    """On 4 ranks: 6 iterations recorded with online deltas into d/ck (bases every 3), an
    uninterrupted run saved at iteration 6 (d/ref), and a new layout-equal job that recovers
    from d/ck and saves (d/same/out); then (``half``) a 2-rank job that recovers from d/ck and
    saves (d/half/out). Both must equal d/ref. Returns the committed delta steps of base 4
    (5 and 6)."""
    from adacheck.online import deltas
    on = ["--adacheck-dir", f"{d}/ck", "--adacheck-online", "--adacheck-online-base-interval", "3"]
    check(launch(4, {"runs": [
        {"argv": argv + on, "actions": [["online"], ["train", 6], ["online", False]]},
        {"argv": argv, "actions": [["train", 6], ["save", f"{d}/ref"]]},
        {"argv": argv, "actions": [["scramble"], ["load", f"{d}/ck"], ["save", f"{d}/same/out"]]},
    ]}, d, script="megatron_worker.py"))
    assert results(d)[2]["loaded"] == [6]
    same_checkpoint(f"{d}/ref", f"{d}/same/out", what + ", same layout")
    steps, _ = deltas.committed_steps(f"{d}/ck/iter_0000004", 4, 4)
    assert [s.step for s in steps] == [5, 6]
    if not half:
        return steps
    check(launch(2, {"runs": [{"argv": argv, "actions": [["scramble"], ["load", f"{d}/ck"], ["save", f"{d}/half/out"]]}]},
                 f"{d}/half", script="megatron_worker.py"))
    assert results(f"{d}/half")[0]["loaded"] == [6]
    same_checkpoint(f"{d}/ref", f"{d}/half/out", what + ", DP=4 -> 2")
    return steps


def _stored_once(steps):
    """Each step's gradient names per rank; asserts that no gradient is in two ranks' records."""
    out = []
    for st in steps:
        keys = [set(st.records[r]["tensors"]) for r in sorted(st.records)]
        assert all(keys), [len(k) for k in keys]
        assert sum(map(len, keys)) == len(set().union(*keys)), "a gradient stored by two ranks"
        out.append(keys)
    return out


REPLICATED_MOE = [x for x in MOE if x != "--use-distributed-optimizer"]


def test_replicated_moe_gradients_are_stored_once(tmp_path):
    """MoE EP=2 without the distributed optimizer (bf16; a chained optimizer: dense + experts):
    every one of the 4 data-parallel ranks steps the same optimizer. Dense gradients are named
    without the expert-parallel rank (all 4 ranks hold them) and split over the 4 ranks, expert
    ones carry their expert-parallel rank and are split over the 2 ranks that hold them: no
    gradient is in two ranks' records (each rank wrote all of its own until 538ff11, then dense
    ones were stored once per expert-parallel rank). The deltas replay in the saving layout and
    on 2 ranks: both equal an uninterrupted run's checkpoint at iteration 6."""
    steps = _record_and_recover(str(tmp_path), REPLICATED_MOE, "MoE EP=2, replicated optimizer")
    for keys, st in zip(_stored_once(steps), steps):
        names = set().union(*keys)
        dense = {k for k in names if k.startswith("tp0.pp0.o")}
        expert = names - dense
        assert dense and {k.split(".")[1] for k in expert} == {"ep0", "ep1"}, sorted(names)
        assert all(k.startswith("pp0.ep") and ".etp0.o" in k for k in expert), sorted(expert)
        # every rank writes some of the dense gradients (split over all 4, not per EP rank)
        assert all(k & dense for k in keys), [len(k & dense) for k in keys]
        stored = sum(math.prod(m["shape"]) * torch_dtype(m["stored"]).itemsize
                     for r in range(4) for m in st.records[r]["tensors"].values())
        print(f"step {st.step}: {len(names)} gradients ({len(dense)} dense), {stored} bytes")


def test_replicated_moe_expert_gradients_are_named_by_the_expert_grid(tmp_path):
    """MoE at TP=1, EP=2, expert TP=2, without the distributed optimizer, on 4 ranks (expert
    data parallelism 1): every rank holds other expert halves, and all 4 hold the dense
    parameters, which DDP all-reduces over them. Expert gradient names give the expert grid's
    coordinates (pp.ep.etp): ranks 0 and 1 have the same TP and EP ranks but different expert
    halves, which names carrying tp, pp and ep could not tell apart, so every rank had to write
    all of its gradients, dense ones included. Now each dense gradient is stored once (by one of
    the 4) and each expert half by its rank; recovery equals an uninterrupted run."""
    moe = REPLICATED_MOE + ["--expert-tensor-parallel-size", "2"]
    steps = _record_and_recover(str(tmp_path), moe, "MoE TP=1 EP=2 ETP=2, replicated optimizer", half=False)
    for keys in _stored_once(steps):
        names = set().union(*keys)
        expert = {k for k in names if k.startswith("pp0.")}
        assert {tuple(k.split(".")[1:3]) for k in expert} == {(e, x) for e in ("ep0", "ep1") for x in ("etp0", "etp1")}
        assert {k.split(".")[0] for k in names - expert} == {"tp0"}, sorted(names - expert)
        assert all(k - expert for k in keys), "the dense gradients are split over all 4 ranks"


def test_replicated_moe_deltas_recorded_under_the_old_names_still_replay(tmp_path):
    """A job records as versions before per-kind gradient names did (every name
    tp<t>.pp<p>.ep<e>., every rank writing all of its own; MoE EP=2, no distributed
    optimizer): base 5, delta 6. A job of this version recovers (replaying delta 6 through the
    names' aliases) and trains on, appending deltas 7 and 8 under today's names to the same
    chain, with the uninterrupted run's losses. That mixed chain recovers on 4 and on 2 ranks
    to the uninterrupted run's checkpoint at iteration 8."""
    from adacheck.online import deltas
    d = str(tmp_path)
    on = ["--adacheck-dir", f"{d}/ck", "--adacheck-online", "--adacheck-online-base-interval", "4"]
    check(launch(4, {"runs": [
        {"argv": REPLICATED_MOE + on, "actions": [["online_legacy"], ["train", 6], ["online", False]]},
        {"argv": REPLICATED_MOE, "actions": [["train", 8], ["save", f"{d}/ref"]]},
        {"argv": REPLICATED_MOE + on, "actions": [["online"], ["scramble"], ["load", f"{d}/ck"], ["train", 2],
                                                  ["online", False]]},
        {"argv": REPLICATED_MOE, "actions": [["scramble"], ["load", f"{d}/ck"], ["save", f"{d}/same/out"]]},
    ]}, d, script="megatron_worker.py"))
    res = results(d)
    assert res[2]["loaded"] == [6] and res[2]["losses"] == res[1]["losses"][6:] and res[3]["loaded"] == [8]
    same_checkpoint(f"{d}/ref", f"{d}/same/out", "MoE EP=2, old and new gradient names, same layout")
    steps, _ = deltas.committed_steps(f"{d}/ck/iter_0000005", 5, 4)
    assert [s.step for s in steps] == [6, 7, 8]
    old = [set(steps[0].records[r]["tensors"]) for r in range(4)]
    assert all(k.startswith("tp0.pp0.ep") for k in set().union(*old))
    # each rank wrote all of its own: the two ranks at an expert-parallel rank the same
    assert len({frozenset(k) for k in old}) == 2 and all(len({n.split(".")[2] for n in k}) == 1 for k in old)
    assert not any(k.startswith("tp0.pp0.ep") for k in set().union(*_stored_once(steps[1:])[0]))
    check(launch(2, {"runs": [{"argv": REPLICATED_MOE, "actions": [["scramble"], ["load", f"{d}/ck"],
                                                                   ["save", f"{d}/half/out"]]}]},
                 f"{d}/half", script="megatron_worker.py"))
    assert results(f"{d}/half")[0]["loaded"] == [8]
    same_checkpoint(f"{d}/ref", f"{d}/half/out", "MoE EP=2, old and new gradient names, DP=4 -> 2")


FP16 = ["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1", "--loss-scale-window", "2"]


def test_fp16_steps_the_loss_scaler_skipped_replay_exactly(tmp_path):
    """fp16 with dynamic loss scaling (TP=2, and DP=2 with the distributed optimizer): the first
    iterations overflow and are skipped, so the base of iteration 1 holds an optimizer that never
    applied an update (no moments yet), and later skips fall inside the delta chains. Recovery
    of the newest state (base 4 + deltas 5, 6) and of iteration 3 (base 1 + skipped deltas 2, 3)
    equals the uninterrupted run there exactly, loss scale and its trackers included, and
    training goes on with the uninterrupted run's losses and skips."""
    d = str(tmp_path)
    # the seed decides which iterations overflow: this one puts skips inside both chains (checked below)
    layouts = {"tp2": ["--tensor-model-parallel-size", "2", "--global-batch-size", "2", "--seed", "1"] + FP16,
               "distopt": ["--use-distributed-optimizer", "--global-batch-size", "4", "--seed", "1"] + FP16}
    runs = []
    for name, argv in layouts.items():
        on = argv + ["--adacheck", "--adacheck-dir", f"{d}/ck-{name}", "--adacheck-online",
                     "--adacheck-online-base-interval", "3"]
        runs += [{"argv": argv, "actions": [["train", 8]]},
                 {"argv": on, "actions": [["online"], ["train_dump", 6, f"A-{name}-"], ["online", False]]},
                 {"argv": on, "actions": [["scramble"], ["load", f"{d}/ck-{name}"], ["dump", f"B-{name}"],
                                          ["train", 2]]},
                 {"argv": on + ["--ckpt-step", "3"], "actions": [["scramble"], ["load", f"{d}/ck-{name}"],
                                                                ["dump", f"C-{name}"], ["train", 1]]}]
    check(launch(2, {"runs": runs}, d, script="megatron_worker.py"))
    res = results(d)
    for i, name in enumerate(layouts):
        ref, a, b, c = res[4 * i: 4 * i + 4]
        skipped = ref.get("skipped", [])
        assert 1 in skipped and set(skipped) & {5, 6} and 4 not in skipped, (name, skipped)
        assert a["losses"] == ref["losses"][:6] and a.get("skipped") == [s for s in skipped if s <= 6], name
        assert b["loaded"] == [6] and c["loaded"] == [3], name
        for r in (0, 1):
            for got, it in (("B", 6), ("C", 3)):
                want = load_file(f"{d}/A-{name}-{it}-rank{r}.safetensors")
                assert any(k.startswith("grad_scaler") for k in want), name
                same(want, load_file(f"{d}/{got}-{name}-rank{r}.safetensors"), f"{name} iteration {it} rank {r}")
        assert b["losses"] == ref["losses"][6:8] and c["losses"] == ref["losses"][3:4], name
        assert b.get("skipped", []) == [s for s in skipped if s > 6], name


def test_compact_deltas_recover_within_the_measured_deviation(tmp_path):
    """--adacheck-online-compact (TP=2, fp32): the gradients are stored in bf16, so recovery is
    approximate; the deviation each rank measured while recording (a shadow of its optimizer
    state stepped with the stored gradients) is exactly how far the recovered main weights and
    moments are from the recording run's, and `adacheck inspect` reports it."""
    d = str(tmp_path)
    argv = LAYOUTS["tp2-fp32"]
    on = argv + ["--adacheck", "--adacheck-dir", f"{d}/ck", "--adacheck-online", "--adacheck-online-base-interval",
                 "10", "--adacheck-online-compact"]
    check(launch(2, {"runs": [{"argv": on, "actions": [["online"], ["train", 5], ["dump", "A"], ["online", False]]},
                              {"argv": on, "actions": [["scramble"], ["load", f"{d}/ck"], ["dump", "B"]]}]},
                 d, script="megatron_worker.py"))
    assert results(d)[1]["loaded"] == [5]
    info = json.loads(subprocess.run([sys.executable, "-m", "adacheck.cli", "inspect", f"{d}/ck", "--json"],
                                     capture_output=True, text=True, check=True).stdout)["deltas"]
    assert info["lossy"] and info["committed"] == 4 and info["bf16_share"] == 1.0
    far = {"main": 0.0, "state": 0.0}
    for r in (0, 1):
        a, b = load_file(f"{d}/A-rank{r}.safetensors"), load_file(f"{d}/B-rank{r}.safetensors")
        for k in a:
            kind = k.split(".")[0].rstrip("0123456789")
            if kind in far:
                far[kind] = max(far[kind], (a[k].float() - b[k].float()).abs().max().item())
    measured = info["deviation"]["5"]
    assert far["main"] == measured["weights"] > 0 and far["state"] == measured["state"] > 0, (far, measured)
