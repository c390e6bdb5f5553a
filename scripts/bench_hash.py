"""Benchmark: AdaCheck's box hash (xxh3-128, adacheck.format.hashing) against a plain memory copy.

For each size, the fastest of ``--repeat`` runs of: hash_tensor(t); t2.copy_(t) into an
existing buffer (memcpy); t.clone() (allocation + copy, what a naive snapshot costs).
Prints GB/s and hash time / copy time, and writes JSON.

    .venv/bin/python scripts/bench_hash.py [--sizes-mib 1 16 256] [--json bench_hash.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from adacheck.format.hashing import hash_tensor  # noqa: E402


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="bench_hash.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mib in a.sizes_mib:
        n = (mib << 20) // 4
        t = torch.randn(n)
        dst = torch.empty_like(t)
        dst.copy_(t)   # touch the pages once
        nbytes = n * 4
        h = best(lambda: hash_tensor(t), a.repeat)
        c = best(lambda: dst.copy_(t), a.repeat)
        k = best(lambda: t.clone(), a.repeat)
        rows.append({"mib": mib, "hash_gbps": nbytes / h / 1e9, "memcpy_gbps": nbytes / c / 1e9,
                     "clone_gbps": nbytes / k / 1e9, "hash_over_memcpy_time": h / c,
                     "hash_over_clone_time": h / k})
    print("| MiB | xxh3-128 GB/s | memcpy GB/s | clone GB/s | hash time / memcpy time | hash time / clone time |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mib']} | {r['hash_gbps']:.2f} | {r['memcpy_gbps']:.2f} | {r['clone_gbps']:.2f} | "
              f"{r['hash_over_memcpy_time']:.2f} | {r['hash_over_clone_time']:.2f} |")
    with open(a.json, "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__, "cpu_count": os.cpu_count()}, f, indent=1)
    print(f"JSON in {a.json}")


if __name__ == "__main__":
    main()
