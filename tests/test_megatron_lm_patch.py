"""Megatron-LM's own training package at each tag snapshotted in ../shared/megatron-lm (CI has
that folder beside the clone; a fresh clone does not, and these tests skip there):

* the tag's patch (:data:`PATCH_FOR`, as patches/README.md says) passes ``git apply --check``,
  and once applied its hunks sit in the functions they are meant for and call
  adacheck_megatron.launch with arguments its functions take, every process group included;
* the functions the launcher replaces have parameters it knows
  (``launch.KNOWN_SIGNATURES``), ``setup_model_and_optimizer`` returns what the launcher
  reads, the script's argument parsing reaches ``arguments.parse_args``, and the other
  Megatron-LM names AdaCheck uses exist.

Static checks, with ``ast``: importing megatron.training needs triton and, from core_v0.18,
Python 3.12 (``typing.override``); training needs CUDA. A snapshot added to the folder without
a patch fails :func:`test_every_snapshot_has_a_patch`.
"""
import ast
import inspect
import os
import re
import subprocess
import tarfile

import pytest

from launch import ROOT

from adacheck_megatron import launch

# scripts/check_versions.py points this at a folder of the snapshots it was given
SHARED = (os.environ.get("ADACHECK_MEGATRON_LM_SNAPSHOTS")
          or os.path.join(ROOT, "..", "shared", "megatron-lm"))
PATCHES = os.path.join(ROOT, "patches")
# the patch of each Megatron-LM tag (patches/README.md)
PATCH_FOR = {
    "core_v0.16.1": "megatron-lm-core_v0.16.1.patch",
    "core_v0.17.1": "megatron-lm-core_v0.16.1.patch",
    "core_v0.18.2": "megatron-lm-core_v0.18.2.patch",
    "core_v0.19.0": "megatron-lm-core_v0.19.0.patch",
}
# what of a snapshot the checks read
MEMBERS = ("megatron/training/", "megatron/core/num_microbatches_calculator.py", "pretrain_gpt.py")
PATCHED = ("arguments.py", "checkpointing.py", "training.py")

pytestmark = pytest.mark.skipif(
    not os.path.isdir(SHARED),
    reason=f"no Megatron-LM snapshots at {os.path.normpath(SHARED)} (CI has them beside the "
           "clone)")


def unpack(tag: str, dest) -> str:
    """The files of snapshot ``tag`` that the checks read, unpacked under ``dest``; a git
    repository there, so that ``git apply`` takes its paths from it."""
    dest = str(dest)
    with tarfile.open(os.path.join(SHARED, f"{tag}.tar.gz")) as tar:
        members = [m for m in tar.getmembers() if m.name.lstrip("./").startswith(MEMBERS)]
        assert members, f"{tag}.tar.gz holds none of {MEMBERS}"
        tar.extractall(dest, members=members, filter="data")
    subprocess.run(["git", "init", "-q", dest], check=True, timeout=60)
    return dest


def git_apply(tree: str, patch: str, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "apply", *flags, os.path.join(PATCHES, patch)], cwd=tree,
                          capture_output=True, text=True, timeout=60)


def module(tree: str, path: str) -> ast.Module:
    with open(os.path.join(tree, path)) as f:
        return ast.parse(f.read(), path)


def function(mod: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in mod.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{len(found)} top-level functions named {name}"
    return found[0]


def params(fn: ast.FunctionDef) -> list:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def own(fn: ast.FunctionDef) -> list:
    """The nodes of ``fn``'s body, not those of the functions defined in it."""
    out, todo = [], list(fn.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def calls(node, name: str) -> list:
    """Calls of ``name`` (a plain name, or ``x.name``) anywhere under ``node``."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id == name)
        or (isinstance(n.func, ast.Attribute) and n.func.attr == name))]


def imports_from(node, module_name: str, name: str) -> list:
    return [n for n in ast.walk(node) if isinstance(n, ast.ImportFrom) and n.module == module_name
            and any(a.name == name for a in n.names)]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """tag -> an unpacked, unpatched snapshot (shared by the tests that only read)."""
    made = {}

    def get(tag):
        if tag not in made:
            made[tag] = unpack(tag, tmp_path_factory.mktemp(tag))
        return made[tag]
    return get


def test_every_snapshot_has_a_patch():
    tags = sorted(f[:-len(".tar.gz")] for f in os.listdir(SHARED) if f.endswith(".tar.gz"))
    assert tags, f"no snapshots in {SHARED}"
    assert [t for t in tags if t not in PATCH_FOR] == [], "snapshots without a patch in PATCH_FOR"
    shipped = sorted(f for f in os.listdir(PATCHES) if f.endswith(".patch"))
    assert shipped == sorted(set(PATCH_FOR.values()))


@pytest.mark.parametrize("tag", sorted(PATCH_FOR))
def test_the_patch_of_each_tag_applies_into_the_right_functions(tag, tmp_path):
    tree = unpack(tag, tmp_path)
    check = git_apply(tree, PATCH_FOR[tag], "--check", "-v")
    assert check.returncode == 0, f"{PATCH_FOR[tag]} on {tag}:\n{check.stderr}"
    assert check.stderr.count("Checking patch") == len(PATCHED) and "fuzz" not in check.stderr
    assert git_apply(tree, PATCH_FOR[tag]).returncode == 0
    training = os.path.join("megatron", "training")

    # arguments.parse_args: the flags after the script's extra_args_provider, checked after parsing
    fn = function(module(tree, os.path.join(training, "arguments.py")), "parse_args")
    add, = calls(fn, "add_args")
    check_args, = calls(fn, "check_args")
    provider, = calls(fn, "extra_args_provider")
    parsed = max(c.lineno for c in calls(fn, "parse_args") + calls(fn, "parse_known_args"))
    assert provider.lineno < add.lineno < parsed < check_args.lineno
    assert imports_from(fn, "adacheck_megatron", "launch")

    # checkpointing.save_checkpoint / load_checkpoint: delegate to launch's, with every process
    # group (and rng_state_key_prefix) the function has, before any of Megatron-LM's own work
    mod = module(tree, os.path.join(training, "checkpointing.py"))
    for name, alias in (("save_checkpoint", "adacheck_save"),
                        ("load_checkpoint", "adacheck_load")):
        fn = function(mod, name)
        assert imports_from(fn, "adacheck_megatron.launch", name), name
        call, = calls(fn, alias)
        positional = [a.id for a in call.args]
        keywords = {k.arg: k.value for k in call.keywords}
        inspect.signature(getattr(launch, name)).bind(*positional, **keywords)  # launch takes them
        mine = params(fn)
        assert set(positional) <= set(mine), (name, positional)
        for k, v in keywords.items():       # name=name, of the function's own parameters
            assert isinstance(v, ast.Name) and v.id == k and k in mine + ["args"], (name, k)
        honoured = launch.GROUP_PARAMS + (launch.PREFIX_PARAM,)
        assert [p for p in mine if p in honoured and p not in keywords] == [], name
        # only the docstring and Megatron-LM's `start_ckpt = time()`, `args = get_args()`,
        # `load_dir = getattr(args, load_arg)` come before the delegation
        at, = [i for i, st in enumerate(fn.body) if call in list(ast.walk(st))]
        for st in fn.body[:at]:
            assert isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) or (
                isinstance(st, ast.Assign) and [t.id for t in st.targets] in
                (["start_ckpt"], ["args"], ["load_dir"])), (name, ast.unparse(st))

    # training.setup_model_and_optimizer: the hooks once the optimizer and scheduler exist
    fn = function(module(tree, os.path.join(training, "training.py")), "setup_model_and_optimizer")
    hooks, = calls(fn, "setup_hooks")
    assert [a.id for a in hooks.args] == ["model", "optimizer", "opt_param_scheduler", "args"]
    scheduler, = [n for n in ast.walk(fn)
                  if isinstance(n, ast.Assign) and calls(n, "get_optimizer_param_scheduler")]
    assert hooks.lineno > scheduler.lineno
    assert imports_from(fn, "adacheck_megatron.launch", "setup_hooks")


@pytest.mark.parametrize("tag", sorted(PATCH_FOR))
def test_the_launchers_hook_targets_exist(tag, trees):
    tree = trees(tag)
    training = os.path.join(tree, "megatron", "training")
    # the functions install() replaces have the parameters it knows
    for where in launch.KNOWN_SIGNATURES:
        file, name = where.split(".")
        fn = function(module(training, f"{file}.py"), name)
        problem = launch.signature_problem(where, params(fn))
        assert problem is None, (tag, problem)
    # setup_model_and_optimizer returns (model, optimizer, opt_param_scheduler), which the
    # wrapper reads
    fn = function(module(training, "training.py"), "setup_model_and_optimizer")
    returns = [n.value for n in own(fn) if isinstance(n, ast.Return)]
    assert returns and all(isinstance(r, ast.Tuple) and [e.id for e in r.elts[:3]] ==
                           ["model", "optimizer", "opt_param_scheduler"] for r in returns), tag
    # pretrain_gpt.py's parsing reaches the replaced arguments.parse_args
    args_mod = module(training, "arguments.py")
    script = module(tree, "pretrain_gpt.py")
    if calls(script, "parse_and_validate_args"):      # core_v0.18 on: the script parses itself
        fn = function(args_mod, "parse_and_validate_args")
        assert [c for c in calls(fn, "parse_args") if isinstance(c.func, ast.Name)], tag
    else:                                   # pretrain -> initialize_megatron -> parse_args
        assert calls(script, "pretrain")
        init = module(training, "initialize.py")
        assert imports_from(init, "megatron.training.arguments", "parse_args")
        assert calls(function(init, "initialize_megatron"), "parse_args")
    # what else adacheck_megatron calls there
    for file, name, needs in (("checkpointing.py", "set_loaded_iteration", ["value"]),
                              ("global_vars.py", "get_args", [])):
        assert params(function(module(training, file), name)) == needs, (tag, name)
    calc = module(tree, os.path.join("megatron", "core", "num_microbatches_calculator.py"))
    update = function(calc, "update_num_microbatches")
    assert {"consumed_samples", "verbose"} <= set(params(update))
    assert imports_from(module(training, "__init__.py"), "global_vars", "get_args"), tag
    # the Megatron-LM arguments the launcher reads are still there (argparse flags, or fields of
    # the config dataclasses that Megatron-LM turns into flags)
    text = "\n".join(open(os.path.join(d, f)).read() for d, _, files in os.walk(training)
                     for f in files if f.endswith(".py"))
    for dest in [d for d, _ in launch.UNSUPPORTED] + [
            launch.NON_PERSISTENT[0], "async_save", "use_persistent_ckpt_worker", "ckpt_step",
            "ckpt_convert_format", "finetune", "no_load_optim", "use_precision_aware_optimizer"]:
        flag = "--" + dest.replace("_", "-")
        assert re.search(rf"\b{dest}\b|['\"]{flag}['\"]", text), (tag, dest)
