"""The storage layer: the whole core (save with references and retention, garbage collection,
load, verification, damage and the search for an intact checkpoint, the online-delta log) runs
on a backend without rename or directories, fsspec's in-memory filesystem, and writes exactly
the bytes it writes to a local directory.  Nothing reaches the local disk on the way."""
import os

import fsspec
import pytest
import torch

from adacheck.storage import commit
from adacheck.storage import manifest_files
from adacheck.online import deltas
from adacheck.online import deltalog
from adacheck.format.boxes import flat_range_to_boxes
from adacheck.checkpoint import CheckpointReader, find_intact, save, verify_part
from adacheck.integration import LocalShard, LocalState
from adacheck.errors import FormatError, IntegrityError
from adacheck.plan.exchange import SoloComm
from adacheck.storage.backends import LOCAL, FsspecStorage, PosixStorage, open_storage
from adacheck.types import Box

pytestmark = pytest.mark.unit


def state(step, frozen):
    g = torch.Generator().manual_seed(step)
    w = torch.randn(6, 4, generator=g)
    shards = [LocalShard("master/w", "master", (6, 4), b, w[b.slices()]) for b in flat_range_to_boxes((6, 4), 0, 24)]
    shards.append(LocalShard("model/w", "model", (6, 4), Box.full((6, 4)), w.bfloat16(), derive="master/w",
                             derive_ok=True))
    shards.append(LocalShard("model/frozen", "model", (3, 3), Box.full((3, 3)), frozen))
    return w, LocalState(shards, objects={"step": step, "t": torch.arange(3)}, rank_objects={"seed": step}, step=step)


def save_three(store, root):
    """Three checkpoints into ``root`` (a frozen tensor referenced by the later ones), keep 2."""
    frozen = torch.arange(9.0).view(3, 3)
    out = {}
    for step in (1, 2, 3):
        w, st = state(step, frozen)
        save(SoloComm(), root, f"s{step}", lambda st=st: st, keep_last=2, store=store, chunk_bytes=32)
        out[step] = w
    return out, frozen


def files_of(store, root):
    """Every file under ``root`` (relative path -> bytes), but the job's lease (its times differ)."""
    out = {}

    def walk(path, rel):
        for name in store.list(path):
            p, r = store.join(path, name), f"{rel}/{name}" if rel else name
            if store.is_dir(p):
                walk(p, r)
            elif name != ".adacheck-lease.json":
                out[r] = store.read_bytes(p)
    walk(root, "")
    return out


@pytest.fixture
def memory(tmp_path, monkeypatch):
    """An fsspec in-memory filesystem (emptied), with the working directory an empty local one:
    any code path that wrote to the local disk instead would show up there."""
    monkeypatch.chdir(tmp_path / "..")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield FsspecStorage(fs, "memory")
    assert os.listdir(cwd) == [], "something was written to the local disk"
    fs.store.clear()


def test_save_load_retention_and_references_on_an_object_store(memory, tmp_path):
    store, root = memory, "memory://ckpts/job"
    weights, frozen = save_three(store, root)
    assert commit.read_latest(root, store) == "s3"
    assert [t for t, m, _ in commit.list_checkpoints(root, store) if m is not None] == ["s2", "s3"]
    m3 = manifest_files.read_manifest(f"{root}/s3", store)
    refs = {b.file for b in m3.tensors["model/frozen"].boxes}
    assert refs == {"s1/rank00000-g0.safetensors"}      # retired s1 keeps the file s3 references
    assert store.list(f"{root}/s1") == ["rank00000-g0.safetensors"]
    r = CheckpointReader(f"{root}/s3", store=store)
    assert torch.equal(r.read("master/w"), weights[3]) and torch.equal(r.read("model/w"), weights[3].bfloat16())
    assert torch.equal(r.read("model/frozen"), frozen) and r.objects()["step"] == 3
    assert verify_part(r) > 0
    # the same saves into a local directory: byte for byte the same files
    local = str(tmp_path / "local")
    save_three(LOCAL, local)
    assert files_of(LOCAL, local) == files_of(store, root)
    assert not [f for f in files_of(store, root) if f.endswith(".tmp")]   # (an object store writes no temporaries)


def test_damage_on_an_object_store_is_found_and_the_intact_one_named(memory):
    store, root = memory, "memory://ckpts/job"
    save_three(store, root)
    shard = f"{root}/s3/" + next(f for f in store.list(f"{root}/s3") if f.endswith(".safetensors"))
    data = bytearray(store.read_bytes(shard))
    data[-3] ^= 1
    store.write_atomic(shard, bytes(data))
    with pytest.raises(IntegrityError, match="s3/rank00000-g0.safetensors"):
        verify_part(CheckpointReader(f"{root}/s3", store=store))
    tag, manifest = find_intact(SoloComm(), root, exclude=("s3",), store=store)
    assert tag == "s2" and manifest.step == 2
    store.write_atomic(f"{root}/latest", b"../../x\n")
    with pytest.raises(FormatError, match="latest is damaged"):
        commit.read_latest(root, store)


def test_delta_log_on_an_object_store(memory):
    store, ckpt = memory, "memory://ckpts/job/s1"
    lg = deltalog.DeltaLog(ckpt, 0, "n", fsync=False, store=store)
    try:
        for step in (2, 3):
            lg.begin(step)
            lg.add("g", torch.full((5,), float(step)))
            lg.submit(step, {"step": step}, {"rng": torch.arange(4)})
        lg.flush()
    finally:
        lg.close()
    steps, why = deltas.committed_steps(ckpt, 1, 1, store=store)
    assert [s.step for s in steps] == [2, 3] and why == "end of the log"
    assert torch.equal(deltas.read_grad(ckpt, steps[1], "g", 0), torch.full((5,), 3.0))
    assert deltas.read_extra(ckpt, steps[0], 0)["step"] == 2
    assert deltas.remove_steps_after(ckpt, 2, store) == [3] and deltas.step_dirs(ckpt, store) == [2]


def test_open_storage_picks_the_backend_and_refuses_options_for_local_paths(tmp_path):
    assert open_storage(str(tmp_path)) == (LOCAL, str(tmp_path))
    assert open_storage(f"file://{tmp_path}") == (LOCAL, str(tmp_path))
    store, path = open_storage("memory://bucket/run")
    assert isinstance(store, FsspecStorage) and not store.renames and path == "memory://bucket/run"
    assert isinstance(LOCAL, PosixStorage) and LOCAL.renames
    with pytest.raises(Exception, match="storage_options were given for the local path"):
        open_storage(str(tmp_path), {"anon": True})
    with pytest.raises(Exception, match="cannot open storage"):
        open_storage("nosuchprotocol://x")


def test_a_writer_that_fails_leaves_nothing_and_a_committed_file_survives_abort(tmp_path):
    for store, root in ((LOCAL, str(tmp_path)), (FsspecStorage(fsspec.filesystem("memory"), "memory"),
                                                  "memory://w")):
        store.make_dirs(root)
        w = store.open_writer(store.join(root, "a.bin"))
        w.write(b"half")
        w.abort()
        assert store.list(root) == []
        w = store.open_writer(store.join(root, "b.bin"))
        w.write(b"whole")
        assert w.commit() == 5
        w.abort()                     # (after a commit: nothing to take back)
        assert store.read_bytes(store.join(root, "b.bin")) == b"whole"
        store.remove_tree(root)


def test_block_reads_across_block_boundaries(memory):
    """An object store's small reads are served from whole blocks: with blocks of 37 bytes every
    box, header and file end crosses block boundaries, and every tensor reads back exactly."""
    store, root = memory, "memory://ckpts/job"
    weights, frozen = save_three(store, root)
    small = FsspecStorage(store.fs, "memory")
    small.BLOCK, small.BLOCKS_KEPT = 37, 3
    r = CheckpointReader(f"{root}/s3", store=small)
    assert torch.equal(r.read("master/w"), weights[3]) and torch.equal(r.read("model/frozen"), frozen)
    assert verify_part(CheckpointReader(f"{root}/s3", store=small)) > 0


def test_a_large_file_starts_its_writeback_as_it_is_written_and_keeps_its_bytes(tmp_path):
    """With fsync, a POSIX file's writeback is started every WRITE_BEHIND bytes (so the fsync at
    the commit waits for less); the file holds exactly what was written, under its final name."""
    from adacheck.storage import backends
    data = os.urandom(1 << 20) * 20 + b"tail"       # 20 MiB and a few bytes, in 1 MiB writes
    path = str(tmp_path / "big.bin")
    w = PosixStorage().open_writer(path, fsync=True)
    for i in range(0, len(data), 1 << 20):
        w.write(data[i:i + (1 << 20)])
    if backends._sync_file_range() is not None:       # Linux: every call was taken (valid ranges)
        assert w.behind and w.started == 2 * backends.WRITE_BEHIND
    assert w.commit() == len(data)
    with open(path, "rb") as f:
        assert f.read() == data
    assert not os.path.exists(path + ".tmp")
    plain = PosixStorage().open_writer(str(tmp_path / "plain.bin"), fsync=False)
    plain.write(data)
    assert not plain.behind and plain.started == 0 and plain.commit() == len(data)
