"""Golden bytes of the on-disk format, and hostile / damaged checkpoints."""
import json
import os
import shutil
import threading
import time
import warnings
import weakref

import pytest
import torch
from safetensors.torch import load_file

from adacheck.online import deltas

from adacheck.online import deltalog
from adacheck.format.boxes import flat_range_to_boxes
from adacheck.checkpoint import (Checkpointer, CheckpointReader, DeferredSource, LegacyFormatWarning, load, Options, resolve, save)
from adacheck.integration import LocalShard, LocalState
from adacheck.format.manifest import checksum, shard_file_of, writer_of
from adacheck.format.manifest import file_name
from adacheck.errors import DistributedError, FormatError, IntegrityError, NotFoundError
from adacheck.plan.exchange import SoloComm
from adacheck.types import Box

pytestmark = pytest.mark.unit

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "v2")
GOLDEN_V1 = os.path.join(os.path.dirname(__file__), "golden", "v1")   # written by format 1
# written by the partitioned exchange: formats 4 and 5 (by AdaCheck before format 6), format 6 (now)
GOLDEN_V4 = os.path.join(os.path.dirname(__file__), "golden", "v4")
GOLDEN_V5 = os.path.join(os.path.dirname(__file__), "golden", "v5")
GOLDEN_V6 = os.path.join(os.path.dirname(__file__), "golden", "v6")


def golden_state():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, generator=g)
    shards = [LocalShard("master/w", "master", (3, 5), b, w[b.slices()])
              for b in flat_range_to_boxes((3, 5), 0, 15)]
    shards.append(LocalShard("model/w", "model", (3, 5), Box.full((3, 5)), w.bfloat16(),
                             derive="master/w", derive_ok=True))
    shards.append(LocalShard("optim/step/w", "optim", (), Box.full(()), torch.tensor(7.0)))
    return w, LocalState(shards, objects={"lr": 0.5, "sched": {"last_epoch": 7}, "t": torch.arange(2)},
                         rank_objects={"seed": 1}, framework={"name": "test"}, step=7)


def write_golden(d, exchange="ring"):
    w, state = golden_state()
    if exchange == "ring":
        save(SoloComm(), d, "step7", lambda: state)
    else:
        Checkpointer(options=Options(exchange=exchange)).save(SoloComm(), d, "step7", lambda: state)
    return w


@pytest.mark.parametrize("exchange,golden", [("ring", GOLDEN), ("partitioned", GOLDEN_V6)])
def test_golden_bytes(tmp_path, exchange, golden):
    write_golden(str(tmp_path), exchange)
    produced = sorted(os.listdir(tmp_path / "step7"))
    assert produced == sorted(os.listdir(golden))
    for name in produced:
        assert (tmp_path / "step7" / name).read_bytes() == open(os.path.join(golden, name), "rb").read(), name


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_V1, GOLDEN_V4, GOLDEN_V5, GOLDEN_V6])
def test_golden_loads_and_is_standard_safetensors(golden):
    """Every format version loads (format 1 with a warning that it lacks the identity binding),
    with its rank's objects; formats 4-6 (in parts) read only what a load asks for."""
    w, _ = golden_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = CheckpointReader(golden)
    legacy = [c for c in caught if issubclass(c.category, LegacyFormatWarning)]
    assert len(legacy) == (1 if golden == GOLDEN_V1 else 0)
    assert torch.equal(r.read("master/w"), w)
    assert torch.equal(r.read("model/w"), w.bfloat16())
    assert r.objects()["sched"] == {"last_epoch": 7}
    assert torch.equal(r.objects()["t"], torch.arange(2))
    assert r.objects(0) == {"seed": 1} and len(r.manifest.rank_objects) == 1
    assert r.manifest.format_version == {GOLDEN: 2, GOLDEN_V1: 1, GOLDEN_V4: 4, GOLDEN_V5: 5, GOLDEN_V6: 6}[golden]
    if golden in (GOLDEN_V5, GOLDEN_V6):      # (its rank 0 reads its own rank file: no part of the tensor table)
        own = CheckpointReader(golden, prefer_rank=0)
        assert torch.equal(own.read("master/w"), w) and torch.equal(own.read("model/w"), w.bfloat16())
        assert torch.equal(own.objects()["t"], torch.arange(2)) and own.objects(0) == {"seed": 1}
        assert own.manifest.tensors.bytes_read == 0 < own.manifest.ranks.bytes_read
    raw = load_file(os.path.join(golden, "rank00000-g0.safetensors"))
    assert sum(t.numel() for t in raw.values()) == 15 + 1 + 2 + 0


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_V4, GOLDEN_V5, GOLDEN_V6])
def test_a_memory_checkpoint_of_each_format_is_copied_whole_to_durable_storage(tmp_path, golden):
    """tiers.persist_checkpoint, the memory tier's copy to the checkpoint directory (no collective:
    one rank here), of a checkpoint of each format that writes one: every file arrives with the
    golden's bytes (a format 4 one too, which has a part but no rank files), ``latest`` names it,
    and it loads the golden state."""
    from adacheck.checkpoint import confirm_files
    from adacheck.storage.commit import read_latest
    from adacheck.storage.backends import LOCAL
    from adacheck.tiers import persist_checkpoint
    w, _ = golden_state()
    ck = str(tmp_path / "ck")
    assert persist_checkpoint(0, golden, LOCAL, ck, "step7", fsync=False, update_latest=True, keep_last=None,
                              confirm=confirm_files)
    assert sorted(os.listdir(f"{ck}/step7")) == sorted(os.listdir(golden))
    for name in os.listdir(golden):
        assert open(f"{ck}/step7/{name}", "rb").read() == open(os.path.join(golden, name), "rb").read(), name
    assert read_latest(ck) == "step7"
    r = CheckpointReader(f"{ck}/step7")
    assert torch.equal(r.read("master/w"), w) and torch.equal(r.objects()["t"], torch.arange(2))


def test_a_region_of_a_tensor_reads_only_the_pages_of_its_part_that_list_it(tmp_path):
    """Format 6 pages each tensor's boxes in its part: a read of a region (a load in another
    layout) reads the part's header and the pages that meet the region, not the whole entry.
    Oracle: the tensors given to the save, and the part file's size on disk; an edited page or
    header is refused."""
    rows = 512
    w = torch.randn(rows, 8, generator=torch.Generator().manual_seed(1))
    shards = [LocalShard("master/w", "master", (rows, 8), Box((r, 0), (1, 8)), w[r:r + 1]) for r in range(rows)]
    shards += [LocalShard("model/w", "model", (rows, 8), Box((r, 0), (8, 8)), w[r:r + 8].bfloat16(),
                          derive="master/w", derive_ok=True) for r in range(0, rows, 8)]
    Checkpointer(options=Options(exchange="partitioned")).save(SoloComm(), str(tmp_path), "s1",
                                                               lambda: LocalState(shards, step=1))
    ck = str(tmp_path / "s1")
    part = os.path.join(ck, "manifest-g0-part-00000.json")
    size = os.path.getsize(part)
    r = CheckpointReader(ck)
    assert r.manifest.format_version == 6
    assert torch.equal(r.read("master/w", Box((300, 2), (3, 4))), w[300:303, 2:6])
    assert torch.equal(r.read_flat("master/w", 8 * 40, 8 * 41), w[40])
    assert torch.equal(r.read("model/w", Box((7, 0), (2, 8))), w[7:9].bfloat16())
    assert 0 < r.manifest.tensors.bytes_read < size / 4, (r.manifest.tensors.bytes_read, size)
    whole = CheckpointReader(ck)
    assert torch.equal(whole.read("master/w"), w) and whole.manifest.tensors.bytes_read == size
    # a page edited after the save (one digit of a box's offsets): that page is refused, the others read
    text = open(part, "rb").read()
    at = text.index(b'"offsets":[300,0]')
    open(part, "wb").write(text[:at] + b'"offsets":[301,0]' + text[at + 17:])
    damaged = CheckpointReader(ck)
    assert torch.equal(damaged.read("master/w", Box((2, 0), (1, 8))), w[2:3])
    with pytest.raises(IntegrityError, match="a page of master/w .bytes .* does not match the hash"):
        damaged.read("master/w", Box((300, 0), (1, 8)))
    # the tensor's entry edited (what it is): refused by the hash its header binds it by
    base = text.index(b"\n") + 1
    start, size, _ = json.loads(text[:base])["tensors"]["master/w"]
    entry = json.loads(text[base + start:base + start + size])
    assert entry["kind"] == "master" and entry["depth"] >= 1     # (pages of rows above the pages of boxes)
    open(part, "wb").write(text.replace(b'"kind":"master"', b'"kind":"optim"', 1))
    with pytest.raises(IntegrityError, match="the entry of master/w .bytes .* does not match the hash"):
        CheckpointReader(ck).read("master/w", Box((2, 0), (1, 8)))
    # the header edited (where an entry is): refused by its checksum
    open(part, "wb").write(text.replace(b'"master/w":[%d,' % start, b'"master/w":[%d,' % (start + 1), 1))
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        CheckpointReader(ck).read("master/w", Box((2, 0), (1, 8)))


def test_an_edited_part_of_a_format_4_checkpoint_is_refused(tmp_path):
    """Format 4 binds each part by its hash in the index: a part edited after the save (here one
    digit of a shape) is an IntegrityError when a tensor of it is asked for."""
    import shutil
    d = str(tmp_path / "step7")
    shutil.copytree(GOLDEN_V4, d)
    part = os.path.join(d, "manifest-g0-part-00000.json")
    text = open(part).read()
    assert text.count('"shape":[3,5]') == 2
    open(part, "w").write(text.replace('"shape":[3,5]', '"shape":[5,3]', 1))
    with pytest.raises(IntegrityError, match="its part manifest-g0-part-00000.json does not match the hash"):
        CheckpointReader(d).read("master/w")


def test_golden_hashes_follow_the_written_spec():
    """The format-2 digests and checksum, computed here from the spec with xxhash alone (not
    with AdaCheck's code): a box's hash is xxh3-128 of b"adacheck-identity-v1\\n", the 8-byte
    little-endian length of the identity JSON ["box", name, dtype, shape, offsets, lengths]
    (compact), that JSON, then the box's bytes; the manifest's checksum is xxh3-128 of its
    canonical JSON (sorted keys, compact, UTF-8) without the checksum field."""
    import xxhash
    with open(os.path.join(GOLDEN, "manifest.json")) as f:
        man = json.load(f)
    raw = load_file(os.path.join(GOLDEN, "rank00000-g0.safetensors"))
    checked = 0
    for name, t in man["tensors"].items():
        for b in t.get("boxes", []):
            ident = json.dumps(["box", name, t["dtype"], t["shape"], b["offsets"], b["lengths"]],
                               separators=(",", ":")).encode()
            h = xxhash.xxh3_128(b"adacheck-identity-v1\n" + len(ident).to_bytes(8, "little") + ident)
            data = raw[b["key"]].contiguous()
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
            assert b["hash"] == "xxh3_128:" + h.hexdigest(), name
            checked += 1
    assert checked == 3
    # a derived tensor records, per box its holders held, the digest of the derived bytes (the
    # source's, cast to its dtype) bound to the derived tensor's identity
    d = man["tensors"]["model/w"]["derived"]
    (b,) = d["boxes"]
    ident = json.dumps(["box", "model/w", "bfloat16", [3, 5], b["offsets"], b["lengths"]], separators=(",", ":")).encode()
    h = xxhash.xxh3_128(b"adacheck-identity-v1\n" + len(ident).to_bytes(8, "little") + ident)
    h.update(raw["master/w@0+3_0+5"].bfloat16().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert d["source"] == "master/w" and b["hash"] == "xxh3_128:" + h.hexdigest()
    body = {k: v for k, v in man.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert man["checksum"] == "xxh3_128:" + xxhash.xxh3_128(text).hexdigest()


def test_deferred_tensors_save_the_same_bytes_reading_one_tensor_at_a_time(tmp_path):
    """Offline conversions hand the save tensors it reads on demand: the files are byte for byte
    those of the same save with the tensors in memory (also when big tensors are cut into
    pieces), each tensor is read once to hash it and once to write it, and the source never
    holds more than one tensor (it drops the last before the next read)."""
    g = torch.Generator().manual_seed(1)
    full = {"a": torch.randn(40, 8, generator=g), "b": torch.randn(3, 5, generator=g).bfloat16(),
            "c": torch.randn(64, generator=g), "d": torch.tensor(3.0)}
    held, alive = [], []

    def read(key):
        assert not [r for r in alive if r() is not None], "an earlier tensor is still held"
        held.append(key)
        t = full[key]
        arr = t.view(torch.int16).numpy().copy() if t.dtype == torch.bfloat16 else t.numpy().copy()
        alive.append(weakref.ref(arr))      # alive while any tensor uses its memory
        out = torch.from_numpy(arr)
        return out.view(torch.bfloat16) if t.dtype == torch.bfloat16 else out

    src = DeferredSource(read)
    eager = [LocalShard(k, "optim", tuple(t.shape), Box.full(t.shape), t) for k, t in full.items()]
    lazy = [LocalShard(k, "optim", tuple(t.shape), Box.full(t.shape), src.tensor(k, t.shape, t.dtype))
            for k, t in full.items()]
    for name, shards in (("eager", eager), ("lazy", lazy)):
        save(SoloComm(), str(tmp_path / name), "s", lambda: LocalState(list(shards), step=1), chunk_bytes=256)
    files = sorted(os.listdir(tmp_path / "eager" / "s"))
    assert files == sorted(os.listdir(tmp_path / "lazy" / "s"))
    for f in files:
        assert (tmp_path / "eager" / "s" / f).read_bytes() == (tmp_path / "lazy" / "s" / f).read_bytes(), f
    assert len(CheckpointReader(str(tmp_path / "lazy" / "s")).manifest.tensors["a"].boxes) == 5   # pieces
    assert sorted(held) == sorted(list(full) * 2) and src.reads == 8
    bad = DeferredSource(lambda key: torch.zeros(2))
    with pytest.raises(DistributedError, match=r"x: read torch.float32\[2\], expected torch.float32\[3\]"):
        save(SoloComm(), str(tmp_path / "bad"), "s", lambda: LocalState(
            [LocalShard("x", "optim", (3,), Box.full((3,)), bad.tensor("x", (3,), torch.float32))]))


@pytest.fixture
def ckpt(tmp_path):
    write_golden(str(tmp_path))
    return tmp_path / "step7"


def shard(ckpt):
    return ckpt / "rank00000-g0.safetensors"


def read_all(d):
    r = CheckpointReader(str(d))
    return {n: r.read(n) for n in r.manifest.tensors}


def test_bit_flip_names_tensor_and_file(ckpt):
    data = bytearray(shard(ckpt).read_bytes())
    data[-3] ^= 0x10
    shard(ckpt).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"rank00000-g0\.safetensors.*hash") as e:
        read_all(ckpt)
    assert "object/t" in str(e.value) or "master/w" in str(e.value) or "optim" in str(e.value)


def test_truncated_file(ckpt):
    data = shard(ckpt).read_bytes()
    shard(ckpt).write_bytes(data[:-10])
    with pytest.raises(FormatError, match="truncated"):
        read_all(ckpt)
    shard(ckpt).write_bytes(data[:5])
    with pytest.raises(FormatError, match="too short"):
        read_all(ckpt)


def edit_manifest(ckpt, fn, rechecksum=True):
    """Edit the manifest as a tool would (``rechecksum``: its checksum made to match again, so
    that the field checks behind it are reached) or by hand (the checksum left as it was)."""
    p = ckpt / "manifest.json"
    d = json.loads(p.read_text())
    fn(d)
    if rechecksum:
        d["checksum"] = checksum(d)
    p.write_text(json.dumps(d))


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["files"].update({"../../etc/passwd.safetensors": {"nbytes": 1, "writer": 0}}), "plain"),
    (lambda d: d["tensors"]["master/w"]["boxes"][0].update(file="x.safetensors"), "does not list"),
    (lambda d: d["tensors"]["master/w"]["boxes"][0].update(file="../x.safetensors"), "earlier tag"),
    (lambda d: d["tensors"]["master/w"]["boxes"][0].update(file="a/../../x.safetensors"), "earlier tag"),
    (lambda d: d["tensors"]["master/w"]["boxes"][0].update(file="/etc/x.safetensors"), "earlier tag"),
    (lambda d: d["tensors"]["master/w"]["boxes"][0].update(file="step7/x.safetensors"), "earlier tag"),
    (lambda d: d["tensors"]["master/w"]["boxes"][0].update(file="s6/../x.safetensors"), "earlier tag"),
    (lambda d: d["tensors"]["master/w"].update(shape=[3, 6]), "cover"),
    (lambda d: d["tensors"]["master/w"]["boxes"][0].update(lengths=[9, 5]), "outside"),
    (lambda d: d["tensors"]["master/w"].update(dtype="complex64"), "dtype"),
    (lambda d: d["tensors"]["master/w"]["boxes"][0].update(hash="md5:00"), "xxh3_128"),
    (lambda d: d.update(format_version=99), "format_version 99"),
    (lambda d: d["tensors"]["model/w"]["derived"].update(source="nope"), "derived"),
    (lambda d: d.update(objects={"x": {"__tensor__": "ghost"}}), "ghost"),
    (lambda d: d.pop("tensors"), "tensors"),
])
def test_bad_manifests_are_rejected_before_use(ckpt, edit, match):
    edit_manifest(ckpt, edit)
    with pytest.raises(FormatError, match=match):
        CheckpointReader(str(ckpt))


def test_a_hand_edit_of_the_manifest_breaks_its_checksum(ckpt):
    """Any change of meaning, however small and however valid the result, is refused before the
    manifest is used; formatting (indentation, key order) is not a change of meaning."""
    edit_manifest(ckpt, lambda d: d.update(step=8), rechecksum=False)
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        CheckpointReader(str(ckpt))
    edit_manifest(ckpt, lambda d: d.update(step=7), rechecksum=False)   # back as it was: compact JSON
    assert CheckpointReader(str(ckpt)).manifest.step == 7


def chunked(tmp_path):
    """A checkpoint of two same-shape tensors, each stored as three row chunks."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    state = LocalState([LocalShard("master/a", "master", (6, 4), Box.full((6, 4)), a),
                        LocalShard("master/b", "master", (6, 4), Box.full((6, 4)), b)], step=1)
    save(SoloComm(), str(tmp_path), "s", lambda: state, chunk_bytes=32)
    return tmp_path / "s", a, b


def test_moving_boxes_in_a_self_consistent_manifest_is_an_integrity_error(tmp_path):
    """The audit's attack: swap the offsets of two row chunks of one tensor, or the names of two
    same-shape tensors, and make the checksum match again.  Every hash still matches its bytes,
    but not what the box claims to be: the load fails instead of exchanging the rows."""
    ckpt, a, b = chunked(tmp_path)
    assert len(CheckpointReader(str(ckpt)).manifest.tensors["master/a"].boxes) == 3
    pristine = (ckpt / "manifest.json").read_text()
    for read in (lambda r: r.read("master/a"), lambda r: r.read("master/a", Box((2, 0), (2, 4)))):
        def swap_offsets(d):
            boxes = d["tensors"]["master/a"]["boxes"]
            boxes[0]["offsets"], boxes[1]["offsets"] = boxes[1]["offsets"], boxes[0]["offsets"]
        edit_manifest(ckpt, swap_offsets)
        with pytest.raises(IntegrityError, match="master/a"):
            read(CheckpointReader(str(ckpt)))
        (ckpt / "manifest.json").write_text(pristine)

    def swap_names(d):
        t = d["tensors"]
        t["master/a"], t["master/b"] = t["master/b"], t["master/a"]
    edit_manifest(ckpt, swap_names)
    r = CheckpointReader(str(ckpt))
    for name in ("master/a", "master/b"):
        with pytest.raises(IntegrityError, match=name):
            r.read(name)
    (ckpt / "manifest.json").write_text(pristine)
    r = CheckpointReader(str(ckpt))
    assert torch.equal(r.read("master/a"), a) and torch.equal(r.read("master/b"), b)


def test_a_derivation_pointed_at_another_source_is_refused(tmp_path):
    """A derived (proven-cast) tensor is checked like a stored one: its derivation moved to
    another tensor of the same shape, checksum matching again, fails instead of loading the cast
    of the wrong tensor."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    state = LocalState([LocalShard("master/a", "master", (4, 3), Box.full((4, 3)), a),
                        LocalShard("master/b", "master", (4, 3), Box.full((4, 3)), b),
                        LocalShard("model/a", "model", (4, 3), Box.full((4, 3)), a.bfloat16(), derive="master/a",
                                   derive_ok=True)], step=1)
    save(SoloComm(), str(tmp_path), "s", lambda: state)
    ckpt = tmp_path / "s"
    assert torch.equal(CheckpointReader(str(ckpt)).read("model/a"), a.bfloat16())
    from adacheck.cli import main as cli
    assert cli(["verify", "--quiet", str(ckpt)]) == 0
    edit_manifest(ckpt, lambda d: d["tensors"]["model/a"]["derived"].update(source="master/b"))
    with pytest.raises(IntegrityError, match="model/a.*derived from master/b"):
        CheckpointReader(str(ckpt)).read("model/a")
    assert cli(["verify", "--quiet", str(ckpt)]) == 1      # adacheck verify checks derived boxes too
    assert torch.equal(CheckpointReader(str(ckpt), verify=False).read("model/a"), b.bfloat16())   # (unchecked)


def test_a_box_pointing_at_another_tensors_bytes_is_refused_also_from_the_cache(tmp_path):
    """Two tensors' boxes naming the same stored bytes (and hash): the bytes were verified for
    one identity and are not handed out for the other."""
    ckpt, a, b = chunked(tmp_path)

    def alias(d):
        t = d["tensors"]
        for ba, bb in zip(t["master/a"]["boxes"], t["master/b"]["boxes"]):
            bb.update(file=ba["file"], key=ba["key"], hash=ba["hash"])
    edit_manifest(ckpt, alias)
    r = CheckpointReader(str(ckpt))
    assert torch.equal(r.read("master/a"), a)       # (now in the cache)
    with pytest.raises(IntegrityError, match="master/b"):
        r.read("master/b")


def test_manifest_shape_disagreeing_with_file_header(ckpt):
    def swap(d):
        d["tensors"]["master/w"]["dtype"] = "int32"
    edit_manifest(ckpt, swap)
    with pytest.raises(FormatError, match="in the file but the manifest says"):
        read_all(ckpt)


def test_no_checkpoint_and_incomplete_checkpoint(tmp_path):
    with pytest.raises(NotFoundError, match="no 'latest'"):
        resolve(str(tmp_path))
    write_golden(str(tmp_path))
    os.remove(tmp_path / "latest")
    with pytest.raises(NotFoundError, match=r"complete checkpoints present: \['step7'\]"):
        resolve(str(tmp_path))
    os.remove(tmp_path / "step7" / "manifest.json")
    with pytest.raises(NotFoundError):
        CheckpointReader(str(tmp_path / "step7"))


def test_resave_same_tag_keeps_old_until_commit_and_cleans_up(tmp_path):
    w = write_golden(str(tmp_path))
    _, state = golden_state()
    state.shards[0].tensor.add_(1)   # a failing collect must leave the old checkpoint intact

    def broken():
        raise OSError(28, "No space left on device", str(tmp_path / "step7"))
    with pytest.raises(Exception, match="No space left on device"):
        save(SoloComm(), str(tmp_path), "step7", broken)
    assert torch.equal(CheckpointReader(str(tmp_path / "step7")).read("master/w"), w)
    write_golden(str(tmp_path))
    assert sorted(os.listdir(tmp_path / "step7")) == ["manifest.json", "rank00000-g1.safetensors"]


def test_loader_stages_before_applying(ckpt):
    applied = []

    def read(r):
        raise FormatError("boom")
    with pytest.raises(Exception, match="boom"):
        load(SoloComm(), str(ckpt.parent), None, read, applied.append)
    assert applied == []


def test_next_commit_removes_torn_saves_of_a_killed_job(tmp_path):
    """A job killed mid-save leaves shard files without a manifest; the next successful save
    removes them (and only them: a damaged manifest and foreign files are left alone)."""
    write_golden(str(tmp_path))
    torn = tmp_path / "step8"
    torn.mkdir()
    (torn / "rank00000-g0.safetensors.tmp").write_bytes(b"x" * 100)
    (torn / "rank00001-g0.safetensors").write_bytes(b"x" * 100)
    # and of a job of 100,000 ranks or more (six-digit ranks in the names the writers give)
    (torn / (file_name(100_000, 0) + ".tmp")).write_bytes(b"x" * 100)
    (torn / file_name(123_456, 0)).write_bytes(b"x" * 100)
    mixed = tmp_path / "step9"
    mixed.mkdir()
    (mixed / "rank00000-g0.safetensors").write_bytes(b"x")
    (mixed / "notes.txt").write_text("mine")
    damaged = tmp_path / "step6"
    shutil.copytree(tmp_path / "step7", damaged)
    (damaged / "manifest.json").write_text("{")
    _, state = golden_state()
    save(SoloComm(), str(tmp_path), "step10", lambda: state)
    assert not torn.exists()
    assert os.listdir(mixed) == ["notes.txt"]
    assert sorted(os.listdir(damaged)) == ["manifest.json", "rank00000-g0.safetensors"]
    assert (tmp_path / "step7" / "manifest.json").exists()


def test_the_writer_and_generation_of_every_rank_s_shard_file_are_read_from_its_name():
    """What recovery (the copy a node's own ranks wrote) and a format 5 file table (the files its
    writers wrote) read from a shard file's name is what the writer put there, at any rank."""
    for rank in (0, 7, 99_999, 100_000, 123_456, 1_048_575):
        for generation in (0, 12):
            assert shard_file_of(file_name(rank, generation)) == (rank, generation)
            assert writer_of(file_name(rank, generation)) == rank
    for other in ("manifest.json", "manifest-g0-rank-00000.json", "rank0001-g0.safetensors",
                  "rank00001-g0.safetensors.tmp", "x/rank00001-g0.safetensors", None):
        assert shard_file_of(other) is None and writer_of(other) is None


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_direct_writer_writes_the_bytes_of_the_buffered_writer(tmp_path, where):
    """Delta files go to the device with O_DIRECT from a 16 MiB aligned buffer: a file larger
    than the buffer, odd tensor sizes (the last block padded, then cut), an empty tensor and
    several dtypes give exactly the bytes of write_safetensors (with the data aligned as the
    direct writer aligns it: on a 4 KiB block from 1 MiB of tensors on), on a disk filesystem and
    on /dev/shm (tmpfs: O_DIRECT is refused or taken, depending on the kernel; the writer keeps
    working either way), with fsync on and off, and the buffer is reused."""
    from adacheck.format.writer import data_alignment, write_safetensors
    from adacheck.storage.direct import DirectFileWriter
    d = tmp_path if where == "tmp" else "/dev/shm"
    if not os.path.isdir(d):
        pytest.skip("no /dev/shm")
    g = torch.Generator().manual_seed(0)
    sets = [{"a": torch.randn(5_000_001, generator=g), "b": torch.randn(7, 3, generator=g).bfloat16(),
             "c": torch.arange(5, dtype=torch.int64), "e": torch.empty(0)},
            {"x": torch.randn(3, generator=g)},
            {"big": torch.randn(9 << 20, generator=g)}]       # 36 MiB: three buffer loads
    w = DirectFileWriter()
    paths = []
    try:
        for i, tensors in enumerate(sets):
            for fsync in (True, False):
                ref, got = os.path.join(d, f"ref{i}{fsync}"), os.path.join(d, f"dir{i}{fsync}")
                paths += [ref, got]
                n = write_safetensors(ref, tensors, {"format": "x"}, fsync=fsync,
                                      data_align=data_alignment(tensors))
                assert w.write(got, tensors, {"format": "x"}, fsync=fsync) == n == os.path.getsize(got)
                with open(ref, "rb") as a, open(got, "rb") as b:
                    assert a.read() == b.read(), (i, fsync, w.direct)
                back = load_file(got)
                assert all(torch.equal(back[k], t) for k, t in tensors.items())
        if _fs_type(d) in ("ext4", "xfs", "btrfs"):
            assert w.direct      # (these take O_DIRECT)
        w.direct = False         # the buffered path it falls back to writes the same bytes too
        w.write(paths[1], sets[0], {"format": "x"})
        with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
            assert a.read() == b.read()
    finally:
        for p in paths:
            if os.path.exists(p):
                os.remove(p)


def test_staged_gradients_go_to_the_device_from_their_own_memory(tmp_path):
    """The delta log lays each staging slot out as the file will be (sorted keys, back to back, one
    block-aligned allocation) after a step is written, so the next step's inexact fp32 gradients
    are written straight from it: only the header, the run's last partial block and the small
    extra tensor pass through the writer's buffer; the file is the buffered writer's bytes, with
    the data on a 4 KiB block, and reads back.  A change of shape lays the slot out again; element
    sizes that would misalign a view keep separate buffers."""
    from adacheck.format.writer import data_alignment, write_safetensors
    g = torch.Generator().manual_seed(1)
    lg = deltalog.DeltaLog(str(tmp_path), 0, "n", fsync=False, queue_depth=1)
    shapes = {"w1": (300, 1000), "b1": (1000,), "w0": (1000, 300), "s": ()}
    try:
        for step in (1, 2, 3, 4):
            if step == 3:
                shapes["b1"] = (999,)
            grads = {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}
            lg.begin(step)
            for k, v in grads.items():
                lg.add(k, v)
            copied = lg._file_writer.copied
            lg.submit(step, {"step": step}, {"rng": torch.arange(5)})
            lg.flush()
            copied = lg._file_writer.copied - copied
            path = os.path.join(deltas.step_dir(str(tmp_path), step), "rank0.safetensors")
            stored = {f"grad/{k}": v for k, v in grads.items()}
            stored["rng"] = torch.arange(5)
            ref = str(tmp_path / f"ref{step}")
            assert data_alignment(stored) == 4096
            write_safetensors(ref, stored, {"format": "adacheck-delta"}, fsync=False, data_align=4096)
            with open(path, "rb") as a, open(ref, "rb") as b:
                assert a.read() == b.read(), step
            back = load_file(path)
            assert all(torch.equal(back[k], v) for k, v in stored.items())
            if lg._file_writer.direct and step in (2, 4):   # staged into the block laid out before
                assert copied < 2 * 4096 + 64, (step, copied)
    finally:
        lg.close()
    slot = lg._free.get()
    assert [k for k, _, _ in slot.layout] == ["b1", "s", "w0", "w1"] and slot.layout[0][2] == (999,)
    start = slot.buffers["b1"].data_ptr()
    assert start % 4096 == 0 and slot.buffers["w1"].data_ptr() == start + 4 * (999 + 1 + 300_000)
    mixed = deltalog._Slot(buffers={"a": torch.zeros(1, dtype=torch.int8), "b": torch.zeros(3)}, keys=["a", "b"])
    before = dict(mixed.buffers)
    deltalog._arrange(mixed)                   # b would start at byte 1
    assert mixed.layout == () and all(mixed.buffers[k] is v for k, v in before.items())


def _fs_type(path) -> str:
    """The type of the filesystem ``path`` is on (the longest mount point above it)."""
    path, best = os.path.realpath(path), ("", "")
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, kind = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, kind)
    return best[1]


def test_typed_records_name_the_field_that_is_wrong():
    """An integration's objects (adacheck.format.records) as JSON trees written by hand: a field of the
    wrong kind is a FormatError naming it, a field with a default may be absent (an older
    writer), a key the record does not declare is ignored (a newer one)."""
    from dataclasses import dataclass
    from typing import Optional

    from adacheck.format.records import Record, entry, is_int, optional

    @dataclass
    class Saved(Record):
        iteration: int = entry(is_int, "an integer")
        scheduler: Optional[dict] = entry(optional(dict), "an object or null", default=None)

    assert Saved.of({"iteration": 3, "newer": 1}, "x") == Saved(3, None)
    assert json.loads(json.dumps(Saved(4, {"lr": 0.1}).tree())) == {"iteration": 4, "scheduler": {"lr": 0.1}}
    for tree, field in (({"iteration": True}, "iteration"), ({}, "iteration"),
                        ({"iteration": 1, "scheduler": [1]}, "scheduler")):
        with pytest.raises(FormatError, match=f"ckpt/x: {field} is .*expected"):
            Saved.of(tree, "ckpt/x")
    with pytest.raises(FormatError, match="expected an object"):
        Saved.of([1], "ckpt/x")
    # the record's checks, as the online replay checks every delta record before applying one
    expect = Saved.expect()
    assert expect["iteration"][0](2) and not expect["iteration"][0](None) and expect["scheduler"][0](None)


def test_same_bytes_on_views_of_any_alignment():
    """The cast proof compares bytes as wide integers where it can: views that start at an odd
    element (ZeRO-3 partitions of a flat buffer) compare the same as whole tensors."""
    from adacheck.format.hashing import same_bytes
    a = torch.randn(1001).bfloat16()
    flat = torch.empty(2003, dtype=torch.bfloat16)
    for start in (0, 1, 2, 3, 4):
        flat[start:start + 1001] = a
        view = flat[start:start + 1001]
        assert same_bytes(view, a) and same_bytes(a, view), start
        changed = a.clone()
        changed[start * 100] = changed[start * 100] + 1
        assert not same_bytes(view, changed), start
    nan = torch.tensor([float("nan"), -0.0, 0.0])
    assert same_bytes(nan, nan.clone()) and not same_bytes(nan, torch.tensor([float("nan"), 0.0, 0.0]))


@pytest.mark.parametrize("limit,threads", [(None, 2), (0, 2), (None, 1)])
def test_a_staged_read_hashes_behind_and_reads_again_verified_where_a_box_is_damaged(tmp_path, monkeypatch,
                                                                                      limit, threads):
    """Inside ``CheckpointReader.stage`` the hashes run on helper threads while reads go on: an
    intact checkpoint is staged once, every read (a cast through the reused scratch buffer too)
    the saved values; a damaged box is still an IntegrityError naming it, also where what the
    stager did with the damaged bytes failed first (then it stages again, verifying each read).
    ``limit`` 0: no box waits for its hash while the next is read (each is awaited at once).
    ``threads`` 1 (a rank with no core to spare): each box is verified as it is read, so the
    damaged one fails the first pass."""
    from adacheck.checkpoint.reader import HashesBehind
    from adacheck.errors import StateError
    from adacheck.format import hashing
    from adacheck.format.safetensors_file import SafetensorsFile
    monkeypatch.setattr(hashing, "THREADS", threads)
    if limit is not None:
        monkeypatch.setattr(HashesBehind, "LIMIT", limit)
    w = write_golden(str(tmp_path))
    ckpt = tmp_path / "step7"
    calls = []

    def stager(r):
        calls.append(1)
        got = r.read("master/w")
        as64 = r.read("master/w", dtype=torch.float64)          # (each box through the scratch buffer)
        if not torch.equal(got, w):
            raise StateError("the stager's own check of the values failed")
        return got, as64, r.read("model/w"), r.read("optim/step/w")

    got, as64, lp, step = CheckpointReader(str(ckpt)).stage(stager)
    assert calls == [1]
    assert torch.equal(got, w) and torch.equal(as64, w.double()) and torch.equal(lp, w.bfloat16())
    assert step.item() == 7.0
    if threads > 1:
        assert any(t.name.startswith("adacheck-hash") for t in threading.enumerate())

    sb = CheckpointReader(str(ckpt)).entry("master/w").boxes[0]
    f = SafetensorsFile(str(ckpt / sb.file))
    data = bytearray((ckpt / sb.file).read_bytes())
    data[f.data_start + f.entries[sb.key][2]] ^= 0x01            # one bit of a stored box of master/w
    (ckpt / sb.file).write_bytes(bytes(data))
    calls.clear()
    with pytest.raises(IntegrityError, match=r"master/w \(box .*rank00000-g0\.safetensors.*hash"):
        CheckpointReader(str(ckpt)).stage(stager)
    # (behind: the StateError of the first pass, from damaged bytes, is not the answer)
    assert calls == ([1, 1] if threads > 1 else [1])


@pytest.mark.parametrize("threads", [2, 1])
def test_pieces_are_verified_views_of_the_mapped_files_that_copy_into_any_tensor(tmp_path, monkeypatch, threads):
    """``CheckpointReader.pieces``: a flat range (of the whole tensor or of a box of it, cast or
    not) as verified views of the shard file's own pages, copied once into the tensor that keeps
    them: the values read_flat reads and the tensor saved, zero where no piece lands.  A flipped
    bit is an IntegrityError naming the box (hashed as it is read, or behind inside stage())."""
    from adacheck.checkpoint import Pieces
    from adacheck.format import hashing
    from adacheck.format.safetensors_file import SafetensorsFile
    monkeypatch.setattr(hashing, "THREADS", threads)
    w = torch.randn(64, 33)
    save(SoloComm(), str(tmp_path), "s1", lambda: LocalState(
        [LocalShard("master/w", "master", (64, 33), Box((0, 0), (40, 33)), w[:40]),
         LocalShard("master/w", "master", (64, 33), Box((40, 0), (24, 33)), w[40:])]))
    ckpt = tmp_path / "s1"
    r = CheckpointReader(str(ckpt))
    flat, part = w.reshape(-1), w[10:50, 3:23].reshape(-1)
    for a, b in [(0, 64 * 33), (5, 40), (38 * 33 + 7, 42 * 33 + 2)]:
        got = r.stage(lambda r: r.pieces("master/w", a, b))
        assert torch.equal(got.tensor(), flat[a:b]) and torch.equal(got.tensor(), r.read_flat("master/w", a, b))
        assert torch.equal(r.pieces("master/w", a, b, dtype=torch.float64).tensor(), flat[a:b].double())
    within = Box((10, 3), (40, 20))
    got = r.pieces("master/w", 25, 700, within=within)
    assert torch.equal(got.tensor(), part[25:700])
    assert torch.equal(got.tensor(), r.read_flat("master/w", 25, 700, within=within))
    out = torch.full((675, 2), 7.0)
    got.copy_into(out[:, 1])        # (a strided destination)
    assert torch.equal(out[:, 1], part[25:700]) and bool((out[:, 0] == 7.0).all())
    padded = Pieces(800, torch.float32, (8, 100))
    padded.place(50, got)
    t = padded.tensor()
    assert t.shape == (8, 100) and torch.equal(t.reshape(-1)[50:725], part[25:700])
    assert not t.reshape(-1)[:50].any() and not t.reshape(-1)[725:].any()
    # the sources are the file's own pages: bytes written over it in place show through
    sb = r.entry("master/w").boxes[0]
    f = SafetensorsFile(str(ckpt / sb.file))
    at = f.data_start + f.entries[sb.key][2]
    with open(ckpt / sb.file, "r+b") as fh:
        fh.seek(at)
        fh.write(torch.tensor([123.0]).numpy().tobytes())
    assert got.tensor()[0] != 123.0 and r.pieces("master/w", 0, 1).tensor()[0] == 123.0    # (the view, kept)
    with pytest.raises(IntegrityError, match=r"master/w \(box .*rank00000-g0\.safetensors.*hash"):
        CheckpointReader(str(ckpt)).stage(lambda r: r.pieces("master/w", 0, 64 * 33))


def test_a_rank_hashes_on_the_cores_it_does_not_share():
    """Hashing threads per rank: its CPU affinity's cores, divided among the node's ranks (the
    launcher's count) unless it is bound to cores of its own, at most 4; one core each: none."""
    import subprocess
    import sys
    code = ("import os, sys; from adacheck.format.hashing import hash_threads\n"
            "if len(sys.argv) > 1: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "print(hash_threads())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cores = len(os.sched_getaffinity(0))
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE",
                                                              "OMPI_COMM_WORLD_LOCAL_SIZE")}

    def threads(env, *bind):
        p = subprocess.run([sys.executable, "-c", code, *bind], env=dict(base, **env), cwd=root,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        return int(p.stdout)

    whole = cores >= (os.cpu_count() or 1)
    assert threads({}) == max(1, min(4, cores))
    assert threads({"LOCAL_WORLD_SIZE": str(cores)}) == (1 if whole else min(4, cores))
    assert threads({"LOCAL_SIZE": "2"}) == (max(1, min(4, cores // 2)) if whole else min(4, cores))
    assert threads({"LOCAL_WORLD_SIZE": "x"}) == max(1, min(4, cores))     # (unreadable: not counted)
    assert threads({}, "bind") == 1                                          # one core of its own


def test_a_save_and_a_staged_load_at_interpreter_exit_hash_without_the_threads(tmp_path):
    """A save committed by an exit hook (an async save at the end of a user's script) runs when the
    interpreter no longer starts work on threads: its hashes, and a staged load's, run in the
    calling thread; the checkpoint is committed and holds the tensors saved."""
    import subprocess
    import sys
    script = f"""
import atexit, torch
from adacheck.checkpoint import CheckpointReader, save
from adacheck.format import hashing
from adacheck.integration import LocalShard, LocalState
from adacheck.plan.exchange import SoloComm
from adacheck.types import Box
hashing.THREADS = 2          # (the threaded path, also on a machine of one core)
w = torch.arange(12.0).reshape(3, 4)

def at_exit():
    save(SoloComm(), {str(tmp_path)!r}, "s1", lambda: LocalState(
        [LocalShard("master/w", "master", (3, 4), Box.full((3, 4)), w)]))
    got = CheckpointReader({str(tmp_path / "s1")!r}).stage(lambda r: r.read("master/w"))
    print("equal" if torch.equal(got, w) else "differs")
atexit.register(at_exit)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0 and p.stdout.strip() == "equal", p.stderr[-3000:]
    assert torch.equal(load_file(str(tmp_path / "s1" / "rank00000-g0.safetensors"))["master/w@0+3_0+4"],
                       torch.arange(12.0).reshape(3, 4))


def test_a_load_unmaps_the_checkpoint_files_when_it_returns_without_the_garbage_collector(tmp_path):
    """A load's reader maps the shard files and stages views of them; when the load returns,
    nothing of it may keep them mapped until Python's cycle collector runs (paused in loads): a
    mapped file cannot leave the page cache, nor its disk space once a later save deletes it.
    Oracle: the kernel's list of this process's mappings."""
    w = torch.randn(4096)
    shards = [LocalShard("master/w", "master", (4096,), b, w[b.slices()]) for b in flat_range_to_boxes((4096,), 0, 4096)]
    vec = torch.arange(6.0)
    save(SoloComm(), str(tmp_path), "t", lambda: LocalState(shards, {"vec": vec}, {}, {}, {}, 1))

    def mapped():
        return [line for line in open("/proc/self/maps") if str(tmp_path) in line]
    out = torch.empty(4096)
    import gc
    was = gc.isenabled()
    gc.disable()
    try:
        # (the result kept, as an integration keeps the objects it loaded: Checkpointer.last_loaded)
        loaded = load(SoloComm(), str(tmp_path), "t", lambda r: (r.pieces("master/w", 0, 4096), r.objects()),
                      lambda staged: (staged[0].copy_into(out), staged[1])[1])
        for _ in range(200):     # (a hashing thread lets go of its last box a moment after its result)
            if not mapped():
                break
            time.sleep(0.01)
        assert mapped() == [], mapped()
    finally:
        if was:
            gc.enable()
    assert torch.equal(out, w) and torch.equal(loaded.result["vec"], vec)
