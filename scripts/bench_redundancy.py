"""Benchmark: what the redundancy detector finds and what it costs, on real DeepSpeed runs.

For every ZeRO stage x dtype (and a model with half its layers frozen) at each DP size, one
CPU/gloo training saves twice with AdaCheck (a few steps apart) and once more with the other
exchange, and prints (and writes as JSON):

  stored/unique   bytes on disk of the first checkpoint / the unique logical state, counted
                  from the engine (trained parameters: fp32 master + each moment; frozen
                  parameters: their weights; buffers)
  2nd/1st         bytes written by the second checkpoint / by the first (unchanged boxes are
                  referenced in the first)
  detect/save     time to hash every held box and exchange the (box, hash) lists / save time
  1st save B      bytes each rank received in the first save's exchange (every rank's full
                  (box, hash) list)
  ring B, gather B  bytes each rank received in the later saves' exchange, ring vs all-gather
                  (a rank whose boxes did not change sends a digest and its hashes only)

    .venv/bin/python scripts/bench_redundancy.py [--dp 2 4] [--json bench_redundancy.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(a) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    sys.path.insert(0, HERE)
    from bench_ds import du, finish_worker
    from demo_train import TinyLM

    deepspeed.init_distributed(dist_backend="gloo")
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = [(s, dt, False) for s in a.stages for dt in ("fp32", "bf16")] + [(s, "bf16", True) for s in a.stages]
    rows = []
    for stage, dtype, frozen in cases:
        torch.manual_seed(0)
        model = TinyLM(vocab=a.vocab, dim=a.dim, layers=a.layers)
        if frozen:   # the embedding and the first half of the blocks
            for m in [model.emb, *model.blocks[: a.layers // 2]]:
                m.requires_grad_(False)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.01)
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
               "bf16": {"enabled": dtype == "bf16"}, "gradient_clipping": 1.0,
               "steps_per_print": 10 ** 9, "adacheck": {"enabled": True}}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, model_parameters=trained,
                                               config=cfg)

        def train(n):
            for _ in range(n):
                g = torch.Generator().manual_seed(10_000 * engine.global_steps + rank)
                tokens = torch.randint(0, a.vocab, (2, 17), generator=g)
                logits = engine(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, a.vocab),
                                                         tokens[:, 1:].reshape(-1))
                engine.backward(loss)
                engine.step()

        train(2)
        base = getattr(engine.optimizer, "optimizer", engine.optimizer)
        moments = {k for st in base.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() >= 1}
        unique = sum(getattr(p, "ds_numel", p.numel()) * (4 * (1 + len(moments)) if p.requires_grad else p.element_size())
                     for p in engine.module.parameters())
        unique += sum(b.numel() * b.element_size() for b in engine.module.buffers())
        work = os.path.join(a.work, f"dp{world}-z{stage}-{dtype}{'-frozen' if frozen else ''}")
        ck = os.path.join(work, "ck")
        engine.save_checkpoint(ck, tag="first")
        m1 = engine.adacheck.last_manifest
        train(2)
        engine.save_checkpoint(ck, tag="second")
        m2 = engine.adacheck.last_manifest
        other = {"ring": "allgather", "allgather": "ring"}[m2.stats["exchange"]["how"]]
        from adacheck.config import AdaCheckConfig
        import adacheck_ds
        alt = adacheck_ds.AdaCheckDeepSpeed(engine, AdaCheckConfig.from_dict(
            {"enabled": True, "exchange": other, "reference_previous": False}))
        alt.save_checkpoint(os.path.join(work, other), tag="second")
        m3 = alt.last_manifest
        mine = {m["exchange"]["how"]: m["exchange"] for m in (m2.stats, m3.stats)}
        everyone = [None] * world
        dist.all_gather_object(everyone, dict({h: v["bytes_received"] for h, v in mine.items()},
                                              first=m1.stats["exchange"]["bytes_received"]))
        if rank == 0:
            first = du(os.path.join(ck, "first"))
            sec = m2.stats["seconds"]
            rows.append({
                "dp": world, "stage": stage, "dtype": dtype, "frozen_half": frozen,
                "unique_bytes": unique, "first_bytes": first, "stored_over_unique": first / unique,
                "second_bytes": du(os.path.join(ck, "second")),
                "second_over_first": du(os.path.join(ck, "second")) / first,
                "referenced_bytes_second": m2.stats["referenced_bytes"],
                "detect_s": sec["prepare"], "save_s": sec["total"],
                "detect_over_save": sec["prepare"] / sec["total"],
                "first_save_bytes_per_rank": max(e["first"] for e in everyone),   # structures sent in full
                "ring_bytes_per_rank": max(e["ring"] for e in everyone),
                "allgather_bytes_per_rank": max(e["allgather"] for e in everyone),
                "ring_s": mine["ring"]["seconds"], "allgather_s": mine["allgather"]["seconds"],
            })
            print(json.dumps(rows[-1]), flush=True)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
        engine.destroy()
    finish_worker(rows, a.rows)


def table(rows) -> str:
    out = ["| DP | ZeRO | dtype | frozen half | stored/unique | 2nd/1st | detect/save | 1st save B/rank "
           "| ring B/rank | all-gather B/rank | ring s | all-gather s |", "|" + "---:|" * 12]
    for r in rows:
        out.append(f"| {r['dp']} | {r['stage']} | {r['dtype']} | {'yes' if r['frozen_half'] else 'no'} | "
                   f"{r['stored_over_unique']:.4f}x | {r['second_over_first']:.3f} | "
                   f"{r['detect_over_save']:.2f} | {r['first_save_bytes_per_rank']:,} | {r['ring_bytes_per_rank']:,} | "
                   f"{r['allgather_bytes_per_rank']:,} | {r['ring_s']:.4f} | {r['allgather_s']:.4f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default="bench_redundancy.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    sys.path.insert(0, HERE)
    from bench_ds import run_workers
    rows = run_workers(os.path.abspath(__file__), a.dp, a.work, 29700,
                       ["--vocab", str(a.vocab), "--dim", str(a.dim), "--layers", str(a.layers),
                        "--stages", *map(str, a.stages)])
    with open(a.json, "w") as f:
        json.dump({"rows": rows, "model": {"vocab": a.vocab, "dim": a.dim, "layers": a.layers},
                   "cpu_count": os.cpu_count()}, f, indent=1)
    print(table(rows))
    print(f"JSON in {a.json}")


if __name__ == "__main__":
    main()
