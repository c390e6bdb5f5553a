"""Online gradient deltas with real megatron-core (CPU, gloo, 2 processes): recovery
replays the committed deltas to exactly the state of the uninterrupted run."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from launch import check, launch

pytestmark = pytest.mark.timeout(900)

LAYOUTS = {"tp2-fp32": ["--tensor-model-parallel-size", "2", "--global-batch-size", "2"],
           "pp2-bf16": ["--pipeline-model-parallel-size", "2", "--bf16", "--global-batch-size", "4"],
           "dp2-distopt-bf16": ["--use-distributed-optimizer", "--bf16", "--global-batch-size", "4"]}


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def same(a, b, what):
    assert sorted(a) == sorted(b), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def test_recovery_replays_deltas_bit_exactly(tmp_path):
    """Bases every 3 iterations (1, 4), deltas 2-3 and 5-6; a new job's load replays base 4 +
    deltas 5, 6: every rank's weights, main weights, optimizer state and LR equal the
    uninterrupted run's, and the next losses equal those of a run never checkpointed."""
    d = str(tmp_path)
    runs = []
    for name, argv in LAYOUTS.items():
        on = argv + ["--adacheck", "--adacheck-dir", f"{d}/ck-{name}", "--adacheck-online",
                     "--adacheck-online-base-interval", "3"]
        runs += [{"argv": argv, "actions": [["train", 8]]},
                 {"argv": on, "actions": [["online"], ["train", 6], ["dump", f"A-{name}"], ["online", False]]},
                 {"argv": on, "actions": [["online"], ["scramble"], ["load", f"{d}/ck-{name}"],
                                                            ["dump", f"B-{name}"], ["train", 2], ["online", False]]}]
    check(launch(2, {"runs": runs}, d, script="megatron_worker.py"))
    res = results(d)
    for i, name in enumerate(LAYOUTS):
        ref, a, b = res[3 * i: 3 * i + 3]
        assert a["losses"] == ref["losses"][:6], name          # recording changes nothing
        assert b["loaded"] == [6], name
        for r in (0, 1):
            same(load_file(f"{d}/A-{name}-rank{r}.safetensors"), load_file(f"{d}/B-{name}-rank{r}.safetensors"),
                 f"{name} rank {r}")
        assert b["losses"] == ref["losses"][6:8], name
        ck = f"{d}/ck-{name}"
        assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000004", "iter_0000007", "latest"], name
