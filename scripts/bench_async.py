"""Benchmark: how long a save stalls training, native DeepSpeed vs AdaCheck sync vs AdaCheck async.

One real DeepSpeed training (CPU, gloo, torchrun, DP=2 by default, about 250 MB of unique state)
per ZeRO stage x dtype; in the same run, alternating, ``--repeat`` times (the fastest counts):

  stall          seconds inside ``save_checkpoint`` (the slowest rank): DeepSpeed's own save,
                 AdaCheck synchronous (fsync, the default), AdaCheck ``"async": true`` with each
                 ``--writers`` (``"async_writer"``: a thread, or a writer process per rank)
  commit         async: seconds from the save call until the checkpoint is committed
                 ('latest' names it) in the background
  step           seconds per training step while an async save persists in the background
                 (the median over the steps during ``--busy-saves`` saves, their count in
                 parentheses), against steps with none in flight (the background shares the CPU)
  memory         the resident set (VmRSS, plus the writer process's own anonymous memory) after
                 each of ``--saves`` async saves: the staging copy is made once and reused, so it
                 must not grow after the first
  s3             with ``--s3``: the same stall / commit, and a load, against a real S3 API
                 server (moto, on 127.0.0.1) through s3fs

    .venv/bin/python scripts/bench_async.py                      # after scripts/test.sh made .venv
    .venv/bin/python scripts/bench_async.py --stages 1 --dtypes bf16 --saves 20 --s3

Printed as a table and written as JSON (``--json``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_ds import (add_device_flag, device, device_sync, init_distributed, on_device, run_workers, slowest,  # noqa: E402
                      tiny_engine, train_step, unique_bytes)


def status_bytes(pid="self", field="VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def host_bytes(checkpointer) -> int:
    """This rank's resident memory, plus its writer process's own (anonymous) memory: the shared
    staging pages that both map are counted once, in the rank's."""
    writer = checkpointer.writer
    return status_bytes() + (status_bytes(writer.proc.pid, "RssAnon") if writer is not None and writer.alive else 0)


def compression_of(ckpt_dir: str) -> dict:
    """zstd byte planes (``"compression": "zstd"``) on this checkpoint's tensors, per kind: the
    ratio (raw / compressed) and one thread's encode and decode throughput."""
    import torch
    from adacheck.checkpoint import CheckpointReader
    from adacheck.format.compression import ZSTD_PLANES, Encoder, decode
    r = CheckpointReader(ckpt_dir)
    names = sorted(r.manifest.tensors)
    kinds = {"fp32 master weights": [n for n in names if n.startswith("master/")],
             "Adam exp_avg": [n for n in names if n.startswith("optim/exp_avg/")],
             "Adam exp_avg_sq": [n for n in names if n.startswith("optim/exp_avg_sq/")],
             "bf16 module weights": [n for n in names if n.startswith("model/") and r.entry(n).dtype == "bfloat16"]}
    out = {}
    encoder = Encoder(ZSTD_PLANES)
    for kind, keys in kinds.items():
        tensors = [r.read(n) for n in keys if r.entry(n).numel > 1]
        if not tensors:
            continue
        raw = sum(t.numel() * t.element_size() for t in tensors)
        t0 = time.perf_counter()
        packed = [encoder.encode(t) for t in tensors]
        t1 = time.perf_counter()
        back = [decode(ZSTD_PLANES, p, t.dtype, tuple(t.shape), kind) for p, t in zip(packed, tensors)]
        t2 = time.perf_counter()
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(back, tensors))
        out[kind] = {"bytes": raw, "ratio": raw / sum(p.numel() for p in packed),
                     "encode_MBps": raw / 1e6 / (t1 - t0), "decode_MBps": raw / 1e6 / (t2 - t1)}
    return out


# ----------------------------------------------------------------------------- worker
def worker(a) -> None:
    os.environ.setdefault("DS_ACCELERATOR", device())
    import deepspeed
    import torch

    import adacheck_ds
    from adacheck.config import AdaCheckConfig

    init_distributed(deepspeed)
    dist = torch.distributed
    rank = dist.get_rank()

    def stall(fn, then=None) -> float:
        """Seconds inside ``fn`` on the slowest rank (compared once ``then``, e.g. waiting for the
        background, is done: the comparison is a collective that would wait for the background)."""
        dist.barrier()
        device_sync()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        if then is not None:
            then()
        return slowest(seconds)

    storage = json.loads(a.storage_options) if a.storage_options else {}
    rows = []
    for stage in a.stages:
        for dtype in a.dtypes:
            engine, model = tiny_engine(a, stage, dtype)

            def step():
                train_step(engine, a.vocab, rank)

            def persisting(job) -> bool:
                """Whether any rank's async save is still persisting (agreed: the ranks' saves finish
                at different moments, and a step is a collective)."""
                p = job.checkpointer.pending
                flag = on_device(torch.tensor([0.0 if p is None or p.done() else 1.0]))
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                return bool(flag.item())

            def timed_step() -> float:
                device_sync()
                t0 = time.perf_counter()
                step()
                device_sync()
                return slowest(time.perf_counter() - t0)

            for _ in range(2):
                step()
            nparams = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())   # (ZeRO-3: partitioned)
            unique = unique_bytes(engine, nparams)
            work = os.path.join(a.work, f"dp{dist.get_world_size()}-z{stage}-{dtype}")
            block = {"enabled": True, "reference_previous": False}
            sync = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(block))
            asy = {w: adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(
                dict(block, async_writer=w, **{"async": True}))) for w in a.writers}
            t = {"native": [], "sync": [], **{w: [] for w in a.writers}}
            commit = {w: [] for w in a.writers}
            for i in range(a.repeat):
                order = [("native", lambda: adacheck_ds.save_native(engine, f"{work}/native", tag=f"t{i}")),
                         ("sync", lambda: sync.save_checkpoint(f"{work}/sync", tag=f"t{i}"))]
                order += [(w, lambda w=w: asy[w].save_checkpoint(f"{work}/async-{w}", tag=f"t{i}")) for w in a.writers]
                for name, fn in (order if i % 2 == 0 else order[::-1]):
                    done = {}
                    then = (lambda: done.update(m=asy[name].finish())) if name in asy else None
                    t[name].append(stall(fn, then=then))
                    if name in asy:
                        commit[name].append(slowest(done["m"].stats["seconds"]["background"]))
            # steps with and without a persist in flight
            quiet = [timed_step() for _ in range(a.steps)]
            row = {"dp": dist.get_world_size(), "stage": stage, "dtype": dtype, "params": nparams,
                   "unique_bytes": unique, "stall_native_s": min(t["native"]), "stall_sync_s": min(t["sync"]),
                   "step_quiet_s": sorted(quiet)[len(quiet) // 2], "writers": {}}
            for w, job in asy.items():
                busy = []
                for j in range(a.busy_saves):
                    job.save_checkpoint(f"{work}/async-{w}", tag=f"busy{j}")
                    during = 0
                    while persisting(job) and during < 200:
                        busy.append(timed_step())
                        during += 1
                    job.finish()
                # host memory over many async saves: the staging copy is allocated once
                memory = []
                for i in range(a.saves):
                    job.save_checkpoint(f"{work}/mem-{w}", tag=f"m{i}")
                    step()
                    job.finish()
                    memory.append(host_bytes(job.checkpointer))
                row["writers"][w] = {
                    "stall_async_s": min(t[w]), "commit_async_s": min(commit[w]),
                    "async_over_native": min(t[w]) / min(t["native"]),
                    "step_busy_s": sorted(busy)[len(busy) // 2] if busy else None, "busy_steps": len(busy),
                    "staging_bytes": job.checkpointer.background.staging.nbytes,
                    "rss_first_bytes": memory[0] if memory else None, "rss_last_bytes": memory[-1] if memory else None,
                    "rss_max_bytes": max(memory) if memory else None, "rss_bytes": memory}
                job.checkpointer.close()     # (its writer process, if any, stops)
            if a.s3_url:
                remote = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(
                    dict(block, storage_options=storage, async_writer=a.writers[0], **{"async": True})))
                remote_sync = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(
                    dict(block, storage_options=storage)))
                url = f"{a.s3_url}/dp{dist.get_world_size()}-z{stage}-{dtype}"
                s3 = {"sync": [], "async": [], "commit": [], "load": []}
                for i in range(a.repeat):
                    s3["sync"].append(stall(lambda: remote_sync.save_checkpoint(url + "-sync", tag=f"t{i}")))
                    done = {}
                    s3["async"].append(stall(lambda: remote.save_checkpoint(url, tag=f"t{i}"),
                                             then=lambda: done.update(m=remote.finish())))
                    s3["commit"].append(slowest(done["m"].stats["seconds"]["background"]))
                    s3["load"].append(stall(lambda: remote.load_checkpoint(url, tag=f"t{i}")))
                row.update({f"s3_{k}_s": min(v) for k, v in s3.items()})
            if rank == 0:
                row["compression"] = compression_of(f"{work}/sync/t{a.repeat - 1}")
                rows.append(row)
                print(json.dumps(row), flush=True)
            dist.barrier()
            if rank == 0:
                import shutil
                shutil.rmtree(work, ignore_errors=True)
            engine.destroy()
    from bench_ds import finish_worker
    finish_worker(rows, a.rows)


# ----------------------------------------------------------------------------- driver
def table(rows) -> str:
    head = ("| DP | ZeRO | dtype | unique MB | stall native s | stall sync s | writer | stall async s | async/native "
            "| commit s | step s (quiet) | step s (persisting) | staging MB | host memory growth MB |")
    out = [head, "|" + "---:|" * 6 + ":---|" + "---:|" * 7]
    for r in rows:
        for w, x in r["writers"].items():
            growth = (x["rss_last_bytes"] - x["rss_first_bytes"]) / 1e6 if x["rss_first_bytes"] else float("nan")
            busy = f"{x['step_busy_s']:.3f} ({x['busy_steps']})" if x["step_busy_s"] is not None else "-"
            out.append(f"| {r['dp']} | {r['stage']} | {r['dtype']} | {r['unique_bytes'] / 1e6:.0f} | "
                       f"{r['stall_native_s']:.3f} | {r['stall_sync_s']:.3f} | {w} | {x['stall_async_s']:.3f} | "
                       f"{x['async_over_native']:.3f} | {x['commit_async_s']:.3f} | {r['step_quiet_s']:.3f} | {busy} | "
                       f"{x['staging_bytes'] / 1e6:.0f} | {growth:+.1f} |")
    out += ["", "| DP | ZeRO | dtype | tensors | MB | zstd ratio | encode MB/s | decode MB/s |", "|" + "---:|" * 8]
    for r in rows:
        for kind, c in r.get("compression", {}).items():
            out.append(f"| {r['dp']} | {r['stage']} | {r['dtype']} | {kind} | {c['bytes'] / 1e6:.0f} | "
                       f"{c['ratio']:.3f} | {c['encode_MBps']:.0f} | {c['decode_MBps']:.0f} |")
    if any("s3_sync_s" in r for r in rows):
        out += ["", "| DP | ZeRO | dtype | S3 stall sync s | S3 stall async s | S3 commit s | S3 load s |",
                "|" + "---:|" * 7]
        for r in rows:
            out.append(f"| {r['dp']} | {r['stage']} | {r['dtype']} | {r['s3_sync_s']:.3f} | {r['s3_async_s']:.3f} | "
                       f"{r['s3_commit_s']:.3f} | {r['s3_load_s']:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[2])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="quiet steps timed")
    ap.add_argument("--saves", type=int, default=20, help="async saves whose memory is followed")
    ap.add_argument("--busy-saves", type=int, default=5, help="async saves during which steps are timed")
    ap.add_argument("--writers", nargs="+", default=["thread", "process"], choices=["thread", "process"],
                    help="where async saves persist (the first also serves --s3)")
    ap.add_argument("--s3", action="store_true", help="also save to / load from a local S3 API server (moto)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default="bench_async.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--s3-url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--storage-options", default=None, help=argparse.SUPPRESS)
    add_device_flag(ap)
    a = ap.parse_args()
    os.environ["ADACHECK_BENCH_DEVICE"] = a.device
    if a.worker:
        return worker(a)
    passed = ["--vocab", str(a.vocab), "--dim", str(a.dim), "--layers", str(a.layers), "--repeat", str(a.repeat),
              "--steps", str(a.steps), "--saves", str(a.saves), "--busy-saves", str(a.busy_saves), "--stages", *map(str, a.stages),
              "--dtypes", *a.dtypes, "--writers", *a.writers]
    rows = run_workers(os.path.abspath(__file__), a.dp, a.work, 29700, passed, s3=a.s3)
    import deepspeed
    import torch
    with open(a.json, "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                   "cpu_count": os.cpu_count(), "model": {"vocab": a.vocab, "dim": a.dim, "layers": a.layers},
                   "repeat": a.repeat, "device": a.device,
                   "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None}, f, indent=1)
    print(table(rows))
    print(f"\nJSON in {a.json}")


if __name__ == "__main__":
    main()
