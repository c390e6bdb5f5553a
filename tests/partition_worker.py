"""One rank of an 8-rank job (two simulated nodes) that saves the same synthetic layout with the
ring exchange and with the partitioned one, for tests/test_partition.py.

The layout (world 8, TP=2 x DP=4): an embedding replicated on every rank; a TP-sharded weight
replicated over each DP group; a master weight partitioned by rows over all ranks (ZeRO), cut into
row chunks; a bf16 copy of a master tensor, derivable; a LayerNorm weight whose replica on rank 5
diverged; a per-rank RNG state; a large master tensor held by ranks 4-7 only, so that their files
are large and the unchanged boxes in them are written again rather than referenced (too little
of those files would be read), while those in the small files of ranks 0-3 are referenced.  Every full tensor is made here from seeds, so the test can judge
the loads against them.  ``python partition_worker.py SPEC OUT_DIR``."""
import json
import os
import sys
import warnings
import zlib

import torch

WORLD, TP = 8, 2
CONSTANT = ("model/emb", "master/d")        # unchanged from one save to the next


def made_at(name, step):
    return 0 if name in CONSTANT else step


def full(name, step):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}@{step}".encode()))
    shapes = {"model/emb": (16, 8), "model/w": (8, 12), "master/w": (64, 6), "master/d": (8, 4),
              "model/ln": (12,), "master/big": (4 * 640, 1024)}
    return torch.randn(*shapes[name], generator=g)


def state(rank, step, LocalShard, LocalState, Box):
    tp, shards = rank % TP, []
    emb = full("model/emb", 0)
    shards.append(LocalShard("model/emb", "model", tuple(emb.shape), Box.full(emb.shape), emb.clone()))
    w = full("model/w", step)
    cols = w.shape[1] // TP
    shards.append(LocalShard("model/w", "model", tuple(w.shape), Box((0, tp * cols), (w.shape[0], cols)),
                             w[:, tp * cols:(tp + 1) * cols].clone()))
    m = full("master/w", step)
    rows = m.shape[0] // WORLD
    shards.append(LocalShard("master/w", "master", tuple(m.shape), Box((rank * rows, 0), (rows, m.shape[1])),
                             m[rank * rows:(rank + 1) * rows].clone(), replicated=False))
    d = full("master/d", 0)
    rows = d.shape[0] // WORLD
    shards.append(LocalShard("master/d", "master", tuple(d.shape), Box((rank * rows, 0), (rows, d.shape[1])),
                             d[rank * rows:(rank + 1) * rows].clone(), replicated=False))
    shards.append(LocalShard("model/d", "model", tuple(d.shape), Box.full(d.shape), d.to(torch.bfloat16),
                             derive="master/d", derive_ok=True))
    ln = full("model/ln", step) + (1.0 if rank == 5 else 0.0)      # a replica that diverged
    shards.append(LocalShard("model/ln", "model", tuple(ln.shape), Box.full(ln.shape), ln))
    if rank >= 4:
        big, rows = full("master/big", step), 640
        shards.append(LocalShard("master/big", "master", tuple(big.shape), Box(((rank - 4) * rows, 0), (rows, 1024)),
                                 big[(rank - 4) * rows:(rank - 3) * rows].clone(), replicated=False))
    rng = torch.tensor([rank, step], dtype=torch.int64)
    # (as adacheck_megatron keeps megatron-core's ShardedObjects: each by its main replica, here the
    # first data-parallel rank at each tensor-parallel rank)
    objs = {f"obj/tp{tp}": {"tp": tp, "t": torch.tensor([tp, step])}} if rank < TP else {}
    return LocalState(shards, objects={"step": step}, rank_objects={"rng": rng, "sharded_objects": objs}, step=step,
                      layout={"tp": tp, "dp": rank // TP})


def main():
    spec, out = json.load(open(sys.argv[1])), sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    from adacheck.checkpoint import CheckpointReader, Checkpointer, Options
    from adacheck.integration import LocalShard, LocalState
    from adacheck.errors import AdaCheckError
    from adacheck.plan.exchange import default_comm
    from adacheck.types import Box
    comm, rec = default_comm(), {"saves": {}}
    for how in ("ring", "partitioned"):
        opts = Options(exchange=how, copies=spec["copies"], chunk_bytes=spec["chunk_bytes"])
        job = Checkpointer(options=opts)
        for step in (1, 2, 3, 4):
            if step == 3 and rank == 3:
                job = Checkpointer(options=opts)         # this rank lost its caches (a new job object)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m = job.save(comm, f"{spec['dir']}/{how}", f"s{step}",
                             lambda: state(rank, step, LocalShard, LocalState, Box))
            rec["saves"][f"{how}/s{step}"] = {"exchange": m.stats["exchange"],
                                              "warnings": sorted(str(w.message) for w in caught)}
        # a rank that disagrees on a tensor's dtype: every rank raises, nothing is published
        def bad():
            s = state(rank, 5, LocalShard, LocalState, Box)
            if rank == 2:
                s.shards[0] = LocalShard("model/emb", "model", (16, 8), Box.full((16, 8)),
                                         torch.zeros(16, 8, dtype=torch.float16))
            return s
        try:
            job.save(comm, f"{spec['dir']}/{how}", "s5", bad)
            rec[f"{how}/refused"] = None
        except AdaCheckError as e:
            rec[f"{how}/refused"] = type(e).__name__ + ": " + str(e)
        # every rank reads every full tensor back (judged against the seeds by the test)
        reader = CheckpointReader(f"{spec['dir']}/{how}/s3")
        rec[f"{how}/exact"] = {n: bool(torch.equal(reader.read(n), full(n, made_at(n, 3))))
                               for n in ("model/emb", "model/w", "master/w", "master/d", "master/big")}
        rec[f"{how}/exact"]["model/d"] = bool(torch.equal(reader.read("model/d"), full("master/d", 0).to(torch.bfloat16)))
        rec[f"{how}/exact"]["rng"] = reader.objects(rank)["rng"].tolist() == [rank, 3]
        # each rank reads back the boxes it saved, as a load in the same layout does (with the ring's
        # manifest in one file, the partitioned one's from this rank's rank file): the bytes it saved
        own = CheckpointReader(f"{spec['dir']}/{how}/s3", prefer_rank=rank)
        saved = state(rank, 3, LocalShard, LocalState, Box)
        stored = [s for s in saved.shards if s.derive is None]
        rec[f"{how}/own"] = {s.name: bool(torch.equal(own.read(s.name, s.box), s.tensor)) for s in stored}
        rec[f"{how}/own"]["rng"] = own.objects(rank)["rng"].tolist() == [rank, 3]
        parted = hasattr(own.manifest.tensors, "bytes_read")
        rec[f"{how}/own_bytes"] = {"parts": own.manifest.tensors.bytes_read if parted else None,
                                   "rank_files": own.manifest.ranks.bytes_read if parted else None}
        # a derived box this rank held whole, from a source it held in part: the whole table
        rec[f"{how}/own"].update({s.name: bool(torch.equal(own.read(s.name, s.box), s.tensor))
                                  for s in saved.shards if s.derive is not None})
        if how == "partitioned":
            # megatron-core's ShardedObjects as adacheck_megatron's load finds them: this rank's own,
            # then its data-parallel group's (the ranks at its tensor-parallel rank), then everyone's
            from adacheck_megatron.state import saved_objects
            reader = CheckpointReader(f"{spec['dir']}/{how}/s3", prefer_rank=rank)
            tp, found = rank % TP, {}
            objs = saved_objects(reader, (rank, *range(tp, WORLD, TP)))
            mine = objs[f"obj/tp{tp}"]
            found["mine"] = [mine["tp"], mine["t"].tolist(), len(reader.manifest.ranks.loaded)]
            other = objs[f"obj/tp{1 - tp}"]
            found["other"] = [other["tp"], other["t"].tolist()]
            found["all"] = [sorted(objs), len(reader.manifest.ranks.loaded)]
            rec["sharded_objects"] = found
    # what a save makes each rank receive (every collective's results but its own contribution,
    # pickled), with 50 KB of objects per rank: the ring gives every rank every rank's; the
    # partitioned exchange keeps them in each rank's rank file, and no rank, rank 0 included,
    # receives the others'
    import pickle
    from adacheck.plan.exchange import TorchComm

    class Counting(TorchComm):
        received, all_gathers = 0, 0

        def _count(self, items, own):
            self.received += sum(len(pickle.dumps(x)) for i, x in enumerate(items) if i != own)
            return items

        def all_gather_object(self, obj):
            self.all_gathers += 1
            return self._count(super().all_gather_object(obj), self.rank)

        def gather_object(self, obj, dst=0):
            out = super().gather_object(obj, dst)
            return None if out is None else self._count(out, self.rank)

        def broadcast_object(self, obj, src=0):
            out = super().broadcast_object(obj, src)
            if self.rank != src:
                self._count([out], -1)
            return out

        def all_to_all_bytes(self, blocks):
            return self._count(super().all_to_all_bytes(blocks), self.rank)

        def all_gather_bytes(self, data, how="ring"):
            self.all_gathers += 1
            return self._count(super().all_gather_bytes(data, how), self.rank)

    def with_objects():
        s = state(rank, 1, LocalShard, LocalState, Box)
        s.rank_objects["note"] = f"rank {rank} " + "x" * 50000
        return s

    for how in ("ring", "partitioned"):
        counting = Counting()
        Checkpointer(options=Options(exchange=how)).save(counting, f"{spec['dir']}/objects-{how}", "o", with_objects)
        rec[f"{how}/received"], rec[f"{how}/all_gathers"] = counting.received, counting.all_gathers
        rec[f"{how}/note"] = CheckpointReader(f"{spec['dir']}/objects-{how}/o").objects(rank)["note"][:8]
    # a save directory that is not shared between the nodes (a relative path from each node's own
    # working directory): the files of the other node are not there, and the save is refused on
    # every rank, with the ring (rank 0 confirms every file) and partitioned (each rank the next's)
    node = os.environ["ADACHECK_NODE"]
    os.makedirs(f"{spec['dir']}/{node}/local/t", exist_ok=True)
    os.chdir(f"{spec['dir']}/{node}")
    for how in ("ring", "partitioned"):
        os.makedirs(f"local/{how}/t", exist_ok=True)
        try:
            Checkpointer(options=Options(exchange=how)).save(comm, f"local/{how}", "t",
                                                             lambda: state(rank, 1, LocalShard, LocalState, Box))
            rec[f"{how}/local"] = None
        except AdaCheckError as e:
            rec[f"{how}/local"] = type(e).__name__ + ": " + str(e)
    with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
