"""The Hugging Face Trainer with DeepSpeed and an ``adacheck`` block (tests/hf_worker.py: a tiny
GPT-2 from a config, 2 ranks, CPU, gloo), as a user runs it: the Trainer's own save and
``resume_from_checkpoint`` go through AdaCheck.  The oracle is the Trainer's own logged losses
of an uninterrupted run: a resumed run must log exactly the same ones.  Every run is checked to
be a real 2-rank job: the Trainer and Accelerate see the 2 ranks torch.distributed has (not one
process each), and the model trains in a DeepSpeedEngine with AdaCheck attached.

Accelerate without the Trainer (tests/accelerate_worker.py: ``PartialState(cpu=True)``, then
``Accelerator(deepspeed_plugin=...)``, a tiny MLP): ``save_state`` writes an AdaCheck checkpoint
and ``load_state`` resumes with each rank's losses of the uninterrupted run; and
``Accelerator(cpu=True, deepspeed_plugin=...)`` runs no DeepSpeed (so no AdaCheck) and says
nothing about it."""
import glob
import json
import os

import pytest

import torch
from transformers import GPT2LMHeadModel

from adacheck.cli import main as cli
from launch import check, launch

pytestmark = pytest.mark.timeout(900)


def losses(d, name="result.json"):
    return {int(k): v for k, v in json.load(open(os.path.join(d, name)))["losses"].items()}


def assert_two_ranks(d, name="result.json"):
    """The run in ``d`` was one job of 2 data-parallel ranks as every layer sees it: the Trainer's
    arguments and Accelerate's state agree with torch.distributed on the world size and on each
    rank's index, Accelerate runs DeepSpeed, and each rank trained a DeepSpeedEngine that AdaCheck
    is attached to."""
    ranks = json.load(open(os.path.join(d, name)))["ranks"]
    assert len(ranks) == 2, ranks
    for rank, f in enumerate(ranks):
        assert f["dist_world_size"] == 2 and f["dist_rank"] == rank, f
        assert (f["accelerate_num_processes"], f["accelerate_process_index"]) == (2, rank), f
        if "args_world_size" in f:                                  # (a Trainer's run)
            assert (f["args_world_size"], f["args_process_index"]) == (2, rank), f
        assert f["distributed_type"] == "DEEPSPEED", f
        assert f["deepspeed_engine"] and f["adacheck_attached"], f


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_saves_adacheck_checkpoints_and_resumes_exactly(tmp_path, stage):
    d = str(tmp_path)
    spec = {"stage": stage, "adacheck": {"enabled": True}, "output_dir": f"{d}/out", "max_steps": 6,
            "save_steps": 3}
    check(launch(2, spec, f"{d}/a", script="hf_worker.py"))
    assert_two_ranks(f"{d}/a")
    full = losses(f"{d}/a")
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    ckpt = f"{d}/out/checkpoint-3"
    # the Trainer's checkpoint holds an AdaCheck checkpoint where DeepSpeed's would be, and no native files
    assert os.path.isfile(f"{ckpt}/global_step3/manifest.json"), os.listdir(ckpt)
    assert not [f for f in os.listdir(f"{ckpt}/global_step3") if f.endswith(".pt")]
    # each save's numbers reach the Trainer's logs (the callback docs/deepspeed.md shows); the bytes
    # it wrote are the sizes of the files it left
    saves = json.load(open(f"{d}/a/result.json"))["saves"]
    assert sorted(saves) == ["3", "6"], saves
    on_disk = sum(os.path.getsize(f"{ckpt}/global_step3/{f}") for f in os.listdir(f"{ckpt}/global_step3")
                  if f.endswith(".safetensors"))
    assert saves["3"]["adacheck/stored_bytes"] == on_disk and saves["3"]["adacheck/step"] == 3, saves
    check(launch(2, dict(spec, resume=ckpt, output_dir=f"{d}/out2"), f"{d}/b", script="hf_worker.py"))
    assert_two_ranks(f"{d}/b")
    resumed = losses(f"{d}/b")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == full[s] for s in (4, 5, 6)), (full, resumed)
    if stage != 2:
        return
    # the weights as Hugging Face loads them, with no file copied by hand: `adacheck convert` of the
    # Trainer's checkpoint writes its config.json too; the oracle is the model the Trainer itself
    # saved into checkpoint-3 (model.safetensors, gathered from the ZeRO-2 engine)
    assert cli(["convert", ckpt, f"{d}/hf"]) == 0
    assert {"config.json", "model.safetensors"} <= set(os.listdir(f"{d}/hf")), os.listdir(f"{d}/hf")
    ours, trainers = (GPT2LMHeadModel.from_pretrained(p) for p in (f"{d}/hf", ckpt))
    assert ours.state_dict().keys() == trainers.state_dict().keys()
    for k, v in trainers.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    ids = torch.arange(12).reshape(2, 6)
    assert torch.equal(ours(ids).logits, trainers(ids).logits)
    # online deltas under the Trainer (they need adacheck.save_dir: the Trainer's checkpoint-N then
    # holds a pointer to it).  Killed after step 5, the job resumes from checkpoint-3 as the Trainer
    # asks: step 3 exactly, though deltas for steps 4 and 5 were committed (the Trainer replays those
    # batches itself), with the uninterrupted run's losses.
    online = {"enabled": True, "save_dir": f"{d}/ck", "online": {"enabled": True, "base_interval": 100}}
    spec = dict(spec, adacheck=online, output_dir=f"{d}/out3")
    out = launch(2, dict(spec, die_after=5), f"{d}/k", script="hf_worker.py")
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    committed = [int(n) for n in os.listdir(f"{d}/ck/global_step3/deltas") if n.isdigit()]
    assert max(committed) >= 4, committed
    assert os.listdir(f"{d}/out3/checkpoint-3/global_step3") == ["adacheck.json"]
    out = launch(2, dict(spec, resume=f"{d}/out3/checkpoint-3"), f"{d}/r", script="hf_worker.py")
    check(out)
    assert "names global_step3 of" in out[0][1] and "loading step 3" in out[0][1], out[0][1][-3000:]
    assert "holds state newer than step 3 (online deltas up to step" in out[0][1]     # (said, not silent)
    assert_two_ranks(f"{d}/r")
    resumed = losses(f"{d}/r")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == full[s] for s in (4, 5, 6)), (full, resumed)


def test_accelerate_save_state_and_load_state_resume_exactly(tmp_path):
    """Accelerate's own loop, ZeRO-2, 2 ranks: ``save_state`` into one directory after steps 2 and
    3 of 6 leaves an AdaCheck checkpoint of step 3 (no DeepSpeed ``*_states.pt``); a new job's
    ``load_state`` restarts at step 3 (the engine's step) and each rank's losses at steps 4-6
    equal the uninterrupted run's, bit for bit (the optimizer's moments, which AdaCheck
    restores, decide steps 5 and 6)."""
    d = str(tmp_path)
    spec = {"mode": "deepspeed", "stage": 2, "steps": 6, "save_at": [2, 3], "save_dir": f"{d}/ck"}
    check(launch(2, spec, f"{d}/a", script="accelerate_worker.py"))
    assert_two_ranks(f"{d}/a")
    full = losses(f"{d}/a")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[1][0] != full[1][1], full    # (2 shards)
    assert os.path.isfile(f"{d}/ck/pytorch_model/manifest.json"), os.listdir(f"{d}/ck")
    assert not glob.glob(f"{d}/ck/**/*.pt", recursive=True), os.listdir(f"{d}/ck/pytorch_model")
    resume = dict(spec, save_at=[], save_dir=f"{d}/ck2", resume=f"{d}/ck")
    check(launch(2, resume, f"{d}/b", script="accelerate_worker.py"))
    assert_two_ranks(f"{d}/b")
    assert [f["start"] for f in json.load(open(f"{d}/b/result.json"))["ranks"]] == [3, 3]
    resumed = losses(f"{d}/b")
    assert sorted(resumed) == [4, 5, 6], resumed
    assert all(resumed[s] == full[s] for s in (4, 5, 6)), (full, resumed)


def test_accelerator_cpu_true_silently_drops_deepspeed_and_adacheck(tmp_path):
    """``Accelerator(cpu=True, deepspeed_plugin=...)`` (the plugin's config has an enabled adacheck
    block) runs both ranks as plain DDP: no DeepSpeedEngine, no AdaCheck, ``save_state`` writes
    Accelerate's own files and no AdaCheck checkpoint, and neither rank logs a word about
    DeepSpeed.  (What the docs warn of; ``PartialState(cpu=True)`` first is the way.)"""
    d = str(tmp_path)
    out = check(launch(2, {"mode": "cpu", "stage": 2, "save_dir": f"{d}/ck"}, f"{d}/a",
                       script="accelerate_worker.py"))
    for rank, f in enumerate(json.load(open(f"{d}/a/result.json"))["ranks"]):
        assert (f["accelerate_num_processes"], f["accelerate_process_index"]) == (2, rank), f
        assert f["distributed_type"] == "MULTI_CPU" and f["model"] == "DistributedDataParallel", f
        assert not f["deepspeed_engine"] and not f["adacheck_attached"], f
    assert "model.safetensors" in os.listdir(f"{d}/ck"), os.listdir(f"{d}/ck")
    assert not glob.glob(f"{d}/ck/**/manifest.json", recursive=True), os.listdir(f"{d}/ck")
    said = [line for _, text in out for line in text.splitlines()
            if "deepspeed" in line.lower() and "UntestedVersionWarning" not in line]
    assert not said, said
