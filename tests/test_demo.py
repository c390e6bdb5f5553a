"""The README's first command, as a new user runs it: scripts/demo.py --keep (what
``bash scripts/demo.sh --keep`` runs once .venv is set up) trains, crashes, resumes bit-identically,
keeps its checkpoints and prints the adacheck commands to try on them; each printed command runs
and does what it says.  The demo's own oracle is an uninterrupted run of the same training."""
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from launch import ROOT

pytestmark = pytest.mark.timeout(900)


def test_the_demo_keeps_its_checkpoints_and_its_printed_commands_work():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--keep"], capture_output=True,
                       text=True, timeout=800, env=dict(os.environ, PYTHONPATH=ROOT))
    kept = re.search(r"\[demo\] kept in (\S+); try:", p.stdout)
    try:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "| resumed losses (steps 5-8) == uninterrupted | yes, bit-identical |" in p.stdout, p.stdout
        assert kept, p.stdout
        commands = [shlex.split(line.strip()) for line in p.stdout[kept.end():].splitlines() if line.strip()]
        assert [c[1] for c in commands] == ["ls", "inspect", "verify", "convert", "convert", "prune"], commands
        for argv in commands:
            assert os.path.basename(argv[0]) == "adacheck" and os.access(argv[0], os.X_OK), argv
            r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-2000:])
            if argv[1] == "verify":
                assert "OK" in r.stdout, r.stdout
        work = kept.group(1)
        assert os.path.isfile(os.path.join(work, "weights", "model.safetensors"))
        assert os.path.isdir(os.path.join(work, "universal"))
    finally:
        if kept:
            shutil.rmtree(kept.group(1), ignore_errors=True)
