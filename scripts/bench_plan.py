"""Benchmark: how the save planner scales with the number of ranks (pure, no processes).

Every rank computes the same plan from every rank's (box, hash) list, so its cost grows with
the total number of shards.  Synthetic layout per rank and parameter: one replicated bf16
weight (ZeRO-0 / DP replicas), one row partition of an fp32 moment (ZeRO) and one column
partition of an fp32 master (TP-style).  Printed (and written as JSON): seconds for the first
plan and for the next checkpoint's (new hashes, same boxes: the tiling proof is cached).

    .venv/bin/python scripts/bench_plan.py --ranks 16 64 256 --params 200
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

from adacheck.plan import planner
from adacheck.types import Box, ShardMeta


def metas(n: int, params: int, salt: int):
    def h(*k):
        return hashlib.blake2b(repr((k, salt)).encode(), digest_size=16).hexdigest()
    per = []
    for r in range(n):
        ms = []
        for i in range(params):
            ms.append(ShardMeta(f"model/l{i}.w", "model", "bfloat16", (1024, 1024), Box((0, 0), (1024, 1024)), h(i)))
            ms.append(ShardMeta(f"optim/exp_avg/l{i}.w", "optim", "float32", (1024 * n, 16),
                                Box((r * 1024, 0), (1024, 16)), h(i, r), replicated=False))
            ms.append(ShardMeta(f"master/l{i}.c", "master", "float32", (16, 64 * n), Box((0, r * 64), (16, 64)),
                                h("c", i, r), replicated=False))
        per.append(ms)
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--json", default="bench_plan.json")
    a = ap.parse_args()
    rows = []
    print("| ranks | shards (all ranks) | first plan s | next checkpoint s | us per shard |\n|---:|---:|---:|---:|---:|")
    for n in a.ranks:
        cache = planner.PlanCache()     # (a job's: kept from its first checkpoint to the next)
        first, nxt = metas(n, a.params, 0), metas(n, a.params, 1)
        t = time.perf_counter()
        planner.plan_save(first, cache=cache)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        planner.plan_save(nxt, cache=cache)
        t2 = time.perf_counter() - t
        shards = sum(len(m) for m in first)
        rows.append({"ranks": n, "shards": shards, "first_seconds": t1, "next_seconds": t2})
        print(f"| {n} | {shards:,} | {t1:.2f} | {t2:.2f} | {1e6 * t2 / shards:.1f} |")
    with open(a.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
