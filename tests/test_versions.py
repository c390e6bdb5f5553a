"""torch has no upper bound in pyproject.toml (pip keeps a user's newer CUDA torch); a torch minor
version the tests did not run with gets one UntestedVersionWarning, from the core's import,
which the CLI and both integrations share."""
import os
import subprocess
import sys

from launch import ROOT

from adacheck.compat import TESTED, untested

# imports the core, the CLI and the Megatron integration; prints each UntestedVersionWarning
IMPORTS = ("import warnings\n"
           "with warnings.catch_warnings(record=True) as w:\n"
           "    warnings.simplefilter('always')\n"
           "    import adacheck, adacheck.cli, adacheck_megatron\n"
           "for x in w:\n"
           "    if x.category.__name__ == 'UntestedVersionWarning':\n"
           "        print(f'{x.filename}: {x.message}')\n")


def test_torch_versions():
    assert TESTED["torch"] == ("2.13", "2.14")
    assert untested("torch", "2.13.0+cpu") is None and untested("torch", "2.14.1+cu130") is None
    text = untested("torch", "2.15.0+cu130")
    assert "torch 2.13.x / 2.14.x" in text and "2.15.0+cu130" in text and "torch==2.14.*" in text


def test_an_untested_torch_is_named_once(tmp_path):
    # a torch whose installed metadata says 2.15.0 (a dist-info found first on the path; only
    # the metadata is read, the torch imported is the real one)
    meta = tmp_path / "site" / "torch-2.15.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.15.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), ROOT]))
    p = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True,
                       timeout=300, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    said = p.stdout.strip().splitlines()
    assert len(said) == 1, p.stdout
    assert "AdaCheck is tested with torch 2.13.x / 2.14.x and found 2.15.0" in said[0]
    assert said[0].startswith("<string>:")          # attributed to the importing line
    # the installed torch: no warning when it is of the tested version (the suite also runs
    # against others, which get theirs)
    installed = untested("torch")
    p = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=ROOT), cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == ("" if installed is None else f"<string>: {installed}\n"), p.stdout


def test_a_megatron_core_source_tree_is_named_by_its_package_info(tmp_path):
    # a Megatron-LM tree on PYTHONPATH (no pip metadata; the installed megatron-core's says
    # 0.16.1): its megatron/core/package_info.py gives the version, read without importing it
    core = tmp_path / "tree" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise RuntimeError('megatron.core must not be imported')\n")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = ''\n"
                                          "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "tree"), ROOT]))
    p = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True,
                       timeout=300, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    said = [line for line in p.stdout.splitlines() if "megatron-core" in line]   # (not torch's)
    assert len(said) == 1, p.stdout
    assert "AdaCheck is tested with megatron-core 0.16.x / 0.17.x / 0.18.x / 0.19.x and found 0.20.0" in said[0]
    assert said[0].startswith("<string>:")
