"""Real DeepSpeed engines (CPU, gloo, 2 processes) against damaged checkpoints and bad input:
every error is clear, the same on every rank, and leaves the engine exactly as it was; a damaged
latest checkpoint names the newest intact one and how to load it, or (on_corrupt "fallback")
loads it.  Oracle: DeepSpeed's own accessors (safe_get_full_*) dumped by the saving run."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from launch import check, launch

from adacheck.manifest import checksum

pytestmark = pytest.mark.timeout(900)


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def assert_same(a, b, keys=None):
    keys = sorted(a) if keys is None else keys
    assert set(keys) <= set(b), sorted(set(keys) - set(b))
    for k in keys:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def edit_manifest(ckpt_dir, fn, rechecksum=True):
    p = os.path.join(ckpt_dir, "manifest.json")
    d = json.load(open(p))
    fn(d)
    if rechecksum:     # as a tool that writes manifests would: the checksum matches again
        d["checksum"] = checksum(d)
    json.dump(d, open(p, "w"))


def shard_header(path):
    data = bytearray(open(path, "rb").read())
    n = int.from_bytes(data[:8], "little")
    return data, n, json.loads(data[8:8 + n])


def rewrite_header(path, fn):
    """Change the safetensors header of ``path`` in place, keeping its length (space padding)."""
    data, n, header = shard_header(path)
    fn(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    data[8:8 + n] = raw + b" " * (n - len(raw))
    open(path, "wb").write(bytes(data))


def damaged_copies(src, root):
    """name -> (checkpoint directory, load kwargs, substring the error must contain).  The
    newest checkpoint of each copy (global_step2) is damaged in one way; global_step1 is intact."""
    def copy(name):
        d = os.path.join(root, name)
        shutil.copytree(src, d)
        return d, os.path.join(d, "global_step2")

    out = {}
    d, t = copy("bitflip")
    shard = os.path.join(t, sorted(f for f in os.listdir(t) if f.endswith(".safetensors"))[0])
    data, n, header = shard_header(shard)
    data[8 + n + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__") // 2] ^= 0x40
    open(shard, "wb").write(bytes(data))
    out["bitflip"] = (d, {}, "hash")

    def swap_offsets(m):
        a, b = next((a, b) for k, v in sorted(m["tensors"].items()) if k.startswith("master/")
                    for i, a in enumerate(v.get("boxes", [])) for b in v["boxes"][i + 1:]
                    if a["lengths"] == b["lengths"] and a["offsets"] != b["offsets"] and a["hash"] != b["hash"])
        a["offsets"], b["offsets"] = b["offsets"], a["offsets"]
    d, t = copy("offsets")
    edit_manifest(t, swap_offsets)
    out["offsets"] = (d, {}, "or the manifest was edited")

    def swap_names(m):
        tensors = m["tensors"]
        x, y = "optim/exp_avg/inp.weight", "optim/exp_avg_sq/inp.weight"
        tensors[x], tensors[y] = tensors[y], tensors[x]
    d, t = copy("names")
    edit_manifest(t, swap_names)
    out["names"] = (d, {}, "exp_avg")

    d, t = copy("handedit")
    edit_manifest(t, lambda m: m.update(step=99), rechecksum=False)
    out["handedit"] = (d, {}, "does not match its checksum")

    d, t = copy("truncated")
    shard = os.path.join(t, sorted(f for f in os.listdir(t) if f.endswith(".safetensors"))[0])
    open(shard, "r+b").truncate(os.path.getsize(shard) - 100)
    out["truncated"] = (d, {}, "truncated")

    d, t = copy("header_json")
    shard = os.path.join(t, sorted(f for f in os.listdir(t) if f.endswith(".safetensors"))[0])
    data, n, _ = shard_header(shard)
    data[8:8 + n] = b"{\"not\": json" + b" " * (n - 12)
    open(shard, "wb").write(bytes(data))
    out["header_json"] = (d, {}, "header is not valid JSON")

    d, t = copy("header_len")
    shard = os.path.join(t, sorted(f for f in os.listdir(t) if f.endswith(".safetensors"))[0])
    data = bytearray(open(shard, "rb").read())
    data[:8] = (len(data) + 1).to_bytes(8, "little")
    open(shard, "wb").write(bytes(data))
    out["header_len"] = (d, {}, "header claims")

    def overlap(header):
        sizes = {}
        for k, v in sorted(header.items()):
            if k != "__metadata__":
                sizes.setdefault(v["data_offsets"][1] - v["data_offsets"][0], []).append(k)
        a, b = next(keys for keys in sizes.values() if len(keys) >= 2)[:2]
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
    d, t = copy("overlap")
    rewrite_header(os.path.join(t, sorted(f for f in os.listdir(t) if f.endswith(".safetensors"))[0]), overlap)
    out["overlap"] = (d, {}, "overlapping or gapped")

    for name, text in (("latest_empty", b""), ("latest_garbage", b"\x00\xffgarbage\n"),
                       ("latest_escape", b"../../etc\n")):
        d, _ = copy(name)
        open(os.path.join(d, "latest"), "wb").write(text)
        out[name] = (d, {}, "latest is damaged")

    d, _ = copy("missing_tag")
    out["missing_tag"] = (d, {"tag": "global_step9"}, "there is no checkpoint 'global_step9'")
    return out


def test_damaged_checkpoints_and_bad_input_fail_cleanly_on_every_rank(tmp_path):
    """Each damage gives an error naming it, identical on both ranks, with nothing applied (the
    engine's state, dumped with DeepSpeed's own accessors, is unchanged, and training goes on).
    The damaged latest ones name global_step1 (or, for a damaged 'latest' file, global_step2) as
    the newest intact checkpoint with the engine.load_checkpoint call that loads it; a missing tag
    lists what is there.  With on_corrupt "fallback" that checkpoint is loaded, with a warning
    on every rank, and equals the saving run's state.  A model of another shape is refused."""
    src = str(tmp_path / "src")
    c = dict(stage=1, dtype="fp32", hidden=48)
    block = {"enabled": True, "hash_chunk_bytes": 256}     # tensors stored as several row chunks
    check(launch(2, {"runs": [dict(c, adacheck=block, actions=[
        ["train", 1], ["save", src], ["dump", "S1"], ["train", 1], ["save", src], ["dump", "S2"]])]},
        str(tmp_path / "save")))
    variants = damaged_copies(src, str(tmp_path / "copies"))
    names = sorted(variants)
    # a job that follows the advice (loads global_step1 by its tag) and saves: 'latest' still
    # names the damaged global_step2, whose boxes hash like the new ones, and must not be used
    explicit = str(tmp_path / "explicit")
    shutil.copytree(variants["bitflip"][0], explicit)
    actions = [["dump", "before"]]
    for name in names:
        d, kw, expect = variants[name]
        actions.append(["expect_error", expect, "load", d, kw])
    actions += [["dump", "after"], ["train", 1]]
    fallback = dict(block, on_corrupt="fallback")
    runs = [dict(c, seed=7, adacheck=block, actions=actions),
            # fallback; then a save under another tag while 'latest' still names the damaged
            # checkpoint: its boxes equal the new bytes' hashes, but must not be referenced
            dict(c, seed=8, adacheck=fallback, actions=[["load", variants["bitflip"][0]], ["dump", "fb_bitflip"],
                                                        ["train", 1], ["save", variants["bitflip"][0], "after"],
                                                        ["load", variants["latest_garbage"][0]], ["dump", "fb_latest"]]),
            dict(c, seed=10, adacheck=block, actions=[["load", variants["bitflip"][0], {"tag": "after"}],
                                                      ["dump", "after_load"]]),
            dict(c, seed=11, adacheck=block, actions=[["load", explicit, {"tag": "global_step1"}], ["train", 1],
                                                      ["save", explicit, "resumed"]]),
            dict(c, seed=12, adacheck=block, actions=[["load", explicit], ["dump", "resumed"]]),
            dict(c, seed=9, hidden=40, adacheck=block,
                 actions=[["expect_error", "shape", "load", src]])]
    # (the mismatched model runs last: r[-1])
    d = str(tmp_path / "load")
    check(launch(2, {"runs": runs}, d))
    r0, r1 = results(d, 0), results(d, 1)
    assert r0[0]["errors"] == r1[0]["errors"] and len(r0[0]["errors"]) == len(names)
    for name, err in zip(names, r0[0]["errors"]):
        if name == "missing_tag":
            assert err.startswith("DistributedNotFoundError") and "complete checkpoints present: ['global_step2', " \
                   "'global_step1']" in err, err
            continue
        want = "global_step2" if name.startswith("latest") else "global_step1"
        assert f"the newest intact checkpoint there is '{want}'" in err, (name, err)
        assert f"engine.load_checkpoint('{variants[name][0]}', tag='{want}')" in err, (name, err)
        kind = err.split(":")[0]
        assert kind == ("DistributedIntegrityError" if name in ("bitflip", "offsets", "names", "handedit")
                        else "DistributedFormatError"), (name, err)
    assert_same(load_file(f"{d}/before.safetensors"), load_file(f"{d}/after.safetensors"))
    s1, s2 = load_file(f"{tmp_path}/save/S1.safetensors"), load_file(f"{tmp_path}/save/S2.safetensors")
    assert_same(s1, load_file(f"{d}/fb_bitflip.safetensors"))
    assert_same(s2, load_file(f"{d}/fb_latest.safetensors"))
    for r in (r0, r1):
        warned = [w for w in r[1]["warnings"] if "is damaged" in w and "instead" in w]
        assert len(warned) == 2 and "loading global_step1" in warned[0] and "loading global_step2" in warned[1], warned
    # the saves after the fallback and after the explicit load referenced nothing of the damaged
    # checkpoint (only the one they loaded), and load as S2
    for where, tag, dump in ((variants["bitflip"][0], "after", "after_load"), (explicit, "resumed", "resumed")):
        new = json.load(open(os.path.join(where, tag, "manifest.json")))
        refs = {b["file"].split("/")[0] for e in new["tensors"].values() for b in e.get("boxes", []) if "/" in b["file"]}
        assert new["step"] == 2 and refs <= {"global_step1"}, refs
        assert_same(s2, load_file(f"{d}/{dump}.safetensors"))
    assert r0[-1]["errors"] == r1[-1]["errors"] and "StateError" in r0[-1]["errors"][0]
