"""Ulysses sequence parallelism (DeepSpeed's ``sequence_parallel_size``) with AdaCheck (CPU, gloo,
2 real processes, tests/ds_worker.py): DeepSpeed 0.19.8 replicates the parameters on every rank
of a sequence-parallel group and partitions ZeRO's state over the sequence-data-parallel group
(sequence x data ranks), so AdaCheck stores the replicated weights once (proven by hash) and
each partition once, and loads into another sequence-parallel size.

Oracles: DeepSpeed's native save and load of the same step, DeepSpeed's safe_get_full_*
accessors in the saving run, the uninterrupted run's state and losses."""
import os
import signal

import pytest
from safetensors.torch import load_file

from launch import check, kill_at_marker, launch
from test_ds_integration import assert_same, results

from adacheck.cli import main as cli

pytestmark = pytest.mark.timeout(1200)

SP = {"ds_extra": {"sequence_parallel_size": 2}}


def dump(d, name):
    return load_file(os.path.join(d, f"{name}.safetensors"))


def test_sequence_parallel_resumes_reshapes_and_recovers_online(tmp_path):
    """sequence_parallel_size 2 on 2 ranks: ZeRO-2 bf16 and ZeRO-3 bf16 resume to DeepSpeed's
    native load of the same step and the uninterrupted losses; the ZeRO-2 checkpoint loads into
    sequence_parallel_size 1 at ZeRO-3 (every tensor as gathered in the saving run); online
    deltas replay, at ZeRO-0 fp32 base 4 + deltas 5-6 to the uninterrupted run's step 6, at
    ZeRO-1 bf16 after rank 1 is SIGKILLed to the last committed step; adacheck convert --to
    deepspeed / --from deepspeed of the ZeRO-2 state give DeepSpeed's own loader and AdaCheck's
    the saved state."""
    d = str(tmp_path)
    ac = {"enabled": True}
    runs = []
    for stage in (2, 3):
        runs.append(dict(SP, stage=stage, dtype="bf16", adacheck=ac, actions=[
            ["train", 2], ["save_native", f"{d}/native{stage}"], ["save", f"{d}/a{stage}"], ["dump", f"S{stage}"],
            ["train", 2], ["load", f"{d}/a{stage}"], ["dump", f"L{stage}"], ["train", 2],
            ["load_native", f"{d}/native{stage}"], ["dump", f"N{stage}"]]))
    runs.append(dict(stage=3, dtype="bf16", adacheck=ac, actions=[["load", f"{d}/a2"], ["dump", "R2"]]))
    online = {"enabled": True, "save_dir": f"{d}/on0", "online": {"enabled": True, "base_interval": 3}}
    runs += [dict(SP, stage=0, dtype="fp32", actions=[["train", 8]]),
             dict(SP, stage=0, dtype="fp32", adacheck=online, actions=[["train_dump", 6, "A0_"]]),
             dict(SP, stage=0, dtype="fp32", seed=4, adacheck=online,
                  actions=[["load", f"{d}/on0"], ["steps"], ["dump", "B0"], ["train", 2]]),
             dict(SP, stage=1, dtype="bf16", actions=[["train_dump", 8, "U1_"]])]
    # refused by deepspeed.initialize, from the config alone (before DeepSpeed builds anything)
    runs += [dict(stage=3, dtype="bf16", adacheck=ac, init_error='offload_optimizer.device is "nvme"',
                  zero={"offload_optimizer": {"device": "nvme", "nvme_path": d}}),
             dict(stage=1, dtype="bf16", adacheck=ac, init_error="tensor_parallel.autotp_size is 2",
                  ds_extra={"tensor_parallel": {"autotp_size": 2}})]
    check(launch(2, {"runs": runs}, d, timeout=1000))
    res = results(d)
    for r in res[-2:]:
        assert not r["engine_code_ran"], r["errors"]
    text = "".join(open(os.path.join(d, f"rank{r}.log")).read() for r in range(2))
    assert "declared replicas diverged" not in text
    for i, stage in enumerate((2, 3)):
        assert_same(dump(d, f"S{stage}"), dump(d, f"L{stage}"))
        assert_same(dump(d, f"N{stage}"), dump(d, f"L{stage}"))
        assert res[i]["losses"][2:4] == res[i]["losses"][4:6], stage
        # a load into an engine that has trained: the moments went into the optimizer's own
        # tensors, as DeepSpeed made them at its first step (no new memory handed over)
        kept = [results(d, r)[i]["kept_state"][0] for r in (0, 1)]
        assert all(k == n > 0 for k, n in kept), (stage, kept)
    assert_same(dump(d, "S2"), dump(d, "R2"))
    ref, a, b = res[3:6]
    assert a["losses"] == ref["losses"][:6] and b["steps"][0] == 6
    assert_same(dump(d, "A0_6"), dump(d, "B0"))
    assert b["losses"] == ref["losses"][6:8]

    # ZeRO-1 bf16 online, rank 1 SIGKILLed at a step: a new job's load equals the uninterrupted
    # run at the last committed step and trains on with its losses
    on1 = {"enabled": True, "save_dir": f"{d}/on1", "online": {"enabled": True, "base_interval": 3}}
    # (the job waits at its end, so that the kill lands however fast the steps are)
    killed = launch(2, {"runs": [dict(SP, stage=1, dtype="bf16", adacheck=on1, actions=[
        ["train_dump", 8, "K", "m"], ["wait_file", f"{d}/never"]])]},
        f"{d}/k", on_started=kill_at_marker(f"{d}/k/m5-rank1", victim=1, jitter=0), grace=10, timeout=1000)
    assert killed[1][0] == -signal.SIGKILL, killed[1][1][-3000:]
    # native files both ways: adacheck convert --to deepspeed of the ZeRO-2 checkpoint (stock
    # load_checkpoint of them), --from deepspeed of DeepSpeed's own save of that step (AdaCheck's load)
    assert cli(["convert", f"{d}/a2", f"{d}/conv", "--to", "deepspeed"]) == 0
    assert cli(["convert", f"{d}/native2", f"{d}/fromnat", "--from", "deepspeed", "--optimizer",
                "torch.optim.AdamW"]) == 0
    check(launch(2, {"runs": [
        dict(SP, stage=1, dtype="bf16", seed=4, adacheck=on1, actions=[["load", f"{d}/on1"], ["steps"], ["dump", "B1"],
                                                                       ["train_to", 8]]),
        dict(SP, stage=2, dtype="bf16", seed=4, actions=[["load", f"{d}/conv"], ["dump", "C2"]]),
        dict(SP, stage=2, dtype="bf16", seed=4, adacheck=ac, actions=[["load", f"{d}/fromnat"], ["dump", "F2"]]),
    ]}, f"{d}/r", timeout=1000))
    b1 = results(f"{d}/r")[0]
    t = b1["steps"][0]
    assert t >= 4, t
    assert_same(dump(d, f"U1_{t}"), dump(f"{d}/r", "B1"))
    assert b1["losses"] == res[6]["losses"][t:8]
    assert_same(dump(d, "S2"), dump(f"{d}/r", "C2"))
    assert_same(dump(d, "S2"), dump(f"{d}/r", "F2"))
