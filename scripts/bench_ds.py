"""Benchmark: AdaCheck vs DeepSpeed's native checkpoints, same engine, same run.

For every ZeRO stage x dtype at each data-parallel size, one real DeepSpeed training (CPU and
gloo, or ``--device cuda``: one GPU per rank and NCCL; torchrun) trains a few steps, then saves
and loads natively and with AdaCheck, in alternating order, ``--repeat`` times; the fastest of
the repeats counts for each.  Printed (and written as JSON to ``--json``):

  native_bytes / adacheck_bytes  bytes on disk of each checkpoint directory
  unique_bytes    the distinct logical state, counted from the engine and independent of
                  AdaCheck: fp32 master weights + every optimizer moment (4 bytes per element
                  each) + buffers.  Module weights are not counted: bf16 ones are the master
                  cast (derivable), fp32 ones without ZeRO *are* the master.
  save / load     native seconds / AdaCheck seconds (above 1: AdaCheck is faster).
                  AdaCheck saves fsync every file (the product's default; DeepSpeed does not
                  fsync), and AdaCheck loads verify every box's xxh3-128 hash; the save
                  ratio without fsync is printed too.

    .venv/bin/python scripts/bench_ds.py        # after scripts/demo.sh or test.sh made .venv
    .venv/bin/python scripts/bench_ds.py --dp 2 --stages 2 --dtypes bf16 --repeat 1
    python scripts/bench_ds.py --device cuda --dp 1 --stages 1 2 3      # one GPU (scripts/gpu_checks.sh)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def evict(path: str) -> int:
    """Drop the page cache of every file under ``path`` (``posix_fadvise(DONTNEED)``: written
    and synced files only; no root needed, unlike /proc/sys/vm/drop_caches), so the next read of
    them comes from the device: a cold load.  Returns the bytes those files hold."""
    total = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)           # (dirty pages are not dropped)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


# ----------------------------------------------------------------------------- device
def device() -> str:
    """Where the benchmark trains: ``cpu`` (gloo) or ``cuda`` (NCCL, DeepSpeed's default there, one
    GPU per rank), from the driver's ``--device`` (passed to the workers in the environment)."""
    return os.environ.get("ADACHECK_BENCH_DEVICE", "cpu")


def add_device_flag(ap) -> None:
    # a worker is not given --device: it follows its driver's, in the environment (else the
    # workers of a CUDA run would take gloo and CPU tensors for their collectives)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=device(),
                    help="train on the CPU (gloo) or one GPU per rank (NCCL); the DeepSpeed accelerator follows")


def init_distributed(deepspeed) -> None:
    if device() == "cuda":
        import torch
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed()            # DeepSpeed's default on CUDA: NCCL
    else:
        deepspeed.init_distributed(dist_backend="gloo")


def on_device(t):
    """``t`` where the job's collectives take it (NCCL: the GPU)."""
    return t.cuda() if device() == "cuda" else t


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective)."""
    import torch
    t = on_device(torch.tensor([seconds], dtype=torch.float64))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def slowest_each(seconds: dict) -> dict:
    """Per key, the largest of every rank's ``seconds[key]`` (a collective; every rank the same keys)."""
    import torch
    keys = sorted(seconds)
    t = on_device(torch.tensor([float(seconds[k]) for k in keys], dtype=torch.float64))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def device_sync() -> None:
    """Wait for the GPU's queued work before a clock is read (nothing on the CPU)."""
    if device() == "cuda":
        import torch
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- worker
def tiny_engine(a, stage: int, dtype: str, clip: float = 1.0, adacheck: dict = None):
    """(DeepSpeed engine, model): the benchmarks' TinyLM (``a.vocab``, ``a.dim``, ``a.layers``,
    seed 0) with AdamW at ZeRO ``stage`` in ``dtype``; ``adacheck``: the config's block, if any."""
    import deepspeed
    import torch
    from demo_train import TinyLM
    torch.manual_seed(0)
    model = TinyLM(vocab=a.vocab, dim=a.dim, layers=a.layers)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
           "gradient_clipping": clip, "steps_per_print": 10 ** 9}
    if adacheck is not None:
        cfg["adacheck"] = adacheck
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0], model


def train_step(engine, vocab: int, rank: int) -> None:
    """One step of TinyLM on this rank's tokens for the engine's step (deterministic)."""
    import torch
    g = torch.Generator().manual_seed(10_000 * engine.global_steps + rank)
    tokens = torch.randint(0, vocab, (2, 17), generator=g).to(engine.device)
    logits = engine(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()


def unique_bytes(engine, nparams: int) -> int:
    """The distinct logical state, counted from the engine and independent of AdaCheck: fp32
    master weights and every optimizer moment (4 bytes per element each), and the buffers."""
    import torch
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    moments = {k for st in base.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() >= 1}
    return nparams * 4 * (1 + len(moments)) + sum(b.numel() * b.element_size() for b in engine.module.buffers())


def worker(a) -> None:
    os.environ.setdefault("DS_ACCELERATOR", device())
    import deepspeed
    import torch

    import adacheck_ds
    from adacheck.config import AdaCheckConfig
    sys.path.insert(0, HERE)      # (demo_train, for tiny_engine)

    init_distributed(deepspeed)
    rank = torch.distributed.get_rank()
    dist = torch.distributed

    def timed(fn):
        # every operation starts with the disk idle (the previous one's dirty pages written), as
        # saves minutes apart find it: else one's fsync waits for the writeback of another's files;
        # and ends once the GPU ran what it queued (a load's copies to the device)
        device_sync()
        os.sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        device_sync()
        dist.barrier()
        return time.perf_counter() - t

    rows = []
    for stage in a.stages:
        for dtype in a.dtypes:
            # full checkpoints each time: no references into the previous repeat's save
            engine, model = tiny_engine(a, stage, dtype, adacheck={"enabled": True, "reference_previous": False})
            nparams = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())   # (ZeRO-3: partitioned)
            for _ in range(2):
                train_step(engine, a.vocab, rank)
            unique = unique_bytes(engine, nparams)
            work = os.path.join(a.work, f"dp{dist.get_world_size()}-z{stage}-{dtype}")
            nat, ada = os.path.join(work, "native"), os.path.join(work, "adacheck")
            fast = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(
                {"enabled": True, "fsync": False, "reference_previous": False}))
            t = {"native_save": [], "ada_save": [], "ada_save_nofsync": [], "native_load": [], "ada_load": [],
                 "floor": []}
            share = bytearray(unique // dist.get_world_size())
            start_writeback = getattr(ctypes.CDLL(None), "sync_file_range", None)

            def floor(i):
                # the disk's floor for a durable save: this rank's share of the unique bytes written
                # and fsynced, no format, no hash (every rank at once), the writeback of each 8 MiB
                # started behind the writes (Linux: sync_file_range), so the disk works beside the copy
                os.makedirs(work, exist_ok=True)
                with open(os.path.join(work, f"floor-{rank}-{i}"), "wb", buffering=0) as f:
                    view = memoryview(share)
                    for at in range(0, len(view), 8 << 20):
                        f.write(view[at:at + (8 << 20)])
                        if start_writeback is not None:
                            start_writeback(f.fileno(), ctypes.c_longlong(at), ctypes.c_longlong(8 << 20), 2)
                    os.fsync(f.fileno())
            profile = {}     # the phases of AdaCheck's fastest save and load (the slowest rank's, per phase)
            for i in range(a.repeat):
                order = [("native_save", lambda: adacheck_ds.save_native(engine, nat, tag=f"t{i}")),
                         ("ada_save", lambda: engine.save_checkpoint(ada, tag=f"t{i}")),
                         ("ada_save_nofsync", lambda: fast.save_checkpoint(ada + "-nofsync", tag=f"t{i}")),
                         ("floor", lambda: floor(i))]
                for name, fn in (order if i % 2 == 0 else order[::-1]):
                    t[name].append(timed(fn))
                    if name == "ada_save":
                        phases = slowest_each(engine.adacheck.last_manifest.stats["phases"])
                        if t[name][-1] == min(t[name]):
                            profile["save"] = dict(phases, total=t[name][-1])
                loads = [("native_load", lambda: adacheck_ds.load_native(engine, nat, tag=f"t{i}")),
                         ("ada_load", lambda: engine.load_checkpoint(ada, tag=f"t{i}"))]
                for name, fn in (loads if i % 2 == 0 else loads[::-1]):
                    without_moments(engine)
                    t[name].append(timed(fn))
                    if name == "ada_load":
                        phases = slowest_each(engine.adacheck.checkpointer.last_loaded.seconds)
                        if t[name][-1] == min(t[name]):
                            profile["load"] = dict(phases, total=t[name][-1])
            if rank == 0:
                last = f"t{a.repeat - 1}"
                nb, ab = du(os.path.join(nat, last)), du(os.path.join(ada, last))
                rows.append({"dp": dist.get_world_size(), "stage": stage, "dtype": dtype, "params": nparams,
                             **comparison(nb, ab, unique, t), "profile": profile})
                print(json.dumps(rows[-1]), flush=True)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(work, ignore_errors=True)
            engine.destroy()
    finish_worker(rows, a.rows)


def without_moments(engine) -> None:
    """The engine as a job that starts from a checkpoint has it when it loads: no optimizer moments
    yet (DeepSpeed makes them at the first step), so a timed load puts them in new memory, not into
    those the previous load left in use."""
    getattr(engine.optimizer, "optimizer", engine.optimizer).state.clear()


def comparison(native_bytes: int, ada_bytes: int, unique: int, t: dict) -> dict:
    """Bytes and the fastest time of each timed operation (native/ada save, save without
    fsync, load), as the ratios every save/load benchmark reports."""
    return {"native_bytes": native_bytes, "adacheck_bytes": ada_bytes, "unique_bytes": unique,
            "adacheck_over_unique": ada_bytes / unique, "native_over_adacheck": native_bytes / ada_bytes,
            **{f"{k}_s": min(v) for k, v in t.items() if v},
            "save_ratio": min(t["native_save"]) / min(t["ada_save"]),
            "save_ratio_nofsync": min(t["native_save"]) / min(t["ada_save_nofsync"]),
            "load_ratio": min(t["native_load"]) / min(t["ada_load"])}


def finish_worker(rows: list, rows_path: str) -> None:
    """End of a torchrun worker: rank 0 hands its rows to the driver, then all ranks leave."""
    import torch.distributed as dist
    if dist.get_rank() == 0:
        with open(rows_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver
def run_workers(script: str, dps, work, port_base: int, args, s3: bool = False) -> list:
    """Run ``script --worker`` under torchrun once per DP size; the rows rank 0 wrote.  ``s3``:
    with a local S3 API server (moto) running, its bucket's URL and storage options passed as
    ``--s3-url`` / ``--storage-options``."""
    if s3:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from s3server import s3_server
        with s3_server() as server:
            return run_workers(script, dps, work, port_base, [*args, "--s3-url", server.url("bench"),
                                                              "--storage-options", json.dumps(server.options)])
    tmp = work or tempfile.mkdtemp(prefix="adacheck-bench-")
    rows = []
    for dp in dps:
        rows_file = os.path.join(tmp, f"rows-dp{dp}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(dp), "--master_port",
               str(port_base + os.getpid() % 1000 + dp), script, "--worker", "--rows", rows_file,
               "--work", tmp, *args]
        print(f"[bench] DP={dp}", flush=True)
        code, tail = run_streaming(cmd, dict(os.environ, DS_ACCELERATOR=device(), OMP_NUM_THREADS="1"), 3600)
        if code != 0:
            print(tail)
            raise SystemExit(f"bench: DP={dp} run failed with exit code {code}")
        rows += json.load(open(rows_file))
    if work is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def run_streaming(cmd, env, timeout_s: float):
    """Run the workers: each row rank 0 prints (a JSON line) is passed on as it comes, so a run
    cut short (a GPU machine's time limit) still shows the rows it had; the rest of their output
    is kept to show when they fail.  Returns (exit code, the last 6,000 characters)."""
    import collections
    import threading
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(timeout_s, p.kill)
    watchdog.start()
    kept = collections.deque(maxlen=400)
    try:
        for line in p.stdout:
            kept.append(line)
            if line.startswith("{"):
                print(line, end="", flush=True)
        return p.wait(), "".join(kept)[-6000:]
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()


def table(rows) -> str:
    head = ("| DP | ZeRO | dtype | native B | AdaCheck B | unique B | Ada/unique | native/Ada "
            "| save ratio | save ratio (no fsync) | load ratio |")
    out = [head, "|" + "---:|" * 11]
    for r in rows:
        out.append(f"| {r['dp']} | {r['stage']} | {r['dtype']} | {r['native_bytes']:,} | "
                   f"{r['adacheck_bytes']:,} | {r['unique_bytes']:,} | {r['adacheck_over_unique']:.4f}x | "
                   f"{r['native_over_adacheck']:.2f}x | {r['save_ratio']:.2f} | "
                   f"{r['save_ratio_nofsync']:.2f} | {r['load_ratio']:.2f} |")
    return "\n".join(out)


SAVE_PHASES = ("collect", "hash", "exchange", "plan", "write", "commit", "publish")
LOAD_PHASES = ("open", "read", "apply")


def profile_table(rows) -> str:
    """Where AdaCheck's fastest save and load spent their time: per phase, the slowest rank's
    seconds (a save's phases: SavePipeline's steps, ``write`` with fsync; the disk floor: each rank
    writing its share of the unique bytes in one call and fsyncing it; a load's: open the
    manifest, read and verify, apply, and the rest of engine.load_checkpoint), with native's."""
    out = ["| DP | ZeRO | dtype | native save s | " + " | ".join(SAVE_PHASES) + " | AdaCheck save s "
           "| disk floor s | native load s | " + " | ".join(LOAD_PHASES) + " | rest | AdaCheck load s |",
           "|" + "---:|" * (3 + 1 + len(SAVE_PHASES) + 2 + 1 + len(LOAD_PHASES) + 2)]
    for r in rows:
        s, ld = r["profile"]["save"], r["profile"]["load"]
        rest = ld["total"] - sum(ld[k] for k in LOAD_PHASES)
        out.append(f"| {r['dp']} | {r['stage']} | {r['dtype']} | {r['native_save_s']:.3f} | "
                   + " | ".join(f"{s[k]:.3f}" for k in SAVE_PHASES) + f" | {s['total']:.3f} | "
                   f"{r['floor_s']:.3f} | {r['native_load_s']:.3f} | " + " | ".join(f"{ld[k]:.3f}" for k in LOAD_PHASES)
                   + f" | {rest:.3f} | {ld['total']:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json", default="bench_ds.json")
    add_device_flag(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ["ADACHECK_BENCH_DEVICE"] = a.device
    if a.worker:
        return worker(a)
    rows = run_workers(os.path.abspath(__file__), a.dp, a.work, 29600,
                       ["--vocab", str(a.vocab), "--dim", str(a.dim), "--layers", str(a.layers),
                        "--repeat", str(a.repeat), "--stages", *map(str, a.stages), "--dtypes", *a.dtypes])
    import torch
    import deepspeed
    result = {"rows": rows, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
              "cpu_count": os.cpu_count(), "model": {"vocab": a.vocab, "dim": a.dim, "layers": a.layers},
              "repeat": a.repeat, "device": a.device,
              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    print(table(rows))
    print("\nWhere AdaCheck's time goes (seconds, the slowest rank per phase):\n" + profile_table(rows))
    worst = max(r["adacheck_over_unique"] for r in rows)
    print(f"\nworst AdaCheck / unique logical state: {worst:.4f}x; JSON in {a.json}")


if __name__ == "__main__":
    main()
