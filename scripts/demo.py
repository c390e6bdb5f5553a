"""Orchestrates the demo: crash mid-run, resume from AdaCheck, compare with an uninterrupted run.
``--keep`` (or ADACHECK_DEMO_KEEP=1) keeps the checkpoints and prints commands to try on them."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "configs", "ds_zero2_bf16_adacheck.json")


def torchrun(args, expect_fail=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29500 + os.getpid() % 1000), os.path.join(HERE, "demo_train.py"), "--config", CONFIG] + args
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    lines = [l for l in p.stdout.splitlines() if l.startswith("step")]
    print("\n".join("    " + l for l in lines))
    if (p.returncode != 0) != expect_fail:
        print(p.stdout[-4000:])
        raise SystemExit(f"demo: torchrun exited with {p.returncode}")


def du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    keep = "--keep" in sys.argv[1:] or os.environ.get("ADACHECK_DEMO_KEEP") == "1"
    unknown = [a for a in sys.argv[1:] if a != "--keep"]
    if unknown:
        raise SystemExit(f"demo: unknown arguments {unknown}; the only one is --keep (keep the checkpoints)")
    work = tempfile.mkdtemp(prefix="adacheck-demo-")
    ck = os.path.join(work, "ckpt")
    print(f"[demo] 2-rank DeepSpeed ZeRO-2 bf16 training on CPU; checkpoints in {ck}")
    print("[demo] 1) train, save at step 4 (AdaCheck and native), crash after step 6")
    torchrun(["--steps", "8", "--save-at", "4", "--die-at", "6", "--ckpt", ck,
              "--out", os.path.join(work, "crashed.json")], expect_fail=True)
    print("[demo] 2) new job: engine.load_checkpoint() from the AdaCheck checkpoint, train to step 8")
    torchrun(["--steps", "8", "--resume", "--ckpt", ck, "--out", os.path.join(work, "resumed.json")])
    print("[demo] 3) reference: the same training without interruption")
    torchrun(["--steps", "8", "--ckpt", os.path.join(work, "ref"), "--out", os.path.join(work, "ref.json")])
    resumed = json.load(open(os.path.join(work, "resumed.json")))
    ref = json.load(open(os.path.join(work, "ref.json")))
    same = all(resumed[k] == ref[k] for k in resumed) and set(resumed) == {str(s) for s in range(5, 9)}
    native, ada = du(os.path.join(ck, "native")), du(os.path.join(ck, "adacheck"))
    sub = subprocess.run([sys.executable, "-m", "adacheck.cli", "inspect", os.path.join(ck, "adacheck"), "--json"],
                         stdout=subprocess.PIPE, text=True, check=True)
    stats = json.loads(sub.stdout)["stats"]
    unique = stats["logical_bytes"] - stats["derived_bytes"]
    print()
    print("| what                                   | value |")
    print("|----------------------------------------|------:|")
    print(f"| native DeepSpeed checkpoint (bytes)    | {native:,} |")
    print(f"| AdaCheck checkpoint (bytes)            | {ada:,} |")
    print(f"| native / AdaCheck                      | {native / ada:.2f}x |")
    print(f"| unique logical state (bytes)           | {unique:,} |")
    print(f"| AdaCheck / unique logical state        | {ada / unique:.3f}x |")
    print(f"| resumed losses (steps 5-8) == uninterrupted | {'yes, bit-identical' if same else 'NO'} |")
    for k in sorted(resumed, key=int):
        print(f"|   step {k}: resumed {resumed[k]:.8f} / uninterrupted {ref[k]:.8f} | {'=' if resumed[k] == ref[k] else '!='} |")
    if keep:
        cli = os.path.join(os.path.dirname(sys.executable), "adacheck")
        ada = os.path.join(ck, "adacheck")
        print(f"\n[demo] kept in {work}; try:")
        for args in ("ls {c}", "inspect {c} --redundancy", "verify {c}", "convert {c} {w}/weights",
                     "convert {c} {w}/universal --to deepspeed-universal", "prune {c} --keep-last 1"):
            print(f"  {cli} {args.format(c=ada, w=work)}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if not same:
        raise SystemExit("demo: resumed training differs from the uninterrupted run")


if __name__ == "__main__":
    main()
