"""One rank of a job of ``spec["world"]`` ranks that saves with the default options (exchange
"auto") and reads back, for tests/test_partition.py.

Each rank holds an embedding replicated on every rank, its rows of a master weight partitioned
over all ranks and an RNG state of its own; every tensor is made here from seeds, so the test
judges the loads against them.  Two saves (the master weight changes between them), then every
rank reads its own rows and the whole embedding back.  ``python auto_worker.py SPEC OUT_DIR``."""
import json
import os
import sys
import zlib

import torch


def full(name, step, world):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}@{step}".encode()))
    shapes = {"model/emb": (16, 8), "master/w": (2 * world, 6)}
    return torch.randn(*shapes[name], generator=g)


def main():
    spec, out = json.load(open(sys.argv[1])), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo")
    from adacheck.checkpoint import CheckpointReader, Checkpointer, Options
    from adacheck.integration import LocalShard, LocalState
    from adacheck.plan.exchange import default_comm
    from adacheck.types import Box
    comm, rec = default_comm(), {}

    def state(step):
        emb, w = full("model/emb", 0, world), full("master/w", step, world)
        shards = [LocalShard("model/emb", "model", tuple(emb.shape), Box.full(emb.shape), emb),
                  LocalShard("master/w", "master", tuple(w.shape), Box((2 * rank, 0), (2, 6)),
                             w[2 * rank:2 * rank + 2].clone(), replicated=False)]
        return LocalState(shards, objects={"step": step}, rank_objects={"rng": torch.tensor([rank, step])},
                          step=step)

    job = Checkpointer(options=Options())
    for step in (1, 2):
        m = job.save(comm, spec["dir"], f"s{step}", lambda: state(step))
        rec[f"s{step}"] = {"how": m.stats["exchange"]["how"], "format_version": m.format_version,
                           **({"stored_bytes": m.stats["stored_bytes"]} if rank == 0 else {})}
    own = CheckpointReader(f"{spec['dir']}/s2", prefer_rank=rank)
    rec["own_rows"] = bool(torch.equal(own.read("master/w", Box((2 * rank, 0), (2, 6))),
                                       full("master/w", 2, world)[2 * rank:2 * rank + 2]))
    rec["emb"] = bool(torch.equal(own.read("model/emb"), full("model/emb", 0, world)))
    rec["rng"] = own.objects(rank)["rng"].tolist() == [rank, 2]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
