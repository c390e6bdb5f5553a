"""Benchmark: stored bytes of AdaCheck against DeepSpeed's native checkpoints and against the
unique state, for the layouts beyond ZeRO: a PipelineEngine with a tied first / last layer and
DeepSpeed-MoE experts.  Each layout is one real training (CPU, gloo, the test suite's workers
tests/pipe_worker.py and tests/moe_worker.py) that trains 2 steps and saves the same step
natively and with AdaCheck.  Printed and written as JSON (``--json``):

  native_bytes / adacheck_bytes  bytes of each checkpoint's step directory
  unique_bytes   the distinct logical state, counted from DeepSpeed's own accessors
                 (safe_get_full_fp32_param / safe_get_full_optimizer_state, gathered from every
                 stage and expert-parallel rank by the worker's dump, a tied weight and each
                 expert once): fp32 master weights, every optimizer moment and the buffers; the
                 module weights only where they are the master (fp32 without ZeRO)

    .venv/bin/python scripts/bench_topology.py [--hidden 256] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def unique_bytes(dump_path: str) -> int:
    from safetensors import safe_open
    total = 0
    with safe_open(dump_path, "pt") as f:
        keys = list(f.keys())
        masters = {k.split("/", 1)[1] for k in keys if k.startswith("master/")}
        for k in keys:
            kind, _, name = k.partition("/")
            if kind in ("master", "optim", "buffer") or (kind == "model" and name not in masters):
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    return total


LAYOUTS = [
    # (label, worker, ranks, run)
    ("pipeline 2 stages x DP 2, ZeRO-1 bf16, tied first/last layer", "pipe_worker.py", 4,
     {"pp": 2, "stage": 1, "dtype": "bf16", "tie": True, "layers": 6}),
    ("pipeline 4 stages, ZeRO-0 fp32, tied first/last layer", "pipe_worker.py", 4,
     {"pp": 4, "stage": 0, "dtype": "fp32", "tie": True, "layers": 6}),
    ("MoE 4 experts, ep_size 2 x DP 2, ZeRO-2 bf16", "moe_worker.py", 4,
     {"ep": 2, "experts": 4, "stage": 2, "dtype": "bf16"}),
    ("MoE 4 experts, ep_size 1 (every rank holds all), ZeRO-0 fp32", "moe_worker.py", 2,
     {"ep": 1, "experts": 4, "stage": 0, "dtype": "fp32"}),
]


def main() -> int:
    from launch import check, launch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, worker, ranks, run) in enumerate(LAYOUTS):
            d = os.path.join(tmp, str(i))
            run = dict(run, hidden=a.hidden, adacheck={"enabled": True},
                       actions=[["train", 2], ["save_native", f"{d}/native"], ["save", f"{d}/ada"], ["dump", "S"]])
            check(launch(ranks, {"runs": [run]}, d, script=worker, timeout=900))
            nb, ab = du(f"{d}/native/global_step2"), du(f"{d}/ada/global_step2")
            ub = unique_bytes(f"{d}/S.safetensors")
            rows.append({"layout": label, "ranks": ranks, "native_bytes": nb, "adacheck_bytes": ab,
                         "unique_bytes": ub, "adacheck_over_unique": ab / ub, "native_over_adacheck": nb / ab})
            print(f"{label}: native {nb:,} B, AdaCheck {ab:,} B, unique {ub:,} B -> AdaCheck/unique "
                  f"{ab / ub:.4f}x, native/AdaCheck {nb / ab:.2f}x", flush=True)
    print("\n| layout | ranks | native B | AdaCheck B | unique B | Ada/unique | native/Ada |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['ranks']} | {r['native_bytes']:,} | {r['adacheck_bytes']:,} | "
              f"{r['unique_bytes']:,} | {r['adacheck_over_unique']:.4f}x | {r['native_over_adacheck']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
