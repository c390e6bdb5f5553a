"""AdaCheck as a user installs it: a wheel built from this tree, installed (not editable) into a
fresh virtual environment, one extra after the other. The oracle is the installed package
itself: every module of each package imports from site-packages, the ``adacheck`` script
runs, and the conversion entry points load. (The suite's own .venv holds an editable install,
which reads the source tree and so cannot see a package that the wheel leaves out.)"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(1500)

# imports every module of the named packages from the installed copy; prints what it imported
IMPORT_ALL = r"""
import importlib, importlib.metadata, pkgutil, sys
site = sys.argv[1]
count = 0
for top in sys.argv[2].split(","):
    pkg = importlib.import_module(top)
    assert pkg.__file__.startswith(site), (top, pkg.__file__)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        mod = importlib.import_module(info.name)
        assert mod.__file__.startswith(site), (info.name, mod.__file__)
        count += 1
for ep in importlib.metadata.entry_points(group="adacheck.converters"):
    if ep.value.split(".")[0] in sys.argv[2].split(","):
        ep.load()
print("imported", count)
"""


def _run(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    said = " ".join(a if len(a) < 80 else a[:40] + "..." for a in cmd)
    assert out.returncode == 0, f"{said}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_wheel_installs_and_imports_with_each_extra(tmp_path):
    src = tmp_path / "src"      # (a copy: building in the tree would leave build/ there)
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "tests", "build", "dist",
                                                               "*.egg-info", "__pycache__", "bench_out"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
          str(tmp_path / "dist"), str(src)])
    wheel, = [str(p) for p in (tmp_path / "dist").glob("adacheck-*.whl")]
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
           os.path.join(ROOT, "constraints.txt")]
    _run(pip + ["torch==2.13.0"])       # (the CPU build; see scripts/_env.sh)
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["DS_ACCELERATOR"] = "cpu"

    # the core alone: the format and the CLI; an integration says which extra it needs
    _run(pip + [wheel])
    assert "imported" in _run([py, "-c", IMPORT_ALL, site, "adacheck"], env=env, cwd=tmp_path)
    assert _run([str(venv / "bin" / "adacheck"), "--version"], env=env).strip() == "adacheck 0.1.0"
    out = subprocess.run([py, "-c", "import adacheck_ds"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode != 0 and "pip install 'adacheck[deepspeed]'" in out.stderr, out.stderr[-2000:]

    for extra, packages in (("deepspeed", "adacheck_ds"), ("megatron", "adacheck_megatron"),
                            ("s3,zstd", "adacheck")):
        _run(pip + [f"{wheel}[{extra}]"])
        assert "imported" in _run([py, "-c", IMPORT_ALL, site, packages], env=env, cwd=tmp_path)
    _run([py, "-c", "import s3fs, zstandard"], env=env, cwd=tmp_path)
