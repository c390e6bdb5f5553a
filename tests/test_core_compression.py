"""Opt-in zstd compression of stored boxes: the same manifest (hashes of the uncompressed bytes,
so the same references) as an uncompressed save, smaller files of U8 byte planes that
safetensors itself reads, exact values back, and damage in a compressed box is an error."""
import json

import pytest
import torch
from safetensors import safe_open

from adacheck.storage import manifest_files
from adacheck.checkpoint import CheckpointReader, Checkpointer, Options, verify_part
from adacheck.integration import LocalShard, LocalState, Restore
from adacheck.format.compression import ENCODING_KEY, ZSTD_PLANES, planes, unplanes
from adacheck.errors import ConfigError, IntegrityError
from adacheck.plan.exchange import SoloComm
from adacheck.types import Box

pytestmark = pytest.mark.unit

zstandard = pytest.importorskip("zstandard")


def state(step):
    g = torch.Generator().manual_seed(step)
    master = torch.randn(256, 64, generator=g)
    moment = (torch.randn(256, 64, generator=g) * 1e-3) ** 2
    frozen = torch.arange(4096.0).view(64, 64)
    shards = [LocalShard("master/w", "master", (256, 64), Box.full((256, 64)), master),
              LocalShard("optim/exp_avg_sq/w", "optim", (256, 64), Box.full((256, 64)), moment),
              LocalShard("model/w", "model", (256, 64), Box.full((256, 64)), master.bfloat16(), derive="master/w",
                         derive_ok=True),
              LocalShard("model/frozen", "model", (64, 64), Box.full((64, 64)), frozen),
              LocalShard("buffer/steps", "buffer", (3,), Box.full((3,)), torch.tensor([1, 2, 3]))]
    return LocalState(shards, objects={"step": step}, rank_objects={"seed": step}, step=step), master, moment, frozen


def save(root, compression, steps=(1, 2)):
    job = Checkpointer(options=Options(compression=compression, chunk_bytes=1 << 14))
    out = {}
    for step in steps:
        st, master, moment, frozen = state(step)
        job.save(SoloComm(), root, f"s{step}", lambda st=st: st)
        out[step] = (master, moment, frozen)
    return out


def test_byte_planes_round_trip():
    for t in (torch.randn(7, 3), torch.randn(5).bfloat16(), torch.arange(9, dtype=torch.int64), torch.ones(4, dtype=torch.uint8)):
        p = planes(t.contiguous())
        assert p.dtype == torch.uint8 and p.numel() == t.numel() * t.element_size()
        assert torch.equal(unplanes(p, t.dtype, tuple(t.shape)).view(torch.uint8), t.view(torch.uint8))
    t = torch.tensor([1.0, 2.0], dtype=torch.float32)
    assert planes(t).tolist() == [0, 0, 0, 0, 128, 0, 63, 64]   # little-endian: low bytes first, exponents last


def test_compressed_checkpoint_has_the_same_manifest_and_values(tmp_path):
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "zstd")
    save(plain, None)
    values = save(packed, "zstd")
    mp, mz = manifest_files.read_manifest(f"{plain}/s2"), manifest_files.read_manifest(f"{packed}/s2")
    assert mp.format_version == 2 and mz.format_version == 3
    assert mp.tensors == mz.tensors          # the same boxes, hashes (uncompressed bytes) and references
    assert any("/" in b.file for b in mz.tensors["model/frozen"].boxes)   # referenced in s1, as without
    fname = next(iter(mz.files))
    with safe_open(f"{packed}/s2/{fname}", "pt") as f:     # a safetensors file safetensors reads
        assert f.metadata()[ENCODING_KEY] == ZSTD_PLANES
        assert all(f.get_slice(k).get_dtype() == "U8" for k in f.keys())
    size = {d: sum(i["nbytes"] for i in manifest_files.read_manifest(f"{d}/s1").files.values()) for d in (plain, packed)}
    assert size[packed] < size[plain]
    master, moment, frozen = values[2]
    r = CheckpointReader(f"{packed}/s2")
    assert torch.equal(r.read("master/w"), master) and torch.equal(r.read("optim/exp_avg_sq/w"), moment)
    assert torch.equal(r.read("model/w"), master.bfloat16()) and torch.equal(r.read("model/frozen"), frozen)
    assert torch.equal(r.read("buffer/steps"), torch.tensor([1, 2, 3]))
    assert verify_part(CheckpointReader(f"{packed}/s2")) > 0
    # an uncompressed job goes on from a compressed checkpoint (and references its boxes)
    job = Checkpointer()
    got = job.load(SoloComm(), packed, None, Restore.of(lambda r: r.read("master/w")))
    assert torch.equal(got.result, master)


def test_damage_in_a_compressed_box_is_found(tmp_path):
    root = str(tmp_path / "zstd")
    save(root, "zstd", steps=(1,))
    m = manifest_files.read_manifest(f"{root}/s1")
    path = f"{root}/s1/{next(iter(m.files))}"
    data = bytearray(open(path, "rb").read())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + (len(data) - header) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    with pytest.raises(IntegrityError):
        verify_part(CheckpointReader(f"{root}/s1"))


def test_unknown_compression_is_a_config_error():
    from adacheck.config import AdaCheckConfig
    with pytest.raises(ConfigError, match="compression"):
        AdaCheckConfig.from_dict({"compression": "lz4"})
    assert AdaCheckConfig.from_dict({"compression": "zstd"}).compression == "zstd"
    assert json.dumps(AdaCheckConfig.from_dict({}).compression) == "null"
