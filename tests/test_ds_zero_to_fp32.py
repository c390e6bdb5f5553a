"""DeepSpeed's fp32 export on AdaCheck checkpoints, judged by DeepSpeed's own export of a native
checkpoint of the same state (the same engine saves both, one after the other).

With ``import adacheck_ds``, DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``,
``convert_zero_checkpoint_to_fp32_state_dict`` and ``load_state_dict_from_zero_checkpoint``
give on the AdaCheck directory what they give on the native one; the ``zero_to_fp32.py`` that
AdaCheck leaves in the directory writes the same files with deepspeed unimportable. Covered:
ZeRO-2 bf16 with a frozen layer and tied weights, ZeRO-3 bf16; 2 ranks."""
import os
import subprocess
import sys

import pytest
import torch

import adacheck_ds  # noqa: F401  (DeepSpeed's export functions read AdaCheck checkpoints from here on)
from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)
from ds_worker import Net
from launch import check, launch
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(900)
TIE = [["mid.1.weight", "mid.0.weight"]]
RUNS = {"z2": dict(stage=2, dtype="bf16", layers=3, frozen=["norm."], tie=TIE),
        "z3": dict(stage=3, dtype="bf16", layers=2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fp32"))
    check(launch(2, {"runs": [dict(run, adacheck={"enabled": True},
                                   actions=[["train", 2], ["save", f"{d}/{name}/ada"],
                                            ["save_native", f"{d}/{name}/native"]])
                              for name, run in RUNS.items()]}, d))
    return d


def read(path):
    path = str(path)
    return load_file(path) if path.endswith(".safetensors") else torch.load(path, weights_only=True)


def assert_same(ours, native):
    assert list(ours) == list(native) or set(ours) == set(native), (sorted(ours), sorted(native))
    for k, v in native.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k


@pytest.mark.parametrize("name", sorted(RUNS))
def test_deepspeed_fp32_export_reads_adacheck_checkpoints(saved, name, tmp_path):
    ada, native = f"{saved}/{name}/ada", f"{saved}/{name}/native"
    assert os.path.isfile(f"{ada}/global_step2/manifest.json")
    ours, theirs = get_fp32_state_dict_from_zero_checkpoint(ada), get_fp32_state_dict_from_zero_checkpoint(native)
    assert_same(ours, theirs)
    if name == "z2":        # (tied names are one tensor there too)
        assert ours["mid.1.weight"] is ours["mid.0.weight"]
        trimmed = get_fp32_state_dict_from_zero_checkpoint(ada, exclude_frozen_parameters=True)
        assert_same(trimmed, get_fp32_state_dict_from_zero_checkpoint(native, exclude_frozen_parameters=True))
        assert "norm.weight" not in trimmed
    # (DeepSpeed's own safetensors output refuses tied weights: torch.save files there)
    safe = name != "z2"
    for which, src in (("ours", ada), ("theirs", native)):
        convert_zero_checkpoint_to_fp32_state_dict(src, str(tmp_path / which), safe_serialization=safe)
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "theirs"))
    for f in os.listdir(tmp_path / "theirs"):
        assert_same(read(tmp_path / "ours" / f), read(tmp_path / "theirs" / f))
    run = RUNS[name]
    models = []
    for src in (ada, native):
        torch.manual_seed(5)
        model = Net(37, run["layers"])
        for alias, source in run.get("tie", ()):
            *path, leaf = alias.split(".")
            setattr(model.get_submodule(".".join(path)), leaf, dict(model.named_parameters())[source])
        models.append(load_state_dict_from_zero_checkpoint(model, src))
    assert_same(models[0].state_dict(), models[1].state_dict())

    # the script in the directory, with deepspeed unimportable, writes what DeepSpeed's writes
    script = f"{ada}/zero_to_fp32.py"
    assert os.path.isfile(script)
    run_it = ("import runpy, sys; sys.modules['deepspeed'] = None; sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", run_it, script, ada, str(tmp_path / "script")]
                         + (["--safe_serialization"] if safe else []),
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "script")) == sorted(os.listdir(tmp_path / "theirs"))
    for f in os.listdir(tmp_path / "theirs"):
        assert_same(read(tmp_path / "script" / f), read(tmp_path / "theirs" / f))
