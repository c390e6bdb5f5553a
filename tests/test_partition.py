"""The partitioned exchange (``exchange: "partitioned"``, adacheck.plan.partition) against the ring, in
one launch of 8 real gloo ranks on two simulated nodes (tests/partition_worker.py): the same
boxes stored, derived and referenced, the same divergence warnings, the writers that the
per-holder-set placement gives from a global view, copies on distinct nodes, loads equal to
the tensors the worker made from seeds, and a refusal on every rank."""
import json
import os
import re

import pytest

from launch import check, launch

from adacheck.plan import planner
from adacheck.storage.commit import read_manifest
from adacheck.types import itemsize


def results(d, rank):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def manifest(path):
    return read_manifest(path)


def stored(m):
    """What a checkpoint stores, writers and files left out: per tensor, its kind, dtype, shape,
    derivation, and per box its hash, holders and whether it is referenced from an earlier one."""
    out = {}
    for name, e in m.tensors.items():
        boxes = sorted((sb.box.offsets, sb.box.lengths, sb.key, sb.hash, sb.holders, "/" in sb.file) for sb in e.boxes)
        out[name] = (e.kind, e.dtype, e.shape, e.derived, boxes)
    return out


def writers(m):
    got = {}
    for e in m.tensors.values():
        for sb in e.boxes:
            if "/" not in sb.file:
                got.setdefault(sb.key, []).append(int(re.match(r"rank(\d+)-", sb.file).group(1)))
    return got


@pytest.mark.parametrize("copies", [2])
def test_partitioned_exchange_stores_what_the_ring_stores(tmp_path, copies):
    d = str(tmp_path)
    nodes = ["a"] * 4 + ["b"] * 4
    check(launch(8, {"dir": d, "copies": copies, "chunk_bytes": 64}, d, script="partition_worker.py", timeout=300,
                 rank_env=lambda r: {"ADACHECK_NODE": nodes[r]}))
    res = [results(d, r) for r in range(8)]
    for r in range(8):
        for how in ("ring", "partitioned"):
            assert all(res[r][f"{how}/exact"].values()), (r, how, res[r][f"{how}/exact"])
            assert "StateError" in res[r][f"{how}/refused"] and "model/emb" in res[r][f"{how}/refused"], res[r]
    for r in range(8):       # 50 KB of objects per rank: every other rank's reach each rank with the ring, none
        # with the partitioned exchange (each rank's stay in its rank file), rank 0 included
        print("rank", r, "received in a save: ring", res[r]["ring/received"], "partitioned", res[r]["partitioned/received"],
              "; all-gathers: ring", res[r]["ring/all_gathers"], "partitioned", res[r]["partitioned/all_gathers"])
        assert res[r]["ring/received"] > 7 * 50000 and res[r]["partitioned/received"] < 50000, (r, res[r])
        # nor does any step of it all-gather (a step that succeeds on every rank: one small reduction)
        assert res[r]["partitioned/all_gathers"] == 0, (r, res[r])
        assert res[r]["ring/note"] == res[r]["partitioned/note"] == f"rank {r} x", res[r]
    for r in range(8):       # each rank's own boxes, read as a load in the same layout reads them
        for how in ("ring", "partitioned"):
            assert all(res[r][f"{how}/own"].values()) and len(res[r][f"{how}/own"]) >= 7, (r, how, res[r][f"{how}/own"])
        # partitioned: from the rank's own rank file alone, no part of the tensor table read
        own_file = os.path.getsize(f"{d}/partitioned/s3/manifest-g0-rank-{r:05d}.json")
        assert res[r]["partitioned/own_bytes"] == {"parts": 0, "rank_files": own_file}, res[r]["partitioned/own_bytes"]
        # ShardedObjects (adacheck_megatron.state.saved_objects): a rank that saved its own reads one
        # rank file, another of its data-parallel group two; one elsewhere is found in every rank's
        tp = r % 2
        assert res[r]["sharded_objects"] == {"mine": [tp, [tp, 3], 1 if r < 2 else 2], "other": [1 - tp, [1 - tp, 3]],
                                             "all": [["obj/tp0", "obj/tp1"], 8]}, res[r]["sharded_objects"]
    for r in range(8):       # a directory not shared between the nodes: refused on every rank
        for how in ("ring", "partitioned"):
            assert "IntegrityError" in res[r][f"{how}/local"] and "is not on the storage" in res[r][f"{how}/local"], \
                res[r][f"{how}/local"]
    assert not any(os.path.exists(f"{d}/{node}/local/{how}/t/manifest.json") for node in "ab"
                   for how in ("ring", "partitioned"))
    for how in ("ring", "partitioned"):
        assert not os.path.exists(f"{d}/{how}/s5/manifest.json")
        assert open(f"{d}/{how}/latest").read().strip() == "s4"
    for tag in ("s1", "s2", "s3", "s4"):
        ring, part = manifest(f"{d}/ring/{tag}"), manifest(f"{d}/partitioned/{tag}")
        assert stored(ring) == stored(part), tag
        for k in ("held_bytes", "logical_bytes", "stored_bytes", "derived_bytes", "referenced_bytes"):
            assert ring.stats[k] == part.stats[k], (tag, k)
        assert part.rank_objects == ring.rank_objects and part.objects == ring.objects
        assert part.layout == ring.layout
        on_disk = {f: {"writer": int(f[4:9]), "nbytes": os.path.getsize(f"{d}/partitioned/{tag}/{f}")}
                   for f in os.listdir(f"{d}/partitioned/{tag}") if f.endswith(".safetensors")}
        assert dict(part.files) == on_disk and len(on_disk) > 1
        # (format 5: each rank's node in its rank file)
        assert dict(part.topology, nodes=[part.ranks.get(r).node for r in range(8)]) == ring.topology
        # each writer is the one the per-holder-set placement chooses from the whole job's boxes
        items = {sb.key: (sb.box.numel * itemsize(e.dtype), sb.key, sb.holders)
                 for e in ring.tensors.values() for sb in e.boxes if "/" not in sb.file}
        want, _ = planner.place_by_group(list(items.values()), 8, copies=copies, nodes=nodes)
        got = writers(part)
        assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}, tag
        for key, ws in got.items():
            assert len({nodes[w] for w in ws}) == min(copies, len({nodes[h] for h in next(
                sb.holders for e in part.tensors.values() for sb in e.boxes if sb.key == key)})), key
    # s3 references unchanged boxes of s2 in small files, and writes again those in large files
    ref = {(n, sb.box.offsets) for n, e in ring.tensors.items() for sb in e.boxes if "/" in sb.file}
    again = {(n, sb.box.offsets) for n, e in ring.tensors.items() for sb in e.boxes
             if "/" not in sb.file and n == "master/d"}
    assert ref and again, (ref, again)
    # the same warnings, on rank 0 only
    for tag in ("s1", "s2", "s3", "s4"):
        w = res[0]["saves"][f"ring/{tag}"]["warnings"]
        assert any("declared replicas diverged: model/ln" in x for x in w), w
        assert res[0]["saves"][f"partitioned/{tag}"]["warnings"] == w
        assert all(not res[r]["saves"][f"partitioned/{tag}"]["warnings"] for r in range(1, 8))
    # traffic: the second save sends hashes only; rank 3 lost its caches before the third, and the
    # structures were sent again (two more rounds) where it was involved
    ex = [{t: res[r]["saves"][f"partitioned/{t}"]["exchange"] for t in ("s1", "s2", "s3", "s4")} for r in range(8)]
    assert all(e["s1"]["ranks_sent_digest_only"] == 0 for e in ex)
    assert sum(e["s1"]["senders"] for e in ex) > 8
    assert all(e["s2"]["ranks_sent_digest_only"] == e["s2"]["senders"] and e["s2"]["rounds"]["route"] == 1 for e in ex)
    assert ex[3]["s3"]["ranks_sent_digest_only"] == 0 < ex[3]["s3"]["senders"]
    assert all(e["s3"]["ranks_sent_digest_only"] >= e["s3"]["senders"] - 1 for r, e in enumerate(ex) if r != 3)
    assert sum(e["s2"]["bytes_received"] for e in ex) < sum(e["s1"]["bytes_received"] for e in ex) / 2
    assert all(e["s3"]["rounds"]["route"] == 3 for e in ex)
    # the fourth save places what the third did (same boxes, holders, references): reused, no round
    assert all(not e[t]["placement_reused"] for e in ex for t in ("s1", "s2", "s3"))
    assert all(e["s4"]["placement_reused"] and e["s4"]["rounds"]["place"] == 0 for e in ex)
    assert writers(manifest(f"{d}/partitioned/s4")) == writers(manifest(f"{d}/partitioned/s3"))
    ring_in = sum(res[r]["saves"]["ring/s1"]["exchange"]["bytes_received"] for r in range(8))
    assert sum(e["s1"]["bytes_received"] for e in ex) < ring_in
    parted_checks(d)


def parted_checks(d):
    """The partitioned saves' manifests are in parts (format 5): a reader of one tensor reads the
    root and one part; a rank file lists the boxes its rank held; an edited part or rank file is
    an IntegrityError, a missing one a FormatError (also for `adacheck verify`); retention and
    garbage collection keep the parts of what is kept, and remove those of retired or never
    committed saves."""
    import shutil
    from adacheck.storage import commit
    from adacheck.storage import manifest_files
    from adacheck.cli import main as cli
    from adacheck.errors import FormatError, IntegrityError
    from adacheck.format.hashing import owner_of
    from adacheck.checkpoint import CheckpointReader
    from adacheck.format.hashing import hash_buffer
    from adacheck.format.manifest import checksum, meta_name, part_name, rank_file_name
    ck = f"{d}/partitioned/s3"
    m = read_manifest(ck)
    assert m.format_version == 6 and m.index["parts"] == 8 and read_manifest(f"{d}/ring/s3").format_version == 2
    root = json.load(open(f"{ck}/manifest.json"))     # (nothing in it grows with the job)
    assert not {"files", "rank_objects", "layout"} & set(root) and set(root["topology"]) == {"world_size", "copies"}
    kept = sorted(f for f in os.listdir(ck) if f.startswith("manifest-g"))
    parts = [part_name(0, i) for i in range(8)]
    assert kept == sorted(parts + [rank_file_name(0, r) for r in range(8)] + [meta_name(0)])
    # a rank file lists the boxes its rank held, and no others: rank 2 held rows 16-23 of master/w
    held = m.ranks.get(2).tensors
    rows = sorted((sb.box.offsets[0], sb.box.lengths[0]) for sb in held["master/w"].boxes)
    assert rows[0][0] == 16 and sum(n for _, n in rows) == 8 and all(a + n <= 24 for a, n in rows), rows
    assert "master/big" not in held and set(held) >= {"model/emb", "model/w", "master/d", "model/d", "model/ln"}
    assert m.tensors["model/emb"].shape == (16, 8)
    one = os.path.getsize(os.path.join(ck, part_name(0, owner_of("model/emb", 8))))
    assert m.tensors.bytes_read == one < sum(os.path.getsize(os.path.join(ck, p)) for p in parts)
    assert len(list(m.tensors)) == len(m.tensors) == len(read_manifest(f"{d}/ring/s3").tensors)
    assert cli(["verify", "--quiet", ck]) == 0
    bad = f"{d}/bad/s3"
    shutil.copytree(ck, bad)
    victim = os.path.join(bad, part_name(0, owner_of("model/emb", 8)))
    text = open(victim).read()
    open(victim, "w").write(text.replace('"shape":[16,8]', '"shape":[8,16]'))
    with pytest.raises(IntegrityError, match="the entry of model/emb .* does not match the hash that binds it"):
        read_manifest(bad).tensors["model/emb"]
    assert cli(["verify", "--quiet", bad]) == 2      # (a damaged manifest stops the command)
    os.remove(victim)
    with pytest.raises(FormatError, match="is missing"):
        read_manifest(bad).tensors["model/emb"]
    # a rank file: edited, it is an IntegrityError for the rank that reads it and for verify; made to
    # say another hash with its checksum made good again, the box read from it does not verify and
    # verify finds it is not what the table says; missing, a FormatError
    bad = f"{d}/bad-rank/s3"
    shutil.copytree(ck, bad)
    victim = os.path.join(bad, rank_file_name(0, 2))
    text = open(victim).read()
    open(victim, "w").write(text.replace('"shape":[16,8]', '"shape":[8,16]'))
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        CheckpointReader(bad, prefer_rank=2).read("model/emb")
    assert CheckpointReader(bad, prefer_rank=3).read("model/emb").shape == (16, 8)
    assert cli(["verify", "--quiet", bad]) == 2
    held = json.loads(text)
    held["tensors"]["model/emb"]["boxes"][0]["hash"] = "xxh3_128:" + "0" * 32
    held["checksum"] = checksum(held)
    open(victim, "w").write(json.dumps(held))
    with pytest.raises(IntegrityError, match="manifest recorded xxh3_128:0000"):
        CheckpointReader(bad, prefer_rank=2).read("model/emb")
    assert cli(["verify", "--quiet", bad]) == 2
    with pytest.raises(IntegrityError, match="rank 2's file says of model/emb what the tensor table does not"):
        manifest_files.check_rank_files(read_manifest(bad))
    os.remove(victim)
    with pytest.raises(FormatError, match="is missing"):
        CheckpointReader(bad, prefer_rank=2).read("model/emb")
    # the meta file (what a load asks of a tensor it did not hold): edited, an IntegrityError; made to
    # say another shape with its hash in the manifest made good again, verify finds it is not what
    # the parts say
    bad = f"{d}/bad-meta/s3"
    shutil.copytree(ck, bad)
    meta = json.load(open(f"{bad}/manifest-g0-meta.json"))
    assert meta["meta"]["master/big"] == ["master", "float32", [2560, 1024], None, None]
    meta["meta"]["master/big"][2] = [1024, 2560]
    data = json.dumps(meta).encode()
    open(f"{bad}/manifest-g0-meta.json", "wb").write(data)
    with pytest.raises(IntegrityError, match="meta file .* does not match the hash"):
        CheckpointReader(bad, prefer_rank=0).entry("master/big")
    root = json.load(open(f"{bad}/manifest.json"))
    root["index"]["meta"] = hash_buffer(data)
    root["checksum"] = checksum(root)
    json.dump(root, open(f"{bad}/manifest.json", "w"))
    assert CheckpointReader(bad, prefer_rank=0).entry("master/big").shape == (1024, 2560)
    with pytest.raises(IntegrityError, match="meta"):
        manifest_files.check_rank_files(read_manifest(bad))
    assert cli(["verify", "--quiet", bad]) == 2
    # an interrupted save's part and a retired checkpoint's parts are garbage; the kept ones stay
    save_dir = f"{d}/partitioned"
    os.makedirs(f"{save_dir}/s9")
    shutil.copy(os.path.join(ck, parts[0]), f"{save_dir}/s9/{parts[0]}")
    commit.apply_retention(save_dir, 1, protect=("s3",))
    commit.collect_garbage(save_dir)
    assert not os.path.exists(f"{save_dir}/s9") and not any(f.startswith("manifest-g") for f in os.listdir(f"{save_dir}/s1"))
    assert sorted(f for f in os.listdir(ck) if f.startswith("manifest-g")) == kept
    assert all(m2.tensors["master/w"] for m2 in [read_manifest(ck)])


@pytest.mark.parametrize("world", [32])
def test_the_default_exchange_is_partitioned_from_32_ranks(tmp_path, world):
    """A job of 32 real ranks (gloo) saves with the default options: "auto" runs the partitioned
    exchange (format 5), the replicated embedding is stored once and the partitioned master weight
    once, and every rank reads back its own rows, the embedding and its RNG state, judged against
    the seeds they were made from (tests/auto_worker.py)."""
    d = str(tmp_path)
    out = launch(world, {"dir": f"{d}/ck"}, d, script="auto_worker.py", timeout=600, grace=120)
    check(out)
    recs = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
    for r, rec in enumerate(recs):
        for step in ("s1", "s2"):
            assert rec[step]["how"] == "partitioned" and rec[step]["format_version"] == 6, (r, rec)
        assert rec["own_rows"] and rec["emb"] and rec["rng"], (r, rec)
    assert recs[0]["s1"]["stored_bytes"] == 16 * 8 * 4 + 2 * world * 6 * 4 + 2 * world * 8     # (each box once)
    assert recs[0]["s2"]["stored_bytes"] == 2 * world * 6 * 4 + 2 * world * 8      # (the embedding referenced)
