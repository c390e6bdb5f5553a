"""adacheck_megatron.launch without a Megatron-LM tree: its command line and the argument
helpers that the launcher and patches/megatron-lm-core_v0.16.1.patch share.

The megatron-core wheel has no ``megatron.training``; running Megatron-LM's pretrain_gpt.py
through the launcher needs the Megatron-LM tree and CUDA (patches/README.md says what was
checked there).
"""
import argparse
import importlib.util
import os
import subprocess
import sys

import pytest

from launch import ROOT

from adacheck_megatron.launch import NON_PERSISTENT, UNSUPPORTED, add_args, check_args, saving_config


def run_launcher(*argv, cwd, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT)     # no Megatron-LM tree on the path
    return subprocess.run([sys.executable, "-m", "adacheck_megatron.launch", *argv], cwd=str(cwd),
                          env=env, capture_output=True, text=True, timeout=timeout)


def megatron_training_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        return False


def test_missing_megatron_training_is_a_clear_error(tmp_path):
    if megatron_training_importable():
        pytest.skip("megatron.training is importable here (a Megatron-LM tree is installed)")
    marker = tmp_path / "ran"
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    p = run_launcher(str(script), "--num-layers", "2", "--adacheck", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "cannot import megatron.training" in p.stderr
    assert "Megatron-LM root" in p.stderr and "PYTHONPATH" in p.stderr
    assert "Traceback" not in p.stderr
    assert not marker.exists()                  # the script never ran


def test_usage_and_missing_script(tmp_path):
    p = run_launcher(cwd=tmp_path)
    assert p.returncode == 2 and "usage: python -m adacheck_megatron.launch SCRIPT" in p.stderr
    p = run_launcher("--help", cwd=tmp_path)
    assert p.returncode == 0 and "usage:" in p.stdout
    p = run_launcher(str(tmp_path / "nope.py"), cwd=tmp_path)
    assert p.returncode == 2 and "no such script" in p.stderr


def test_launch_module_does_not_import_megatron():
    # Megatron-LM's arguments.py (patched) imports it while megatron.training is being imported.
    code = ("import sys, adacheck_megatron.launch, adacheck_megatron.hooks; "
            "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')); "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def megatron_like_parser():
    """A parser with the Megatron-LM flags check_args looks at (argparse, as Megatron-LM's)."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py")
    p.add_argument("--save")
    p.add_argument("--load")
    for dest, flag in UNSUPPORTED + (NON_PERSISTENT,):
        p.add_argument(flag, dest=dest, nargs="?", const=True, default=None)
    p.add_argument("--use-precision-aware-optimizer", action="store_true")
    p.add_argument("--async-save", action="store_true")
    return p


def parse(*argv):
    p = add_args(megatron_like_parser())
    return check_args(p.parse_args(list(argv)), p)


def test_add_args_twice_keeps_one_set_of_flags():
    p = add_args(add_args(megatron_like_parser()))
    assert p.format_help().count("--adacheck-dir DIR") == 2   # usage line + option list, once


def test_check_args():
    a = parse("--save", "/s")
    assert a.adacheck_config is None and a.save == "/s" and a.load is None   # off: nothing pickled
    a = parse("--adacheck", "--adacheck-dir", "/ck", "--adacheck-keep-last", "2")
    assert a.adacheck_config.enabled and a.adacheck_config.keep_last == 2
    assert (a.save, a.load) == ("/ck", "/ck")     # Megatron-LM saves and loads only when they are set
    a = parse("--adacheck", "--adacheck-dir", "/ck", "--save", "/s", "--load", "/l")
    assert (a.save, a.load, a.adacheck_config.save_dir) == ("/s", "/l", "/ck")
    # only the online deltas refuse it (they record param.grad)
    a = parse("--adacheck", "--adacheck-dir", "/ck", "--use-precision-aware-optimizer")
    assert a.adacheck_config.enabled and not a.adacheck_config.online.enabled
    # Megatron-LM's non-persistent checkpoints: into the memory tier
    a = parse("--adacheck", "--adacheck-dir", "/ck", "--adacheck-tiers-memory", "--non-persistent-save-interval", "2")
    assert a.adacheck_config.tiers.memory


def test_a_save_follows_async_save_as_megatron_lm_validated_it():
    # Megatron-LM validates after parsing: core_v0.16.1's validate_args turns --async-save off
    # without --use-persistent-ckpt-worker ("Disabling --async-save"); AdaCheck's save follows.
    a = parse("--adacheck", "--adacheck-dir", "/ck", "--async-save")
    assert a.adacheck_config.async_save and saving_config(a).async_save
    a.async_save = False
    assert not saving_config(a).async_save and saving_config(a).save_dir == "/ck"
    assert not parse("--adacheck", "--adacheck-dir", "/ck").adacheck_config.async_save


@pytest.mark.parametrize("argv,message", [
    (["--adacheck-keep-last", "2"], "--adacheck-keep-last given without --adacheck"),
    (["--adacheck", "--adacheck-redundancy-factor", "0"], "--adacheck-redundancy-factor must be >= 1"),
    (["--adacheck", "--non-persistent-save-interval", "5"],
     "--non-persistent-save-interval with --adacheck needs --adacheck-tiers-memory"),
    (["--adacheck", "--use-torch-fsdp2"], "--use-torch-fsdp2 is not supported with --adacheck"),
    (["--adacheck", "--adacheck-dir", "/ck", "--adacheck-online", "--use-precision-aware-optimizer"],
     "--use-precision-aware-optimizer (and --optimizer-cpu-offload, which needs it) is not supported with "
     "--adacheck-online"),
])
def test_check_args_errors_are_parser_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pretrain_gpt.py" in err and message in err
