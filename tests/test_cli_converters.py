"""Conversion formats are registered by the integrations (entry points), so the core and its
command line import no framework: ``adacheck convert --help`` names every installed format
without importing one, and only the format asked for is imported."""
import os
import subprocess
import sys

import pytest

from launch import ROOT

from adacheck.cli.convert import converter, registered
from adacheck.integration import Converter
from adacheck.errors import ConfigError


def run(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


FRAMEWORKS = "('adacheck_ds', 'adacheck_megatron', 'deepspeed', 'megatron')"


def test_the_command_line_imports_no_integration_until_a_format_is_asked_for():
    out = run(f"""
import contextlib, io, sys
from adacheck.cli import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    assert main(["convert", "--help"]) == 0
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS})
print(loaded)
print(buf.getvalue())
""")
    loaded, help_text = out.split("\n", 1)
    assert loaded == "[]", loaded
    for name in ("deepspeed", "deepspeed-universal", "torch-dist", "weights"):
        assert name in help_text
    out = run(f"""
import sys
from adacheck.cli.convert import converter
c = converter("torch-dist")
print(c.name, sorted({{m.split(".")[0] for m in sys.modules}} & set({FRAMEWORKS})))
""")
    assert out.strip() == "torch-dist ['adacheck_megatron']"     # (not DeepSpeed's)


def test_installed_formats_and_a_clear_error_for_another():
    assert {"deepspeed", "deepspeed-universal", "torch-dist"} <= set(registered())
    c = converter("deepspeed-universal")
    assert isinstance(c, Converter) and c.name == "deepspeed-universal"
    with pytest.raises(ConfigError, match=r"no converter for 'onnx' is installed \(installed: deepspeed, "):
        converter("onnx")
    from adacheck.cli import main
    assert main(["convert", "src", "out", "--to", "onnx"]) == 2
    assert main(["convert", "src", "out", "--from", "torch-dist", "--to", "weights"]) == 2


def test_a_source_tree_on_pythonpath_finds_its_own_formats(tmp_path):
    """AdaCheck used from a checkout on PYTHONPATH (not installed: no entry points, as on a GPU
    machine that shares one tree) still converts to its own formats, and the table of them is
    the one pyproject.toml registers."""
    import sysconfig
    import tomllib
    from adacheck.cli.convert import OWN
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["entry-points"]["adacheck.converters"] == OWN
    site = sysconfig.get_paths()["purelib"]
    view = tmp_path / "site"            # the environment's packages without AdaCheck's metadata
    view.mkdir()
    for name in os.listdir(site):
        if not (name.startswith("adacheck") or name.startswith("__editable__")):
            os.symlink(os.path.join(site, name), view / name)
    tree = tmp_path / "tree"            # the packages' sources alone (no egg-info beside them)
    tree.mkdir()
    for name in ("adacheck", "adacheck_ds", "adacheck_megatron"):
        os.symlink(os.path.join(ROOT, name), tree / name)
    code = ("import importlib.metadata as m, adacheck.cli.convert as c\n"
            "assert not m.entry_points(group='adacheck.converters')\n"
            "print(sorted(c.registered()), c.converter('torch-dist').name)")
    p = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{view}"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.split() == ["['deepspeed',", "'deepspeed-universal',", "'torch-dist']", "torch-dist"]
