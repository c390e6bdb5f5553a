"""Benchmark: the memory tier against saving to the checkpoint directory, and against DeepSpeed.

One real DeepSpeed training (CPU, gloo, torchrun, DP=2 by default, about 250 MB of unique state)
per ZeRO stage x dtype; in the same run, alternating, ``--repeat`` times (the fastest counts):

  stall          seconds inside ``save_checkpoint`` (the slowest rank): DeepSpeed's own save,
                 AdaCheck to the checkpoint directory (fsync, the default), and AdaCheck with
                 ``"tiers": {"memory": true}`` (a checkpoint into node-local memory; the copy to
                 the checkpoint directory, every ``persist_interval``-th save, runs behind), and
                 the same with ``"async": true`` (the memory copy too is written behind training:
                 the call returns after the snapshot)
  persist        seconds the background copy of one memory checkpoint to the checkpoint
                 directory took (until its manifest and ``latest`` were written)
  step           seconds per training step while that copy runs, against quiet steps
  recovery       seconds of ``load_checkpoint`` from the memory tier and from the checkpoint
                 directory (the same checkpoint; hashes verified in both), the directory's files
                 in the page cache and out of it (cold: dropped with posix_fadvise before each
                 load); with ``--s3`` also from a local S3 API server (moto, on 127.0.0.1)
  memory         bytes the memory tier holds for the job after ``--saves`` saves (``keep`` newest)

With ``--nodes K`` the ranks are spread over K simulated nodes (``$ADACHECK_NODE`` and a memory
directory per node) and the tiered saves also send each node's files to the next node
(``"peer": true``); then also:

  peer bytes     bytes each checkpoint sends to peers (all ranks together; in parts, with
                 their parts, rank files and the meta file)
  recovery peer  seconds of ``load_checkpoint`` from the memory tier when the last node's memory
                 lost that checkpoint (a replacement node): its ranks' files come from the peer

    .venv/bin/python scripts/bench_tiers.py
    .venv/bin/python scripts/bench_tiers.py --stages 1 --dtypes bf16 --memory-dir /dev/shm/x
    .venv/bin/python scripts/bench_tiers.py --nodes 2 --json bench_tiers_peer.json
    .venv/bin/python scripts/bench_tiers.py --s3

Printed as a table and written as JSON (``--json``).  ``--memory-dir`` defaults to /dev/shm.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_ds import (add_device_flag, device, device_sync, du, evict, finish_worker, init_distributed, on_device,  # noqa: E402
                      run_workers, slowest, tiny_engine, train_step, unique_bytes, without_moments)


def worker(a) -> None:
    os.environ.setdefault("DS_ACCELERATOR", device())
    import deepspeed
    import torch

    import adacheck_ds
    from adacheck.config import AdaCheckConfig
    from adacheck.storage import manifest_files
    from adacheck.storage.backends import LOCAL
    from adacheck.tiers import NodeSpread, memory_location, own_files

    init_distributed(deepspeed)
    dist = torch.distributed
    rank = dist.get_rank()
    node = rank * a.nodes // dist.get_world_size()
    if a.nodes > 1:         # (a simulated node: its name and its own memory directory)
        os.environ["ADACHECK_NODE"] = f"node{node}"
        os.environ["ADACHECK_MEMORY_DIR"] = os.path.join(a.memory_dir, f"node{node}")
    peer = a.nodes > 1

    def timed(fn) -> float:
        dist.barrier()
        device_sync()
        t0 = time.perf_counter()
        fn()
        device_sync()
        return slowest(time.perf_counter() - t0)

    rows = []
    for stage in a.stages:
        for dtype in a.dtypes:
            engine, model = tiny_engine(a, stage, dtype)

            def timed_load(fn, engine=engine) -> float:
                without_moments(engine)
                return timed(fn)

            def step():
                train_step(engine, a.vocab, rank)

            for _ in range(2):
                step()
            nparams = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
            unique = unique_bytes(engine, nparams)
            work = os.path.join(a.work, f"dp{dist.get_world_size()}-z{stage}-{dtype}")
            block = {"enabled": True, "reference_previous": False, "exchange": a.exchange}
            durable = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(block))
            tiered = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(dict(
                block, tiers={"memory": True, "peer": peer, "persist_interval": 10 ** 6, "keep": 2})))
            tiered_async = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(dict(
                block, tiers={"memory": True, "peer": peer, "persist_interval": 10 ** 6, "keep": 2},
                **{"async": True})))
            ck_tier = f"{work}/tiered"
            t = {"native": [], "durable": [], "memory": [], "memory_async": []}
            for i in range(a.repeat):
                order = [("native", lambda: adacheck_ds.save_native(engine, f"{work}/native", tag=f"t{i}")),
                         ("durable", lambda: durable.save_checkpoint(f"{work}/durable", tag=f"t{i}")),
                         ("memory", lambda: tiered.save_checkpoint(ck_tier, tag=f"t{i}")),
                         ("memory_async", lambda: tiered_async.save_checkpoint(f"{work}/tiered-async", tag=f"t{i}"))]
                for name, fn in (order if i % 2 == 0 else order[::-1]):
                    t[name].append(timed(fn))
                    if name == "memory_async":
                        tiered_async.finish()       # (its memory copy committed before the next is timed)
            quiet = [timed(step) for _ in range(a.steps)]
            # one background copy of the newest memory checkpoint to the checkpoint directory
            tier = tiered.checkpointer.tier
            key = next(iter(tier.newest))
            dist.barrier()
            t0 = time.perf_counter()
            tier.start_persist(key)
            busy = []

            def copying() -> bool:      # (on any rank: every rank steps as long as one still copies)
                alive = on_device(torch.tensor([float(tier.thread is not None and tier.thread.is_alive())]))
                dist.all_reduce(alive, op=dist.ReduceOp.MAX)
                return bool(alive.item())

            while copying() and len(busy) < 200:
                busy.append(timed(step))
            tier.finish()
            persist = slowest(time.perf_counter() - t0)
            tag = f"t{a.repeat - 1}"
            load = {"memory": [], "durable": [], "cold": [], "s3": []}
            if a.s3_url:         # (the same state, saved to S3 by a job without tiers)
                remote = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(
                    dict(block, storage_options=json.loads(a.storage_options))))
                url = f"{a.s3_url}/dp{dist.get_world_size()}-z{stage}-{dtype}"
                remote.save_checkpoint(url, tag=tag)
            phases = {"memory": [], "durable": []}      # (rank 0's seconds per phase of each load)
            for i in range(a.repeat):
                load["memory"].append(timed_load(lambda: tiered.load_checkpoint(ck_tier, tag=tag)))
                phases["memory"].append(tiered.checkpointer.last_loaded.seconds)
                # (the same checkpoint, read from the checkpoint directory by a job without tiers)
                load["durable"].append(timed_load(lambda: durable.load_checkpoint(ck_tier, tag=tag)))
                phases["durable"].append(durable.checkpointer.last_loaded.seconds)
                dist.barrier()
                if rank == 0:
                    evict(ck_tier)
                load["cold"].append(timed_load(lambda: durable.load_checkpoint(ck_tier, tag=tag)))
                if a.s3_url:
                    load["s3"].append(timed_load(lambda: remote.load_checkpoint(url, tag=tag)))
            peer_bytes, load_peer = 0, []
            if peer:
                mem = memory_location(LOCAL, ck_tier)
                m = manifest_files.read_manifest(os.path.join(mem, tag))
                peer_bytes = sum(m.files[f]["nbytes"] for f, _, _ in NodeSpread(tier.nodes, True).peer_moves(m.files))
                if m.index is not None:     # (in parts: each rank's part and rank file go too, and rank 0's meta file)
                    senders = [w for w in range(len(tier.nodes)) if NodeSpread(tier.nodes, True).partner(w) is not None]
                    peer_bytes += sum(os.path.getsize(os.path.join(mem, tag, f)) for w in senders
                                      for f in own_files(m.index["generation"], w)[1:])
                last = min(r for r, n in enumerate(tier.nodes) if n == tier.nodes[-1])
                for i in range(a.repeat):
                    dist.barrier()
                    if rank == last:        # (the last node lost this checkpoint: a replacement node)
                        shutil.rmtree(os.path.join(mem, tag))
                    load_peer.append(timed_load(lambda: tiered.load_checkpoint(ck_tier, tag=tag)))
            for i in range(a.saves):
                tiered.save_checkpoint(ck_tier, tag=f"m{i}")
            mem_bytes = du(memory_location(LOCAL, ck_tier)) if rank == 0 else 0
            if rank == 0:
                row = {"dp": dist.get_world_size(), "stage": stage, "dtype": dtype, "params": nparams,
                       "unique_bytes": unique, "stall_native_s": min(t["native"]), "stall_durable_s": min(t["durable"]),
                       "stall_memory_s": min(t["memory"]), "stall_memory_async_s": min(t["memory_async"]),
                       "persist_s": persist,
                       "step_quiet_s": sorted(quiet)[len(quiet) // 2],
                       "step_persisting_s": sorted(busy)[len(busy) // 2] if busy else None, "persisting_steps": len(busy),
                       "load_memory_s": min(load["memory"]), "load_durable_s": min(load["durable"]),
                       "load_cold_s": min(load["cold"]), "load_s3_s": min(load["s3"]) if load["s3"] else None,
                       "memory_over_cold": min(load["memory"]) / min(load["cold"]),
                       "load_phases": {k: {p: round(min(x[p] for x in v), 4) for p in v[0]} for k, v in phases.items()},
                       "memory_bytes": mem_bytes, "saves": a.saves, "nodes": a.nodes, "peer_bytes": peer_bytes,
                       "exchange": a.exchange,
                       "load_peer_s": min(load_peer) if load_peer else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
            tier.newest.clear()        # (nothing to persist at exit: the benchmark's copies are removed)
            tiered_async.checkpointer.tier.newest.clear()
            tiered_async.checkpointer.close()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(work, ignore_errors=True)
            if rank == 0 or (peer and tier.leads):
                shutil.rmtree(os.path.dirname(memory_location(LOCAL, ck_tier)), ignore_errors=True)
            engine.destroy()
    finish_worker(rows, a.rows)


def table(rows) -> str:
    head = ("| DP | ZeRO | dtype | unique MB | stall native s | stall durable s | stall memory s | stall memory async s "
            "| memory async/native | persist s | step s quiet | step s persisting (steps) | load memory s | load durable s "
            "| load cold s | memory/cold | load S3 s | memory MB | nodes | peer MB | load peer s |")
    out = [head, "|" + "---:|" * 21]
    for r in rows:
        busy = f"{r['step_persisting_s']:.3f} ({r['persisting_steps']})" if r["step_persisting_s"] else "-"
        out.append(f"| {r['dp']} | {r['stage']} | {r['dtype']} | {r['unique_bytes'] / 1e6:.0f} | "
                   f"{r['stall_native_s']:.3f} | {r['stall_durable_s']:.3f} | {r['stall_memory_s']:.3f} | "
                   f"{r['stall_memory_async_s']:.3f} | {r['stall_memory_async_s'] / r['stall_native_s']:.2f} | "
                   f"{r['persist_s']:.3f} | {r['step_quiet_s']:.3f} | "
                   f"{busy} | {r['load_memory_s']:.3f} | {r['load_durable_s']:.3f} | {r['load_cold_s']:.3f} | "
                   f"{r['memory_over_cold']:.2f} | " + (f"{r['load_s3_s']:.3f}" if r["load_s3_s"] is not None else "-")
                   + f" | {r['memory_bytes'] / 1e6:.0f} | "
                   f"{r['nodes']} | {r['peer_bytes'] / 1e6:.0f} | "
                   + (f"{r['load_peer_s']:.3f} |" if r["load_peer_s"] is not None else "- |"))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[2])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="quiet steps timed")
    ap.add_argument("--saves", type=int, default=5, help="memory-tier saves before its size is read")
    ap.add_argument("--nodes", type=int, default=1, help="simulated nodes (> 1: the peer tier is on)")
    ap.add_argument("--memory-dir", default="/dev/shm/adacheck-bench", help="the memory tier's directory")
    ap.add_argument("--exchange", default="auto", choices=["auto", "ring", "allgather", "partitioned"],
                    help="AdaCheck's exchange (the directory's and the memory tier's saves)")
    ap.add_argument("--work", default=None, help="where the checkpoint directories go (default: a temp dir)")
    ap.add_argument("--json", default="bench_tiers.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--s3", action="store_true", help="also load from a local S3 API server (moto)")
    ap.add_argument("--s3-url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--storage-options", default=None, help=argparse.SUPPRESS)
    add_device_flag(ap)
    a = ap.parse_args()
    os.environ["ADACHECK_BENCH_DEVICE"] = a.device
    if a.worker:
        return worker(a)
    os.environ["ADACHECK_MEMORY_DIR"] = a.memory_dir
    os.environ.setdefault("ADACHECK_JOB", f"bench-tiers-{os.getpid()}")
    passed = ["--vocab", str(a.vocab), "--dim", str(a.dim), "--layers", str(a.layers), "--repeat", str(a.repeat),
              "--steps", str(a.steps), "--saves", str(a.saves), "--nodes", str(a.nodes), "--exchange", a.exchange,
              "--memory-dir", a.memory_dir, "--stages", *map(str, a.stages), "--dtypes", *a.dtypes]
    rows = run_workers(os.path.abspath(__file__), a.dp, a.work, 29800, passed, s3=a.s3)
    import deepspeed
    import torch
    with open(a.json, "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                   "cpu_count": os.cpu_count(), "model": {"vocab": a.vocab, "dim": a.dim, "layers": a.layers},
                   "repeat": a.repeat, "memory_dir": a.memory_dir, "device": a.device, "nodes": a.nodes,
                   "exchange": a.exchange}, f,
                  indent=1)
    print(table(rows))
    print(f"\nJSON in {a.json}")


if __name__ == "__main__":
    main()
