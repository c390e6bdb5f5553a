"""Fuzzing the readers of the manifest and of safetensors shard files with random mutations of a
real checkpoint: every outcome is a clean load of exactly the saved data, or an AdaCheckError;
never another exception, never other data.

Mutations: bytes flipped, inserted, deleted, repeated or cut off anywhere in a shard file or in
the manifest; and JSON-level edits of the manifest (a value changed, swapped with another of the
same place, removed, retyped, a list entry repeated), half of them with the checksum made to
match again, as a tool that writes manifests would (so the field checks behind it are reached).
Such a re-signed manifest may say other things (a scalar of the saved objects, fewer tensors):
that is what its writer signed.  What it can never do is hand out bytes under another identity:
every tensor a reader returns from it is exactly the one saved under that name.
"""
import pytest
import copy
import json
import os
import random
import shutil
import warnings

import torch

from adacheck.format.boxes import flat_range_to_boxes
from adacheck.checkpoint import CheckpointReader, save
from adacheck.integration import LocalShard, LocalState
from adacheck.errors import AdaCheckError
from adacheck.plan.exchange import SoloComm
from adacheck.format.manifest import checksum
from adacheck.types import Box

pytestmark = pytest.mark.unit

CASES = 2500


def make_checkpoint(d):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 4, generator=g)
    shards = [LocalShard("master/w", "master", (6, 4), b, w[b.slices()]) for b in flat_range_to_boxes((6, 4), 0, 24)]
    shards.append(LocalShard("model/w", "model", (6, 4), Box.full((6, 4)), w.bfloat16(), derive="master/w",
                             derive_ok=True))
    shards.append(LocalShard("optim/exp_avg/w", "optim", (6, 4), Box.full((6, 4)), torch.randn(6, 4, generator=g)))
    shards.append(LocalShard("optim/exp_avg_sq/w", "optim", (6, 4), Box.full((6, 4)),
                             torch.rand(6, 4, generator=g)))
    shards.append(LocalShard("optim/step/w", "optim", (), Box.full(()), torch.tensor(3.0)))
    state = LocalState(shards, objects={"lr": 0.1, "betas": (0.9, 0.99), "t": torch.arange(3), "inf": float("inf")},
                       rank_objects={"seed": 1, "rng": torch.arange(5, dtype=torch.uint8)}, step=3)
    save(SoloComm(), d, "s", lambda: state, chunk_bytes=32)
    return os.path.join(d, "s")


def read_everything(ckpt):
    r = CheckpointReader(ckpt)
    out = {n: r.read(n) for n in r.manifest.tensors}
    out["rows"] = r.read("master/w", Box((1, 0), (3, 4)))          # a box across stored chunks
    out["flat"] = r.read_flat("optim/exp_avg/w", 5, 17)
    return out, r.objects(), [r.objects(i) for i in range(len(r.manifest.rank_objects))]


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def mutate_bytes(rng, data: bytes):
    data = bytearray(data)
    how = rng.choice(["flip", "flip", "set", "insert", "delete", "repeat", "cut"])
    at = rng.randrange(max(len(data), 1))
    if how == "flip":
        data[at] ^= 1 << rng.randrange(8)
    elif how == "set":
        data[at] = rng.choice(b'0123456789 {}[]":,.-e\x00\xff')
    elif how == "insert":
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5)))
    elif how == "delete":
        del data[at:at + rng.randrange(1, 9)]
    elif how == "repeat":
        data[at:at] = data[at:at + rng.randrange(1, 17)]
    else:
        del data[at:]
    return bytes(data), f"{how} at byte {at}"


def _places(tree, path=()):
    """Every (container path, key) of the JSON tree."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        yield path, k
        yield from _places(v, path + (k,))


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def mutate_json(rng, d: dict):
    d = copy.deepcopy(d)
    places = [p for p in _places(d) if p[1] != "checksum"]
    path, key = rng.choice(places)
    parent = _at(d, path)
    value = parent[key]
    how = rng.choice(["number", "swap", "remove", "retype", "repeat"])
    if how == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        parent[key] = value + rng.choice([-1, 1, 2, -value - 1, 10 ** 12])
    elif how == "swap" and isinstance(parent, (dict, list)) and len(parent) > 1:
        other = rng.choice([k for k in (parent if isinstance(parent, dict) else range(len(parent))) if k != key])
        parent[key], parent[other] = parent[other], parent[key]
    elif how == "remove":
        del parent[key]
    elif how == "repeat" and isinstance(value, list) and value:
        value.append(copy.deepcopy(rng.choice(value)))
    else:
        how = "retype"
        parent[key] = rng.choice([None, True, -1, 0.5, "x", "../x.safetensors", [], {}, [0], {"__tensor__": "t"}])
    return d, f"{how} {'/'.join(map(str, path + (key,)))}"


def test_random_mutations_load_the_same_data_or_raise_adacheck_errors(tmp_path):
    pristine = make_checkpoint(str(tmp_path / "src"))
    want = read_everything(pristine)
    files = sorted(os.listdir(pristine))
    originals = {f: open(os.path.join(pristine, f), "rb").read() for f in files}
    manifest = json.loads(originals["manifest.json"])
    rng = random.Random(20261125)
    case = str(tmp_path / "case")
    shutil.copytree(pristine, case)
    outcomes = {"same data": 0, "AdaCheckError": 0}
    wrong = []
    for i in range(CASES):
        target = rng.choice(files)
        signed = False
        if target == "manifest.json" and rng.random() < 0.6:
            d, what = mutate_json(rng, manifest)
            if rng.random() < 0.5:
                d["checksum"] = checksum(d)
                what += " (checksum made to match)"
                signed = True
            text = json.dumps(d, indent=rng.choice([None, 1]))
            mutated = text.encode()
        else:
            mutated, what = mutate_bytes(rng, originals[target])
        with open(os.path.join(case, target), "wb") as f:
            f.write(mutated)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = read_everything(case)
        except AdaCheckError:
            outcomes["AdaCheckError"] += 1
        except Exception as e:  # noqa: BLE001 - what the test is looking for
            wrong.append(f"case {i} ({target}, {what}): {type(e).__name__}: {e}")
        else:
            if same(got, want):
                outcomes["same data"] += 1
            elif signed and all(n in want[0] and same(t, want[0][n]) for n, t in got[0].items()):
                outcomes["re-signed: other objects, the same tensors"] = outcomes.get(
                    "re-signed: other objects, the same tensors", 0) + 1
            else:
                wrong.append(f"case {i} ({target}, {what}): loaded data that differs from what was saved")
        with open(os.path.join(case, target), "wb") as f:
            f.write(originals[target])
    assert not wrong, "\n".join(wrong[:20])
    assert outcomes["AdaCheckError"] > CASES // 2 and outcomes["same data"] > 0, outcomes
