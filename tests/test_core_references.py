"""Across checkpoints: unchanged boxes are referenced in the previous checkpoint, not rewritten,
and retention / cleanup never delete a file that a kept checkpoint reads."""
import os

import pytest
import torch

from adacheck.checkpoint import CheckpointReader, save
from adacheck.integration import LocalShard, LocalState
from adacheck.storage.commit import read_manifest
from adacheck.plan.exchange import SoloComm
from adacheck.types import Box

pytestmark = pytest.mark.unit


def state(frozen, trained, step):
    shards = [LocalShard("model/frozen", "model", tuple(frozen.shape), Box.full(frozen.shape), frozen),
              LocalShard("master/trained", "master", (4, 6), Box((0, 0), (2, 6)), trained[:2]),
              LocalShard("master/trained", "master", (4, 6), Box((2, 0), (2, 6)), trained[2:])]
    return LocalState(shards, objects={"step": step}, framework={"name": "test"}, step=step)


def read_all(d):
    r = CheckpointReader(str(d))
    return {n: r.read(n) for n in r.manifest.tensors}


def shard_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def test_unchanged_boxes_are_referenced_and_load(tmp_path):
    g = torch.Generator().manual_seed(1)
    frozen, trained = torch.randn(8, 8, generator=g), torch.randn(4, 6, generator=g)
    m1 = save(SoloComm(), str(tmp_path), "s1", lambda: state(frozen, trained, 1))
    trained[2:] += 1            # half of one tensor changes, the rest does not
    m2 = save(SoloComm(), str(tmp_path), "s2", lambda: state(frozen, trained, 2))
    assert m2.stats["stored_bytes"] == 2 * 6 * 4
    assert m2.stats["referenced_bytes"] == 8 * 8 * 4 + 2 * 6 * 4
    files = {b.file for e in m2.tensors.values() for b in e.boxes}
    assert files == {"s1/rank00000-g0.safetensors", "rank00000-g0.safetensors"}
    got = read_all(tmp_path / "s2")
    assert torch.equal(got["model/frozen"], frozen) and torch.equal(got["master/trained"], trained)
    # a third save references the bytes where they are (s1), not through s2
    m3 = save(SoloComm(), str(tmp_path), "s3", lambda: state(frozen, trained, 3))
    assert m3.stats["stored_bytes"] == 0
    assert {b.file for e in m3.tensors.values() for b in e.boxes} == {"s1/rank00000-g0.safetensors",
                                                                      "s2/rank00000-g0.safetensors"}
    assert m1.stats["referenced_bytes"] == 0


def test_references_cross_between_one_manifest_and_a_manifest_in_parts(tmp_path):
    """A job that changes size changes the exchange "auto" runs, so a save may reference a
    checkpoint of the other format: one manifest (ring) -> in parts (partitioned) -> one manifest,
    then retention down to the last; each loads what was saved, unchanged bytes referenced where
    they were first written."""
    frozen, trained = torch.ones(8, 8), torch.zeros(4, 6)
    save(SoloComm(), str(tmp_path), "s1", lambda: state(frozen, trained, 1), exchange="ring")
    trained[2:] += 1
    m2 = save(SoloComm(), str(tmp_path), "s2", lambda: state(frozen, trained, 2), exchange="partitioned")
    assert m2.format_version == 6 and m2.stats["referenced_bytes"] == 8 * 8 * 4 + 2 * 6 * 4
    trained[:2] += 1
    m3 = save(SoloComm(), str(tmp_path), "s3", lambda: state(frozen, trained, 3), exchange="ring", keep_last=1)
    assert m3.format_version < 5 and {b.file for e in m3.tensors.values() for b in e.boxes} == {
        "s1/rank00000-g0.safetensors", "s2/rank00000-g0.safetensors", "rank00000-g0.safetensors"}
    got = read_all(tmp_path / "s3")       # (s1 and s2 retired: their files that s3 reads stay)
    assert torch.equal(got["model/frozen"], frozen) and torch.equal(got["master/trained"], trained)
    assert not (tmp_path / "s2" / "manifest.json").exists()


def test_retention_keeps_referenced_files_and_resave_never_overwrites_them(tmp_path):
    frozen, trained = torch.ones(8, 8), torch.zeros(4, 6)
    save(SoloComm(), str(tmp_path), "s1", lambda: state(frozen, trained, 1))
    trained += 1
    save(SoloComm(), str(tmp_path), "s2", lambda: state(frozen, trained, 2))
    trained += 1
    save(SoloComm(), str(tmp_path), "s3", lambda: state(frozen, trained, 3), keep_last=1)
    # s1 and s2 are no checkpoints any more, but s3 still reads the frozen tensor from s1
    assert not (tmp_path / "s1" / "manifest.json").exists() and not (tmp_path / "s2").exists()
    assert shard_files(tmp_path / "s1") == ["rank00000-g0.safetensors"]
    assert torch.equal(read_all(tmp_path / "s3")["model/frozen"], frozen)
    # saving tag s1 again must not write over the file s3 references
    m = save(SoloComm(), str(tmp_path), "s1", lambda: state(frozen * 2, trained, 4), keep_last=1,
             reference_previous=False)
    assert read_manifest(str(tmp_path / "s1")).framework["generation"] == 1 and m.stats["referenced_bytes"] == 0
    assert torch.equal(read_all(tmp_path / "s1")["model/frozen"], frozen * 2)
    # now s3 was dropped by retention and nothing references s1's old file: it is gone
    assert shard_files(tmp_path / "s1") == ["rank00000-g1.safetensors"]


def test_torn_sweep_spares_referenced_files_and_same_tag_resave(tmp_path):
    frozen, trained = torch.ones(8, 8), torch.zeros(4, 6)
    save(SoloComm(), str(tmp_path), "a", lambda: state(frozen, trained, 1))
    trained += 1
    save(SoloComm(), str(tmp_path), "b", lambda: state(frozen, trained, 2))   # references a's file
    trained += 1
    save(SoloComm(), str(tmp_path), "a", lambda: state(frozen * 3, trained, 3), update_latest=False)
    # a's generation-0 file stays because b reads it; both checkpoints load correctly
    assert shard_files(tmp_path / "a") == ["rank00000-g0.safetensors", "rank00000-g1.safetensors"]
    assert torch.equal(read_all(tmp_path / "b")["model/frozen"], frozen)
    assert torch.equal(read_all(tmp_path / "a")["model/frozen"], frozen * 3)
    os.remove(tmp_path / "a" / "manifest.json")   # as if a's re-save had been torn
    save(SoloComm(), str(tmp_path), "c", lambda: state(frozen, trained, 4))
    assert shard_files(tmp_path / "a") == ["rank00000-g0.safetensors"]
    assert torch.equal(read_all(tmp_path / "c")["model/frozen"], frozen)


@pytest.mark.parametrize("exchange", ["ring", "partitioned"])
def test_cli_prune_dry_run_then_yes_and_diff(tmp_path, capsys, exchange):
    """(partitioned: format 5, whose reader gives a tensor's kind, dtype and shape from the meta
    file, without its boxes: diff compared those empty lists and found every tensor equal)"""
    from adacheck.cli import main
    frozen, trained = torch.ones(8, 8), torch.zeros(4, 6)
    for i in range(1, 5):
        save(SoloComm(), str(tmp_path), f"s{i}", lambda: state(frozen, trained, i), exchange=exchange)
        trained += 1
    before = sorted(os.listdir(tmp_path))
    assert main(["prune", str(tmp_path), "--keep-last", "2"]) == 0
    assert sorted(os.listdir(tmp_path)) == before and "would retire 2 checkpoint(s): s2, s1" in capsys.readouterr().out
    assert main(["prune", str(tmp_path), "--keep-last", "2", "--yes"]) == 0
    assert not (tmp_path / "s2").exists() and not (tmp_path / "s1" / "manifest.json").exists()
    assert shard_files(tmp_path / "s1") == ["rank00000-g0.safetensors"]   # s3 and s4 read it
    assert torch.equal(read_all(tmp_path / "s3")["model/frozen"], frozen)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "s3"), str(tmp_path / "s4")]) == 1
    out = capsys.readouterr().out
    assert "1 tensor(s) equal, 1 differ" in out and "master/trained" in out
    assert main(["diff", str(tmp_path / "s4"), str(tmp_path)]) == 0     # a save dir means its latest
    assert main(["prune", str(tmp_path), "--keep-last", "0"]) == 2


def test_resaving_a_tag_never_references_its_own_older_files(tmp_path):
    """s2 references s1's bytes; saving s1 again (a job that restarted from an earlier step)
    must write them anew, not point at its own older generation (which the manifest format
    forbids), so both it and later saves load."""
    frozen, trained = torch.ones(8, 8), torch.zeros(4, 6)
    save(SoloComm(), str(tmp_path), "s1", lambda: state(frozen, trained, 1))
    save(SoloComm(), str(tmp_path), "s2", lambda: state(frozen, trained + 1, 2))   # frozen -> s1
    m = save(SoloComm(), str(tmp_path), "s1", lambda: state(frozen, trained + 2, 1))
    assert all(not b.file.startswith("s1/") for e in m.tensors.values() for b in e.boxes)
    assert torch.equal(read_all(tmp_path / "s1")["model/frozen"], frozen)
    save(SoloComm(), str(tmp_path), "s3", lambda: state(frozen, trained + 3, 3))
    assert torch.equal(read_all(tmp_path / "s3")["model/frozen"], frozen)


def test_large_boxes_are_chunked_so_partial_changes_are_referenced(tmp_path):
    """With hash_chunk_bytes, a box is hashed and stored in row chunks: when only the last
    rows of a big tensor change (an embedding whose other tokens were not used), the next
    checkpoint writes one chunk and references the rest; loads are exact either way."""
    emb = torch.randn(64, 16)                      # 4 KiB; chunks of 1 KiB = 16 rows
    trained = torch.zeros(4, 6)

    def st(step):
        s = state(torch.ones(2, 2), trained, step)
        s.shards.append(LocalShard("model/emb", "model", (64, 16), Box.full((64, 16)), emb))
        return s
    m1 = save(SoloComm(), str(tmp_path), "s1", lambda: st(1), chunk_bytes=1024)
    assert [b.box.offsets[0] for b in m1.tensors["model/emb"].boxes] == [0, 16, 32, 48]
    emb[60:] += 1
    m2 = save(SoloComm(), str(tmp_path), "s2", lambda: st(2), chunk_bytes=1024)
    files = {b.box.offsets[0]: b.file for b in m2.tensors["model/emb"].boxes}
    assert files == {0: "s1/rank00000-g0.safetensors", 16: "s1/rank00000-g0.safetensors",
                     32: "s1/rank00000-g0.safetensors", 48: "rank00000-g0.safetensors"}
    assert torch.equal(read_all(tmp_path / "s2")["model/emb"], emb)
    r = CheckpointReader(str(tmp_path / "s2"))
    assert torch.equal(r.read("model/emb", Box((10, 3), (30, 5))), emb[10:40, 3:8])   # across chunks
    m3 = save(SoloComm(), str(tmp_path), "s3", lambda: st(3), chunk_bytes=0)     # 0: one box
    assert len(m3.tensors["model/emb"].boxes) == 1


def test_exchange_sends_a_digest_only_for_an_unchanged_structure_of_the_same_job(tmp_path):
    """A rank sends its structure again when its boxes changed, and a new job (another
    Checkpointer) starts with nothing cached: it never trusts what another job sent."""
    from adacheck.checkpoint import Checkpointer
    g = torch.Generator().manual_seed(3)
    frozen, trained = torch.randn(8, 4, generator=g), torch.randn(4, 6, generator=g)
    job = Checkpointer()
    sent = [job.save(SoloComm(), str(tmp_path / "a"), f"s{i}", lambda: state(fr, trained + i, i)).stats["exchange"]
            for i, fr in enumerate([frozen, frozen, frozen[:6], frozen[:6]])]
    assert [s["ranks_sent_digest_only"] for s in sent] == [0, 1, 0, 1]
    other = Checkpointer().save(SoloComm(), str(tmp_path / "b"), "s", lambda: state(frozen, trained, 9))
    assert other.stats["exchange"]["ranks_sent_digest_only"] == 0
    # what was loaded from both is what was saved (the digest-only exchange lost nothing)
    assert torch.equal(read_all(tmp_path / "a" / "s3")["model/frozen"], frozen[:6])


def du(d):
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs if f.endswith(".safetensors"))


def test_keep_last_caps_the_disk_and_small_unchanged_boxes_do_not_pin_large_files(tmp_path, capsys):
    """10 saves with keep_last 2.  (a) Weights that change at every step and a small unchanged box
    (an RNG state): the small box is written again, not referenced inside the first checkpoint's
    3 MB file, so the directory holds 2 checkpoints' files (before: the first file stayed, pinned
    by 4 KiB).  (b) A large frozen embedding beside the weights is still referenced: one copy
    on disk however many saves, and ``adacheck ls`` shows the bytes its retired checkpoint holds."""
    from adacheck.checkpoint import load

    def run(root, frozen):
        for step in range(1, 11):
            w = torch.full((768, 1024), float(step))                  # 3 MiB, new at every step
            shards = [LocalShard("master/w", "master", (768, 1024), Box.full((768, 1024)), w),
                      LocalShard("rng/state", "rng", (1024,), Box.full((1024,)), torch.arange(1024.0))]
            if frozen is not None:
                shards.append(LocalShard("model/emb", "model", tuple(frozen.shape), Box.full(frozen.shape), frozen))
            save(SoloComm(), root, f"s{step}", lambda: LocalState(shards, step=step), keep_last=2, fsync=False)

    small = str(tmp_path / "small")
    run(small, None)
    one = os.path.getsize(os.path.join(small, "s10", shard_files(os.path.join(small, "s10"))[0]))
    assert sorted(os.listdir(small)) == [".adacheck-lease.json", "README", "latest", "s10", "s9"]   # (the job lives)
    assert du(small) == 2 * one       # two checkpoints' files, nothing pinned
    frozen = torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024)   # 4 MiB
    big = str(tmp_path / "big")
    run(big, frozen)
    m = read_manifest(os.path.join(big, "s10"))
    assert {sb.file for sb in m.tensors["model/emb"].boxes} == {"s1/" + shard_files(os.path.join(big, "s1"))[0]}
    assert du(big) <= 4 * (1 << 20) + 3 * 3 * (1 << 20) + (64 << 10)   # one embedding, 3 weights. files (s1, s9, s10)
    import json
    from adacheck.cli import main
    assert main(["ls", big, "--json"]) == 0       # what the retired s1 still holds, in bytes
    rows = {r["tag"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["s1"]["state"] == "retired" and rows["s1"]["bytes"] == du(os.path.join(big, "s1"))
    # prune says so too, for a checkpoint retired before it ran
    assert main(["prune", big, "--keep-last", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["retire"] == ["s9"] and plan["retired_earlier_still_read"] == {"s1": du(os.path.join(big, "s1"))}
    assert main(["prune", big, "--keep-last", "1"]) == 0
    assert "retired earlier, files still read by kept checkpoints: s1" in capsys.readouterr().out
    got = load(SoloComm(), big, None, lambda r: {n: r.read(n) for n in r.manifest.tensors}, lambda st: st).result
    assert torch.equal(got["model/emb"], frozen) and torch.equal(got["master/w"], torch.full((768, 1024), 10.0))
