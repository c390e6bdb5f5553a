"""adacheck_megatron.launch without a Megatron-LM tree: its command line, the argument helpers
that the launcher and patches/megatron-lm-core_v*.patch share, and its check of the process
groups Megatron-LM passes to save/load (2 ranks of megatron-core).

The megatron-core wheel has no ``megatron.training``; running Megatron-LM's pretrain_gpt.py
through the launcher needs the Megatron-LM tree and CUDA (patches/README.md says what was
checked there).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT, free_port

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


# One rank of a 2-rank gloo job with megatron-core's parallel state (TP=2, so each rank's data-
# parallel group is itself): check_groups with Megatron-LM's process-group arguments.
GROUPS_RANK = r"""
import json, sys
import torch.distributed as dist
from adacheck_megatron.cpu import enable_cpu
enable_cpu()
dist.init_process_group("gloo")
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(tensor_model_parallel_size=2)
from adacheck.errors import ConfigError
from adacheck_megatron.launch import check_groups
rank = dist.get_rank()
alone = [dist.new_group([r]) for r in range(2)][rank]      # (every rank makes every group)
mine = dict(tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
            dp_group=ps.get_data_parallel_group(),
            expt_dp_group=ps.get_expert_data_parallel_group(), rng_state_key_prefix="")
out = {}
tp = ps.get_tensor_model_parallel_group()
for case, groups in (("none", {}), ("parallel_state", mine), ("same_ranks", dict(dp_group=alone)),
                     ("other_ranks", dict(dp_group=tp)),
                     ("rank1_only", dict(dp_group=tp) if rank else {}),
                     ("prefix", dict(rng_state_key_prefix="grid1"))):
    try:
        check_groups(groups)
        out[case] = None
    except ConfigError as e:
        out[case] = str(e)
with open(sys.argv[1] + f"/rank{rank}.json", "w") as f:
    json.dump(out, f)
dist.barrier()
# (this script checks the groups only and saves nothing, so AdaCheck's exit hook is not
# registered: without it gloo's threads raced the interpreter's teardown in one CI trial, a
# SIGABRT of rank 1 after its result was written; the ranks leave without the teardown)
import os
os._exit(0)
"""


def test_process_groups_other_than_parallel_states_are_refused(tmp_path):
    # core_v0.19 passes the model's pg_collection groups to save/load_checkpoint: the same ranks
    # as megatron-core's parallel_state in a run of one grid (accepted); others are refused, on
    # every rank alike (one rank's odd group must not leave the other in a collective)
    script = tmp_path / "rank.py"
    script.write_text(GROUPS_RANK)
    port = str(free_port())
    env = [dict(os.environ, PYTHONPATH=ROOT, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env[r],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["none"] is None and out["parallel_state"] is None and out["same_ranks"] is None
        assert out["other_ranks"] == (
            "AdaCheck (rank 0): dp_group holds ranks [0, 1], megatron-core's parallel_state group "
            "[0]: AdaCheck saves and loads the parallel_state layout only (process groups of a "
            "model's own are not supported with --adacheck)")
        assert out["rank1_only"].startswith(
            "AdaCheck (rank 1): dp_group holds ranks [0, 1], megatron-core's parallel_state "
            "group [1]")
        assert out["prefix"] == ("AdaCheck (rank 0): rng_state_key_prefix='grid1' (a model of "
                                 "several parallel grids) is not supported with --adacheck")


def test_a_megatron_lm_tree_of_unknown_signatures_is_named():
    # install() refuses such a tree with these words (tests/test_megatron_lm_patch.py checks the
    # known tags' own source against the same table)
    from adacheck_megatron.launch import signature_problem
    save = ["iteration", "model", "optimizer", "opt_param_scheduler",
            "num_floating_point_operations_so_far", "checkpointing_context"]
    assert signature_problem("checkpointing.save_checkpoint", save + ["dp_group"]) is None
    assert signature_problem("checkpointing.save_checkpoint", save + ["grid"]) == (
        "checkpointing.save_checkpoint() has parameters AdaCheck does not know: grid")
    assert signature_problem("checkpointing.save_checkpoint", save[1:]).startswith(
        "checkpointing.save_checkpoint(model, ")
    for lead in (["model_provider_func", "model_type"], ["model_type", "model_provider_func"]):
        assert signature_problem("training.setup_model_and_optimizer", lead) is None
    assert "does not begin with (model_provider_func, model_type) or (model_type, " \
        "model_provider_func)" in signature_problem("training.setup_model_and_optimizer",
                                                    ["model", "model_type"])
