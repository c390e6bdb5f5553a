"""Every collective path of a save and a load, in one process: 8 ranks as threads
(tests/thread_comm.py) save tests/partition_worker.py's layout (TP=2 x DP=4: replicas, a ZeRO
partition cut into chunks, a derivable bf16 copy, a diverged replica, per-rank objects) with the
ring and the partitioned exchange, three times.

Oracles that AdaCheck did not write: the full tensors made from seeds (each load must equal
them), safetensors' own reader of the files (each box stored once), the planner's placement
from the whole job's view (the partitioned exchange must choose the writers it chooses), and
the ring's checkpoint for the partitioned one (the same boxes, hashes, holders, references).
tests/test_partition.py runs the same layout in 8 real processes on two simulated nodes."""
import os

import pytest
import torch
from safetensors import safe_open

import partition_worker as layout
from test_partition import stored, writers     # (what a checkpoint stores, and who wrote each box)
from thread_comm import run_ranks

from adacheck.checkpoint import CheckpointReader, Checkpointer, Options
from adacheck.integration import LocalShard, LocalState
from adacheck.errors import AdaCheckError
from adacheck.plan import planner
from adacheck.storage.commit import read_manifest
from adacheck.types import Box, itemsize

pytestmark = pytest.mark.unit

WORLD = layout.WORLD
NAMES = ("model/emb", "model/w", "master/w", "master/d")


def state(rank, step):
    """The worker's layout without its 10 MB tensor (kept there to make some files large; here
    it would only make each save slower)."""
    s = layout.state(rank, step, LocalShard, LocalState, Box)
    s.shards = [x for x in s.shards if x.name != "master/big"]
    return s


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three saves with each exchange, then a save that one rank's dtype makes fail; what every
    rank read back."""
    d = str(tmp_path_factory.mktemp("inprocess"))

    def job(comm):
        rank, out = comm.rank, {}
        for how in ("ring", "partitioned"):
            ckpt = Checkpointer(options=Options(exchange=how, chunk_bytes=64, fsync=False))
            for step in (1, 2, 3):
                m = ckpt.save(comm, f"{d}/{how}", f"s{step}", lambda: state(rank, step))
                out[f"{how}/s{step}"] = m.stats["exchange"]

            def bad():
                s = state(rank, 5)
                if rank == 2:
                    s.shards[0] = LocalShard("model/emb", "model", (16, 8), Box.full((16, 8)),
                                             torch.zeros(16, 8, dtype=torch.float16))
                return s
            try:
                ckpt.save(comm, f"{d}/{how}", "s5", bad)
                out[f"{how}/refused"] = None
            except AdaCheckError as e:
                out[f"{how}/refused"] = f"{type(e).__name__}: {e}"
            reader = CheckpointReader(f"{d}/{how}/s3")
            out[f"{how}/exact"] = {n: torch.equal(reader.read(n), layout.full(n, layout.made_at(n, 3)))
                                   for n in NAMES}
            out[f"{how}/exact"]["model/d"] = torch.equal(reader.read("model/d"),
                                                         layout.full("master/d", 0).to(torch.bfloat16))
            out[f"{how}/exact"]["rng"] = reader.objects(rank)["rng"].tolist() == [rank, 3]
            own = CheckpointReader(f"{d}/{how}/s3", prefer_rank=rank)
            out[f"{how}/own"] = {s.name: torch.equal(own.read(s.name, s.box), s.tensor) for s in state(rank, 3).shards}
        return out

    return d, run_ranks(WORLD, job)


def test_every_rank_loads_the_seeded_tensors_and_its_own_boxes(saved):
    _, res = saved
    for r in range(WORLD):
        for how in ("ring", "partitioned"):
            assert all(res[r][f"{how}/exact"].values()), (r, how, res[r][f"{how}/exact"])
            assert all(res[r][f"{how}/own"].values()) and len(res[r][f"{how}/own"]) == len(state(r, 3).shards), (r, how)


def test_a_rank_that_disagrees_fails_the_save_on_every_rank_and_nothing_is_published(saved):
    d, res = saved
    for r in range(WORLD):
        for how in ("ring", "partitioned"):
            assert "StateError" in res[r][f"{how}/refused"] and "model/emb" in res[r][f"{how}/refused"], res[r]
    for how in ("ring", "partitioned"):
        assert not os.path.exists(f"{d}/{how}/s5/manifest.json")
        assert open(f"{d}/{how}/latest").read().strip() == "s3"


def test_partitioned_exchange_stores_what_the_ring_stores_with_the_planners_writers(saved):
    d, _ = saved
    for tag in ("s1", "s2", "s3"):
        ring, part = read_manifest(f"{d}/ring/{tag}"), read_manifest(f"{d}/partitioned/{tag}")
        assert stored(ring) == stored(part), tag
        for k in ("held_bytes", "logical_bytes", "stored_bytes", "derived_bytes", "referenced_bytes"):
            assert ring.stats[k] == part.stats[k], (tag, k)
        assert part.rank_objects == ring.rank_objects and part.objects == ring.objects
        items = {sb.key: (sb.box.numel * itemsize(e.dtype), sb.key, sb.holders)
                 for e in ring.tensors.values() for sb in e.boxes if "/" not in sb.file}
        want, _ = planner.place_by_group(list(items.values()), WORLD, copies=1, nodes=["n"] * WORLD)
        assert {k: sorted(v) for k, v in writers(part).items()} == {k: sorted(v) for k, v in want.items()}, tag


def test_each_box_is_stored_once_in_the_files(saved):
    """safetensors' own reader: across a checkpoint's files, every tensor key once, and the keys
    are exactly the boxes the manifest says this checkpoint wrote."""
    d, _ = saved
    for how in ("ring", "partitioned"):
        for tag in ("s1", "s3"):
            folder = f"{d}/{how}/{tag}"
            keys = []
            for f in sorted(os.listdir(folder)):
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(folder, f), "pt") as st:
                        keys += [k for k in st.keys() if not k.startswith("__")]
            m = read_manifest(folder)
            written = [sb.key for e in m.tensors.values() for sb in e.boxes if "/" not in sb.file]
            assert len(keys) == len(set(keys)) and sorted(keys) == sorted(written), (how, tag)


def test_the_second_save_exchanges_hashes_only(saved):
    _, res = saved
    ex = [{t: res[r][f"partitioned/{t}"] for t in ("s1", "s2")} for r in range(WORLD)]
    assert all(e["s1"]["ranks_sent_digest_only"] == 0 for e in ex)
    assert all(e["s2"]["ranks_sent_digest_only"] == e["s2"]["senders"] for e in ex)
    assert sum(e["s2"]["bytes_received"] for e in ex) < sum(e["s1"]["bytes_received"] for e in ex) / 2
