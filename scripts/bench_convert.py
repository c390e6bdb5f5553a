"""Benchmark: `adacheck convert --to deepspeed-universal` vs DeepSpeed's own ds_to_universal,
and `adacheck convert --to deepspeed` (native files of the saving layout).

One real DeepSpeed training (CPU, gloo, torchrun, ZeRO-2 bf16 by default) saves the same
engine state natively and with AdaCheck; then each converter runs in its own process tree:
DeepSpeed's ``python -m deepspeed.checkpoint.ds_to_universal`` on the native checkpoint and
``adacheck convert --to deepspeed-universal`` on the AdaCheck one.  Printed (and written as
JSON): wall seconds and peak RSS of each (the largest process of its tree), the ratio, and
whether the two universal checkpoints hold the same fp32 weights and moments, tensor for
tensor (exact equality of the values; DeepSpeed writes ZeRO-3 tensors flat).  The native files
``--to deepspeed`` writes are compared with DeepSpeed's own native save of the same engine,
file by file and tensor by tensor.

With ``--megatron-hidden H [H ...]``, instead: for each hidden size one real megatron-core
training (one CPU process, bf16, Adam) saves the same state with AdaCheck and natively
(torch_dist), then ``adacheck convert --to torch-dist`` (AdaCheck -> torch_dist) and
``--from torch-dist`` (the native one -> AdaCheck) run under the same measurement: seconds
and peak RSS against the checkpoint's bytes and its largest tensor, next to the RSS of a
process that only imports the converter (the floor).  Both directions stream one tensor at a
time, so their RSS should follow the largest tensor, not the checkpoint.

    .venv/bin/python scripts/bench_convert.py
    .venv/bin/python scripts/bench_convert.py --stage 1 --dim 256
    .venv/bin/python scripts/bench_convert.py --megatron-hidden 512 1536 --megatron-layers 8
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_ds import du, run_workers  # noqa: E402

_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode; "
            "print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def measured(cmd) -> dict:
    """Run ``cmd`` under a fresh parent; its wall time and the peak RSS of its process tree."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True,
                         env=dict(os.environ, DS_ACCELERATOR="cpu"))
    rc, secs, rss_kb = out.stdout.split()[-3:]
    if int(rc) != 0:
        raise SystemExit(f"bench_convert: {' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
    return {"seconds": float(secs), "peak_rss_bytes": int(rss_kb) * 1024}


def worker(a) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    import adacheck_ds
    from demo_train import TinyLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = TinyLM(vocab=a.vocab, dim=a.dim, layers=a.layers)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": a.stage}, "bf16": {"enabled": a.dtype == "bf16"},
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "adacheck": {"enabled": True}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine = deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
    for _ in range(2):
        g = torch.Generator().manual_seed(10_000 * engine.global_steps + rank)
        tokens = torch.randint(0, a.vocab, (2, 17), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(tokens[:, :-1]).float().reshape(-1, a.vocab),
                                                 tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
    adacheck_ds.save_native(engine, os.path.join(a.work, "native"), tag="t")
    engine.save_checkpoint(os.path.join(a.work, "adacheck"), tag="t")
    if rank == 0:
        with open(a.rows, "w") as f:
            json.dump([{"params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())}], f)
    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


def megatron_worker(a) -> None:
    """One megatron-core training process: two iterations, then an AdaCheck and a native save."""
    import torch
    import pretrain_gpt
    import adacheck_megatron
    from adacheck.config import AdaCheckConfig
    from adacheck_megatron.cpu import enable_cpu

    enable_cpu()
    torch.distributed.init_process_group("gloo")
    rows = []
    for hidden in a.megatron_hidden:
        args = pretrain_gpt.parse_args(argv=[
            "--num-layers", str(a.megatron_layers), "--hidden-size", str(hidden), "--num-attention-heads", "8",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--vocab-size", str(a.vocab), "--lr", "1e-3", "--train-iters", "10",
            "--bf16"])
        pretrain_gpt.initialize_parallel(args)
        model, config = pretrain_gpt.build_model(args)
        optimizer, scheduler = pretrain_gpt.build_optimizer(args, model, config)
        for it in (1, 2):
            pretrain_gpt.train_step(args, it, model, optimizer, scheduler)
        work = os.path.join(a.work, f"megatron-h{hidden}")
        args.adacheck, args.save = False, os.path.join(work, "native")
        pretrain_gpt.save_checkpoint(2, model, optimizer, scheduler, args)
        adacheck_megatron.save_checkpoint(2, model, optimizer, scheduler, args=args, config=AdaCheckConfig.from_dict(
            {"enabled": True, "reference_previous": False, "save_dir": os.path.join(work, "adacheck")}))
        rows.append({"hidden": hidden, "params": sum(p.numel() for m in model for p in m.parameters()),
                     "work": work})
        del model, optimizer, scheduler
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
    with open(a.rows, "w") as f:
        json.dump(rows, f)
    torch.distributed.destroy_process_group()


def megatron_main(a) -> None:
    work = a.work or tempfile.mkdtemp(prefix="adacheck-bench-convert-")
    rows = run_workers(os.path.abspath(__file__), [1], work, 29850,
                       ["--vocab", str(a.vocab), "--megatron-layers", str(a.megatron_layers),
                        "--megatron-hidden", *map(str, a.megatron_hidden)])
    floor = measured([sys.executable, "-c", "import adacheck.cli, adacheck_megatron.convert, megatron.core"])
    out = []
    for r in rows:
        w = r["work"]
        to = measured([sys.executable, "-m", "adacheck.cli", "convert", os.path.join(w, "adacheck"),
                       os.path.join(w, "to_torch_dist"), "--to", "torch-dist"])
        back = measured([sys.executable, "-m", "adacheck.cli", "convert", os.path.join(w, "native"),
                         os.path.join(w, "from_torch_dist"), "--from", "torch-dist"])
        row = dict(r, adacheck_bytes=du(os.path.join(w, "adacheck")), native_bytes=du(os.path.join(w, "native")),
                   largest_tensor_bytes=_largest(os.path.join(w, "adacheck")), to_torch_dist=to, from_torch_dist=back,
                   same_tensors=_same_adacheck(os.path.join(w, "adacheck"), os.path.join(w, "from_torch_dist")),
                   to_same_as_native=_same_torch_dist(os.path.join(w, "to_torch_dist"), os.path.join(w, "native")))
        out.append(row)
    import megatron.core
    import torch
    with open(a.json, "w") as f:
        json.dump({"megatron_rows": out, "import_floor": floor, "torch": torch.__version__,
                   "megatron_core": megatron.core.__version__, "cpu_count": os.cpu_count()}, f, indent=1)
    mib = 2 ** 20
    print("| params | AdaCheck ckpt | torch_dist ckpt | largest logical tensor | --to torch-dist | "
          "--from torch-dist | same tensors |\n|---:|---:|---:|---:|---:|---:|---|")
    for r in out:
        print(f"| {r['params']:,} | {r['adacheck_bytes'] / mib:,.0f} MiB | {r['native_bytes'] / mib:,.0f} MiB | "
              f"{r['largest_tensor_bytes'] / mib:,.0f} MiB | {r['to_torch_dist']['seconds']:.1f} s / "
              f"{r['to_torch_dist']['peak_rss_bytes'] / mib:,.0f} MiB | {r['from_torch_dist']['seconds']:.1f} s / "
              f"{r['from_torch_dist']['peak_rss_bytes'] / mib:,.0f} MiB | "
              f"{'yes' if r['to_same_as_native'] else 'NO'}; {'yes' if r['same_tensors'] else 'NO'} |")
    print("\n(same tensors: --to torch-dist wrote exactly the tensors of megatron-core's own save of the same "
          "state; --from torch-dist exactly those of AdaCheck's own save)")
    print(f"(time / peak RSS; a process that only imports the converter: {floor['peak_rss_bytes'] / mib:,.0f} MiB; "
          f"JSON in {a.json})")
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)


def _largest(ckpt: str) -> int:
    """Bytes of the largest logical tensor (megatron-core stacks the layers of a parameter into one)."""
    from adacheck import checkpoint as core
    return max(e.nbytes for e in core.CheckpointReader(core.resolve(ckpt)).manifest.tensors.values())


def _same_torch_dist(a_dir: str, b_dir: str) -> bool:
    """Do two torch_dist checkpoints hold the same tensors (keys, dtypes, values), read with
    megatron-core's own loader one at a time?"""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from adacheck_megatron.convert import _solo_group

    def only(d):
        return os.path.join(d, next(x for x in sorted(os.listdir(d)) if x.startswith("iter_")))

    a, b = only(a_dir), only(b_dir)
    done_with_group = _solo_group()
    try:
        ma, mb = dist_checkpointing.load_tensors_metadata(a), dist_checkpointing.load_tensors_metadata(b)
        if sorted(ma) != sorted(mb):
            return False

        def load(d, key, m):
            want = torch.empty(tuple(m.global_shape), dtype=m.dtype)
            return dist_checkpointing.load({"t": ShardedTensor.from_rank_offsets(key, want, replica_id=0)}, d)["t"]

        return all(ma[k].dtype == mb[k].dtype and torch.equal(load(a, k, ma[k]), load(b, k, mb[k])) for k in sorted(ma))
    finally:
        done_with_group()


def _same_adacheck(a_dir: str, b_dir: str) -> bool:
    """Do two AdaCheck Megatron checkpoints hold the same model / master / optimizer tensors?"""
    import torch
    from adacheck import checkpoint as core
    ra, rb = core.CheckpointReader(core.resolve(a_dir)), core.CheckpointReader(core.resolve(b_dir))
    names = sorted(n for n, e in ra.manifest.tensors.items() if e.kind in ("model", "master", "optim"))
    if names != sorted(n for n, e in rb.manifest.tensors.items() if e.kind in ("model", "master", "optim")):
        return False
    for n in names:
        x, y = ra.read(n), rb.read(n)
        if x.dtype != y.dtype or not torch.equal(x, y):
            return False
    return True


def same_universal(a_dir: str, b_dir: str) -> bool:
    import torch
    za, zb = os.path.join(a_dir, "zero"), os.path.join(b_dir, "zero")
    params = sorted(p for p in os.listdir(za) if os.path.isdir(os.path.join(za, p)))
    if params != sorted(p for p in os.listdir(zb) if os.path.isdir(os.path.join(zb, p))):
        return False
    for p in params:
        for f in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
            x = torch.load(os.path.join(za, p, f), weights_only=False)
            y = torch.load(os.path.join(zb, p, f), weights_only=False)
            x, y = (v["param"] if isinstance(v, dict) else v for v in (x, y))
            # (DeepSpeed writes ZeRO-3 tensors flat, AdaCheck in the parameter's shape; the
            # loader accepts both, so the values are compared)
            if x.dtype != y.dtype or not torch.equal(x.detach().reshape(-1), y.detach().reshape(-1)):
                return False
    return True


def _tensors(tree, path=""):
    import torch
    if torch.is_tensor(tree):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{path}/{i}")


def same_native(a_dir: str, b_dir: str) -> bool:
    """Do two native DeepSpeed checkpoints hold the same tensors, file by file and key by key?"""
    import torch
    files = sorted(f for f in os.listdir(a_dir) if f.endswith(".pt"))
    if files != sorted(f for f in os.listdir(b_dir) if f.endswith(".pt")):
        return False
    for f in files:
        x = dict(_tensors(torch.load(os.path.join(a_dir, f), weights_only=False, map_location="cpu")))
        y = dict(_tensors(torch.load(os.path.join(b_dir, f), weights_only=False, map_location="cpu")))
        if set(x) != set(y) or any(x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default="bench_convert.json")
    ap.add_argument("--megatron-hidden", type=int, nargs="+", default=None,
                    help="measure torch_dist conversions of megatron-core models of these hidden sizes instead")
    ap.add_argument("--megatron-layers", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return megatron_worker(a) if a.megatron_hidden else worker(a)
    if a.megatron_hidden:
        return megatron_main(a)
    work = a.work or tempfile.mkdtemp(prefix="adacheck-bench-convert-")
    rows = run_workers(os.path.abspath(__file__), [a.dp], work, 29800,
                       ["--stage", str(a.stage), "--dtype", a.dtype, "--vocab", str(a.vocab), "--dim", str(a.dim),
                        "--layers", str(a.layers)])
    ds_out, ada_out = os.path.join(work, "ds_universal"), os.path.join(work, "ada_universal")
    ds = measured([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   os.path.join(work, "native", "t"), "--output_folder", ds_out, "--num_extract_workers", "1",
                   "--num_merge_workers", "1", "--inject_missing_state"])
    ada = measured([sys.executable, "-m", "adacheck.cli", "convert", os.path.join(work, "adacheck"), ada_out,
                    "--to", "deepspeed-universal"])
    nat_out = os.path.join(work, "ada_native")
    nat = measured([sys.executable, "-m", "adacheck.cli", "convert", os.path.join(work, "adacheck"), nat_out,
                    "--to", "deepspeed"])
    ada_dir = os.path.join(ada_out, os.listdir(ada_out)[0]) if not os.path.isdir(os.path.join(ada_out, "zero")) \
        else ada_out
    ada_dir = next((os.path.join(r, "") for r, ds_, _ in os.walk(ada_out) if "zero" in ds_), ada_dir)
    ds_dir = next((os.path.join(r, "") for r, ds_, _ in os.walk(ds_out) if "zero" in ds_), ds_out)
    row = {"dp": a.dp, "stage": a.stage, "dtype": a.dtype, "params": rows[0]["params"],
           "native_bytes": du(os.path.join(work, "native")), "adacheck_bytes": du(os.path.join(work, "adacheck")),
           "ds_to_universal": ds, "adacheck_convert": ada,
           "time_ratio": ds["seconds"] / ada["seconds"], "rss_ratio": ds["peak_rss_bytes"] / ada["peak_rss_bytes"],
           "same_fp32_and_moments": same_universal(ds_dir, ada_dir),
           "adacheck_convert_native": nat,
           "native_same_tensors": same_native(os.path.join(work, "native", "t"), os.path.join(nat_out, "t"))}
    import deepspeed
    import torch
    with open(a.json, "w") as f:
        json.dump({"row": row, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                   "cpu_count": os.cpu_count()}, f, indent=1)
    print(f"| converter | seconds | peak RSS |\n|---|---:|---:|\n"
          f"| DeepSpeed ds_to_universal | {ds['seconds']:.2f} | {ds['peak_rss_bytes'] / 2**20:,.0f} MiB |\n"
          f"| adacheck convert --to deepspeed-universal | {ada['seconds']:.2f} | "
          f"{ada['peak_rss_bytes'] / 2**20:,.0f} MiB |\n"
          f"| adacheck convert --to deepspeed (ZeRO-{a.stage}, DP={a.dp}: {a.dp} ranks) | {nat['seconds']:.2f} | "
          f"{nat['peak_rss_bytes'] / 2**20:,.0f} MiB (largest rank) |\n\n"
          f"ZeRO-{a.stage} {a.dtype}, DP={a.dp}, {row['params']:,} params: time ratio (DeepSpeed / AdaCheck) "
          f"{row['time_ratio']:.2f}x, peak RSS ratio {row['rss_ratio']:.2f}x; same fp32 weights and moments: "
          f"{'yes' if row['same_fp32_and_moments'] else 'NO'}; native files from AdaCheck hold the tensors of "
          f"DeepSpeed's own native save, key for key: {'yes' if row['native_same_tensors'] else 'NO'}; "
          f"JSON in {a.json}")
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
