"""Benchmark: AdaCheck vs megatron-core's own torch_dist checkpoints, same model, same run.

For each parallel layout, one real megatron-core training (CPU, gloo, torchrun; the model,
schedules, DDP and optimizer of scripts/pretrain_gpt.py) trains two iterations, then saves
and loads with megatron-core's ``dist_checkpointing`` (torch_dist format, fully parallel
save, as Megatron-LM does) and with AdaCheck, in alternating order, ``--repeat`` times; the
fastest repeat counts. Printed (and written as JSON to ``--json``):

  native_bytes / adacheck_bytes  bytes on disk of each checkpoint directory
  unique_bytes    the distinct logical state, counted from megatron-core's own sharded state
                  dict (independent of AdaCheck): every distinct parameter (by key, global
                  shape) x (4 bytes fp32 master + 4 bytes per Adam moment). bf16 model weights
                  are the master cast down (derivable); fp32 ones are the master.
  save / load     native seconds / AdaCheck seconds (above 1: AdaCheck is faster). AdaCheck
                  fsyncs every file by default (torch_dist does not); the ratio without fsync
                  is printed too. AdaCheck loads verify every box's xxh3-128 hash.

    .venv/bin/python scripts/bench_megatron.py
    .venv/bin/python scripts/bench_megatron.py --layouts tp2 pp2 --repeat 1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_ds import comparison, du, finish_worker, run_workers  # noqa: E402

# name -> (world size, pretrain_gpt.py flags)
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-fp32": (2, ["--tensor-model-parallel-size", "2", "--fp32"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
    "dp2-distopt": (2, ["--use-distributed-optimizer"]),
    "ep2-moe": (2, ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
                    "--moe-token-dispatcher-type", "alltoall"]),
    "tp2dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "pp2dp2-distopt": (4, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "dp4-distopt": (4, ["--use-distributed-optimizer"]),
}


def unique_bytes(model) -> int:
    """Distinct parameters (by sharded key) x (fp32 master + 2 Adam moments), from megatron-core."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from adacheck_megatron.parallel import sharded_state_dict
    shapes = {}
    for v in nested_values(sharded_state_dict(model, None, is_loading=False, with_optimizer=False)):
        if isinstance(v, ShardedTensor) and v.key.endswith(("weight", "bias")):
            shapes[v.key] = tuple(v.global_shape)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, shapes)
    merged = {}
    for s in everyone:
        merged.update(s)
    return sum(math.prod(s) for s in merged.values()) * 4 * 3


def worker(a) -> None:
    import torch
    import pretrain_gpt
    from megatron.core import parallel_state
    from adacheck.config import AdaCheckConfig
    from adacheck import jobs
    import adacheck_megatron

    from adacheck_megatron.cpu import enable_cpu
    enable_cpu()
    torch.distributed.init_process_group("gloo")
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    rows = []
    for name in a.layouts:
        n, flags = LAYOUTS[name]
        if n != world:
            continue
        argv = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "8",
                "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
                "--global-batch-size", str(2 * world), "--vocab-size", str(a.vocab), "--lr", "1e-3",
                "--train-iters", "10"] + [f for f in flags if f != "--fp32"]
        if "--fp32" not in flags:
            argv.append("--bf16")
        args = pretrain_gpt.parse_args(argv=argv)
        pretrain_gpt.initialize_parallel(args)
        model, config = pretrain_gpt.build_model(args)
        optimizer, scheduler = pretrain_gpt.build_optimizer(args, model, config)
        for it in (1, 2):
            pretrain_gpt.train_step(args, it, model, optimizer, scheduler)
        unique = unique_bytes(model)
        nparams = unique // 12
        work = os.path.join(a.work, name)
        cfg = AdaCheckConfig.from_dict({"enabled": True, "reference_previous": False})
        fast = AdaCheckConfig.from_dict({"enabled": True, "reference_previous": False, "fsync": False})
        t = {"native_save": [], "ada_save": [], "ada_save_nofsync": [], "native_load": [], "ada_load": []}

        def native_save(i):
            args.adacheck, args.save = False, os.path.join(work, f"native{i}")
            pretrain_gpt.save_checkpoint(2, model, optimizer, scheduler, args)

        def native_load(i):
            args.adacheck, args.load = False, os.path.join(work, f"native{i}")
            pretrain_gpt.load_checkpoint(model, optimizer, scheduler, args)

        def ada_save(i, c, suffix=""):
            adacheck_megatron.save_checkpoint(2, model, optimizer, scheduler, args=args,
                                              config=dataclasses.replace(c, save_dir=os.path.join(work, f"ada{i}{suffix}")))

        phases = []       # (rank 0's seconds per phase of each AdaCheck load)

        def ada_load(i):
            adacheck_megatron.load_checkpoint(model, optimizer, scheduler, args=args,
                                              config=dataclasses.replace(cfg, save_dir=os.path.join(work, f"ada{i}")))
            phases.append(jobs.kept(optimizer).last_loaded.seconds)

        for i in range(a.repeat):
            saves = [("native_save", lambda: native_save(i)), ("ada_save", lambda: ada_save(i, cfg)),
                     ("ada_save_nofsync", lambda: ada_save(i, fast, "-nofsync"))]
            for k, fn in (saves if i % 2 == 0 else saves[::-1]):
                t[k].append(timed(fn))
            loads = [("native_load", lambda: native_load(i)), ("ada_load", lambda: ada_load(i))]
            for k, fn in (loads if i % 2 == 0 else loads[::-1]):
                t[k].append(timed(fn))
        if rank == 0:
            last = a.repeat - 1
            nb = du(os.path.join(work, f"native{last}"))
            ab = du(os.path.join(work, f"ada{last}"))
            rows.append({"layout": name, "world": world, "flags": flags, "params": nparams,
                         **comparison(nb, ab, unique, t),
                         "ada_load_phases": {k: round(min(p[k] for p in phases), 4) for k in phases[0]}})
            print(json.dumps(rows[-1]), flush=True)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
        parallel_state.destroy_model_parallel()
    finish_worker(rows, a.rows)


def table(rows) -> str:
    head = ("| layout | ranks | params | torch_dist B | AdaCheck B | unique B | Ada/unique | torch_dist/Ada "
            "| save ratio | save ratio (no fsync) | load ratio |")
    out = [head, "|---|" + "---:|" * 10]
    for r in rows:
        out.append(f"| {r['layout']} | {r['world']} | {r['params']:,} | {r['native_bytes']:,} | "
                   f"{r['adacheck_bytes']:,} | {r['unique_bytes']:,} | {r['adacheck_over_unique']:.4f}x | "
                   f"{r['native_over_adacheck']:.2f}x | {r['save_ratio']:.2f} | "
                   f"{r['save_ratio_nofsync']:.2f} | {r['load_ratio']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json", default="bench_megatron.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    worlds = sorted({LAYOUTS[n][0] for n in a.layouts})
    rows = run_workers(os.path.abspath(__file__), worlds, a.work, 29700,
                       ["--vocab", str(a.vocab), "--hidden", str(a.hidden), "--layers", str(a.layers),
                        "--repeat", str(a.repeat), "--layouts", *a.layouts])
    import megatron.core
    import torch
    result = {"rows": rows, "torch": torch.__version__, "megatron_core": megatron.core.__version__,
              "cpu_count": os.cpu_count(), "model": {"vocab": a.vocab, "hidden": a.hidden, "layers": a.layers},
              "repeat": a.repeat}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    print(table(rows))
    worst = max(r["adacheck_over_unique"] for r in rows)
    print(f"\nworst AdaCheck / unique logical state: {worst:.4f}x; JSON in {a.json}")


if __name__ == "__main__":
    main()
