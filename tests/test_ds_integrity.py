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

from adacheck.format.manifest import checksum

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


def online(ck, **kw):
    return {"enabled": True, "save_dir": ck, "online": dict({"enabled": True, "base_interval": 100}, **kw)}


def hostile_delta_logs(src, root):
    """name -> (copy of the save directory ``src`` with one damage in its delta log of base 1,
    steps 2-5; the substring the error names; the step the engine holds after the failed load)."""
    def copy(name):
        d = os.path.join(root, name)
        shutil.copytree(src, d)
        return d, os.path.join(d, "global_step1", "deltas")

    def edit_record(path, fn):
        rec = json.load(open(path))
        fn(rec)
        json.dump(rec, open(path, "w"))

    out = {}
    d, log = copy("shape")
    edit_record(f"{log}/0000000003/rank0.json",
                lambda r: next(iter(r["tensors"].values()))["shape"].__setitem__(0, 7))
    out["shape"] = (d, "has shape [7]", 1)
    d, log = copy("dtype")
    edit_record(f"{log}/0000000003/rank1.json", lambda r: next(iter(r["tensors"].values())).update(stored="float16"))
    out["dtype"] = (d, "stored 'float16' is not", 1)
    d, log = copy("stored_as")       # a valid record, but its file holds the gradient in another dtype
    edit_record(f"{log}/0000000004/rank0.json", lambda r: next(iter(r["tensors"].values())).update(stored="float32"))
    out["stored_as"] = (d, "its record says float32", 1)
    d, log = copy("order")
    os.rename(f"{log}/0000000003", f"{log}/tmp")
    os.rename(f"{log}/0000000004", f"{log}/0000000003")
    os.rename(f"{log}/tmp", f"{log}/0000000004")
    out["order"] = (d, "the record says step 4 of rank 0, but it lies where step 3", 1)
    d, log = copy("duplicate")
    shutil.rmtree(f"{log}/0000000003")
    shutil.copytree(f"{log}/0000000002", f"{log}/0000000003")
    out["duplicate"] = (d, "the record says step 2 of rank 0, but it lies where step 3", 1)
    d, log = copy("truncated")
    f = f"{log}/0000000004/rank1.safetensors"
    open(f, "r+b").truncate(os.path.getsize(f) - 64)
    out["truncated"] = (d, "truncated", 1)
    d, log = copy("hyper")
    edit_record(f"{log}/0000000003/rank0.json",
                lambda r: r["record"]["calls"][0][1][0][1].update(lr="0.01"))
    out["hyper"] = (d, "hyper-parameter 'lr'", 1)
    d, log = copy("bitflip")      # data damage: found while replaying step 4, after steps 2 and 3
    f = f"{log}/0000000004/rank0.safetensors"
    data, n, header = shard_header(f)
    key = next(k for k in sorted(header) if k.startswith("grad/"))
    data[8 + n + header[key]["data_offsets"][0]] ^= 0x01
    open(f, "wb").write(bytes(data))
    out["bitflip"] = (d, "does not match its recorded hash", 3)
    return out


def test_hostile_delta_records_fail_cleanly_on_every_rank(tmp_path):
    """ZeRO-2 bf16 DP=2 with online deltas (base at step 1, deltas 2-5); eight copies of the log,
    each damaged in one way: a gradient's shape or dtype in its record, a record that does not
    match its file, steps out of order, a step duplicated, a truncated delta file, a hyper-
    parameter of the wrong type, a bit flip in gradient data.  Each load fails with an error
    naming the damage, equal on both ranks; everything checkable without the gradient data is
    checked before any step is applied, so the engine holds exactly the base (step 1) after the
    first seven, and after the bit flip (found while replaying step 4) exactly step 3, as the
    error says.  With on_corrupt "fallback" the same load recovers step 3 with a warning on every
    rank.  Oracle: the recording run's per-step dumps (DeepSpeed's own accessors)."""
    src = str(tmp_path / "ck")
    c = dict(stage=2, dtype="bf16")
    check(launch(2, {"runs": [dict(c, adacheck=online(src), actions=[["train_dump", 5, "A"]])]},
                 str(tmp_path / "rec")))
    variants = hostile_delta_logs(src, str(tmp_path / "copies"))
    names = sorted(variants)
    # (an online job loads from its own save_dir: one engine per copy)
    runs = [dict(c, seed=3, adacheck=online(variants[name][0]),
                 actions=[["expect_error", variants[name][1], "load", variants[name][0]], ["dump", f"after_{name}"]])
            for name in names]
    fallback = str(tmp_path / "fallback")
    shutil.copytree(variants["bitflip"][0], fallback)
    runs.append(dict(c, seed=4, adacheck=dict(online(fallback), on_corrupt="fallback"),
                     actions=[["load", fallback], ["steps"], ["dump", "fallback"], ["train", 1]]))
    d = str(tmp_path / "load")
    check(launch(2, {"runs": runs}, d))
    r0, r1 = results(d, 0), results(d, 1)
    for i, name in enumerate(names):
        (err,), held = r0[i]["errors"], variants[name][2]
        assert r1[i]["errors"] == [err], name
        assert f"The job now holds the state of step {held}" in err, (name, err)
        assert_same(load_file(f"{tmp_path}/rec/A{held}.safetensors"), load_file(f"{d}/after_{name}.safetensors"))
    assert r0[-1]["steps"][0] == 3
    assert_same(load_file(f"{tmp_path}/rec/A3.safetensors"), load_file(f"{d}/fallback.safetensors"))
    for r in (r0, r1):
        assert any("is damaged; recovered step 3 instead of the newest" in w for w in r[-1]["warnings"]), r[-1]["warnings"]
