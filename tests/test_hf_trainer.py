"""The Hugging Face Trainer with DeepSpeed and an ``adacheck`` block (tests/hf_worker.py: a tiny
GPT-2 from a config, 2 ranks, CPU, gloo), as a user runs it: the Trainer's own save and
``resume_from_checkpoint`` go through AdaCheck.  The oracle is the Trainer's own logged losses
of an uninterrupted run: a resumed run must log exactly the same ones."""
import json
import os

import pytest

from launch import check, launch

pytestmark = pytest.mark.timeout(900)


def losses(d, name="result.json"):
    return {int(k): v for k, v in json.load(open(os.path.join(d, name)))["losses"].items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_saves_adacheck_checkpoints_and_resumes_exactly(tmp_path, stage):
    d = str(tmp_path)
    spec = {"stage": stage, "adacheck": {"enabled": True}, "output_dir": f"{d}/out", "max_steps": 6,
            "save_steps": 3}
    check(launch(2, spec, f"{d}/a", script="hf_worker.py"))
    full = losses(f"{d}/a")
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    ckpt = f"{d}/out/checkpoint-3"
    # the Trainer's checkpoint holds an AdaCheck checkpoint where DeepSpeed's would be, and no native files
    assert os.path.isfile(f"{ckpt}/global_step3/manifest.json"), os.listdir(ckpt)
    assert not [f for f in os.listdir(f"{ckpt}/global_step3") if f.endswith(".pt")]
    check(launch(2, dict(spec, resume=ckpt, output_dir=f"{d}/out2"), f"{d}/b", script="hf_worker.py"))
    resumed = losses(f"{d}/b")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == full[s] for s in (4, 5, 6)), (full, resumed)
    if stage != 2:
        return
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
    resumed = losses(f"{d}/r")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == full[s] for s in (4, 5, 6)), (full, resumed)
