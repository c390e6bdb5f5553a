"""Ulysses sequence parallelism (DeepSpeed's ``sequence_parallel_size``) with AdaCheck (CPU, gloo,
2 real processes, tests/ds_worker.py): DeepSpeed 0.19.8 replicates the parameters on every rank
of a sequence-parallel group and partitions ZeRO's state over the sequence-data-parallel group
(sequence x data ranks), so AdaCheck stores the replicated weights once (proven by hash) and
each partition once, and loads into another sequence-parallel size.

Oracles: DeepSpeed's native save and load of the same step, DeepSpeed's safe_get_full_*
accessors in the saving run, the uninterrupted run's state and losses."""
import os

import pytest
from safetensors.torch import load_file

from launch import check, launch
from test_ds_integration import assert_same, results

pytestmark = pytest.mark.timeout(1200)

SP = {"ds_extra": {"sequence_parallel_size": 2}}


def dump(d, name):
    return load_file(os.path.join(d, f"{name}.safetensors"))


def test_sequence_parallel_resumes_reshapes_and_recovers_online(tmp_path):
    """sequence_parallel_size 2 on 2 ranks: ZeRO-2 bf16 and ZeRO-3 bf16 resume to DeepSpeed's
    native load of the same step and the uninterrupted losses; the ZeRO-2 checkpoint loads into
    sequence_parallel_size 1 (every tensor as gathered in the saving run); online deltas (ZeRO-0
    fp32, ZeRO-1 bf16) replay base 4 + deltas 5-6 to the uninterrupted run's step 6."""
    d = str(tmp_path)
    ac = {"enabled": True}
    runs = []
    for stage in (2, 3):
        runs.append(dict(SP, stage=stage, dtype="bf16", adacheck=ac, actions=[
            ["train", 2], ["save_native", f"{d}/native{stage}"], ["save", f"{d}/a{stage}"], ["dump", f"S{stage}"],
            ["train", 2], ["load", f"{d}/a{stage}"], ["dump", f"L{stage}"], ["train", 2],
            ["load_native", f"{d}/native{stage}"], ["dump", f"N{stage}"]]))
    runs.append(dict(stage=2, dtype="bf16", adacheck=ac, actions=[["load", f"{d}/a2"], ["dump", "R2"]]))
    for stage, dtype in ((0, "fp32"), (1, "bf16")):
        online = {"enabled": True, "save_dir": f"{d}/on{stage}", "online": {"enabled": True, "base_interval": 3}}
        runs += [dict(SP, stage=stage, dtype=dtype, actions=[["train", 8]]),
                 dict(SP, stage=stage, dtype=dtype, adacheck=online, actions=[["train_dump", 6, f"A{stage}_"]]),
                 dict(SP, stage=stage, dtype=dtype, seed=4, adacheck=online,
                      actions=[["load", f"{d}/on{stage}"], ["steps"], ["dump", f"B{stage}"], ["train", 2]])]
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
    assert_same(dump(d, "S2"), dump(d, "R2"))
    for j, stage in enumerate((0, 1)):
        ref, a, b = res[3 + 3 * j: 6 + 3 * j]
        assert a["losses"] == ref["losses"][:6] and b["steps"][0] == 6, stage
        assert_same(dump(d, f"A{stage}_6"), dump(d, f"B{stage}"))
        assert b["losses"] == ref["losses"][6:8], stage
