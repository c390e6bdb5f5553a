"""Megatron-LM's own pretrain_gpt.py with AdaCheck and ``--async-save``, on a GPU: a job that stops
at iteration 3 and a job that resumes from its checkpoint train like one uninterrupted job.

  1. reference: the unpatched tree, native, no checkpoint, ``--train-iters 6``;
  2. stop: ``python -m adacheck_megatron.launch pretrain_gpt.py`` (unpatched tree) with
     ``--adacheck --async-save --use-persistent-ckpt-worker``, saving and exiting at iteration 3
     (the save commits behind training; the exit waits for it);
  3. resume: the patched tree (``patches/megatron-lm-core_v0.16.1.patch`` applied), plain
     ``python pretrain_gpt.py`` with the same flags, loading iteration 3 and training to 6, with an
     asynchronous save at 6 (committed before the job ends).

The oracle is the reference run's log: iterations 4 and 6 must log the same loss, and 4-6 the same
grad norm and learning rate (Megatron-LM logs the second iteration after a resume as the mean
of two). Each checkpoint must be committed (``adacheck inspect``). Needs CUDA and a Megatron-LM
tree of core_v0.16.1 (its dependencies: six, regex, pyyaml, triton, pybind11).

    python scripts/check_megatron_lm.py --tree Megatron-LM --patched-tree Megatron-LM-patched --out OUT
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "128", "--max-position-embeddings", "128",
         "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
         "--train-iters", "6", "--bf16", "--use-distributed-optimizer",
         "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
         "--no-masked-softmax-fusion",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
         "--deterministic-mode", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100",
         "--seed", "1234"]
ADACHECK = ["--adacheck", "--async-save", "--use-persistent-ckpt-worker"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.E+-]+).*?lm loss: ([0-9.E+-]+)"
                  r".*?grad norm: ([0-9.]+)")


def run(name, tree, argv, out, launcher=False, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29533"]
    cmd += ["-m", "adacheck_megatron.launch", "pretrain_gpt.py"] if launcher else ["pretrain_gpt.py"]
    env = dict(os.environ, NCCL_ALGO="Ring", CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([tree, ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    t0 = time.perf_counter()
    p = subprocess.run(cmd + argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    took = time.perf_counter() - t0
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(p.stdout + "\n----- stderr\n" + p.stderr)
    print(f"[{name}] exit {p.returncode} after {took:.1f} s", flush=True)
    if p.returncode != 0:
        tail = p.stderr[p.stderr.find("Traceback"):] if "Traceback" in p.stderr else p.stderr
        raise SystemExit(f"{name} failed:\n{p.stdout[-2000:]}\n{tail[-4000:]}")
    rows = {int(m[1]): {"lr": m[2], "loss": m[3], "grad_norm": m[4]} for m in LINE.finditer(p.stdout)}
    return p.stdout + p.stderr, rows, took


def inspect(path):
    p = subprocess.run([sys.executable, "-m", "adacheck.cli", "inspect", path, "--json"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    if p.returncode != 0:
        raise SystemExit(f"adacheck inspect {path} failed: {p.stdout[-1000:]} {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", required=True, help="Megatron-LM core_v0.16.1, unpatched")
    ap.add_argument("--patched-tree", required=True, help="the same with the AdaCheck patch applied")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ck = os.path.join(a.out, "ck")
    _, ref, t_ref = run("reference", a.tree, MODEL, a.out)
    log1, stop, t_stop = run("stop", a.tree, MODEL + ADACHECK + ["--save", ck, "--save-interval", "3",
                                                               "--exit-interval", "3"], a.out, launcher=True)
    first = inspect(ck)
    log2, resume, t_resume = run("resume", a.patched_tree, MODEL + ADACHECK + ["--save", ck, "--load", ck,
                                                                             "--save-interval", "3"], a.out)
    last = inspect(ck)
    problems = []
    if sorted(ref) != list(range(1, 7)):
        problems.append(f"reference logged iterations {sorted(ref)}")
    if sorted(stop) != [1, 2, 3] or sorted(resume) != [4, 5, 6]:
        problems.append(f"stop logged {sorted(stop)}, resume {sorted(resume)}")
    for i in (1, 2, 3):
        if stop.get(i) != ref.get(i):
            problems.append(f"iteration {i}: stop {stop.get(i)} != reference {ref.get(i)}")
    for i in (4, 5, 6):
        r, s = ref.get(i, {}), resume.get(i, {})
        keys = ("lr", "grad_norm") if i == 5 else ("lr", "loss", "grad_norm")
        if any(r.get(k) != s.get(k) for k in keys):
            problems.append(f"iteration {i}: resume {s} != reference {r}")
    for what, text in (("stop", log1), ("resume", log2)):
        if "commits in the background" not in text:
            problems.append(f"{what}: no asynchronous AdaCheck save was logged")
    if "AdaCheck: loaded iteration 3" not in log2:
        problems.append("resume: no AdaCheck load of iteration 3 logged")
    if first.get("step") != 3 or last.get("step") != 6:
        problems.append(f"committed steps {first.get('step')} then {last.get('step')}, expected 3 then 6")
    result = {"reference": ref, "stop": stop, "resume": resume, "seconds": [t_ref, t_stop, t_resume],
              "checkpoint_after_stop": {k: first.get(k) for k in ("tag", "step")},
              "checkpoint_after_resume": {k: last.get(k) for k in ("tag", "step")},
              "snapshot_lines": [ln for ln in (log1 + log2).splitlines() if "commits in the background" in ln],
              "problems": problems}
    with open(os.path.join(a.out, "check_megatron_lm.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if problems:
        raise SystemExit("FAILED:\n" + "\n".join(problems))
    print("check_megatron_lm: passed")


if __name__ == "__main__":
    main()
