"""Run a Megatron-LM training script, unpatched, with AdaCheck checkpoints.

    cd Megatron-LM        # or put the Megatron-LM tree on PYTHONPATH
    python -m adacheck_megatron.launch pretrain_gpt.py [Megatron-LM flags] --adacheck [--adacheck-* flags]
    torchrun --nproc-per-node 8 -m adacheck_megatron.launch pretrain_gpt.py ...

The launcher imports ``megatron.training``, installs AdaCheck into it (:func:`install`) and
runs the script with ``runpy.run_path(script, run_name="__main__")`` and ``sys.argv`` set to
the script and its flags, as ``python pretrain_gpt.py ...`` would (the script's folder first
on ``sys.path``).  What it installs, in every loaded ``megatron.*`` module that holds these
functions by name (``megatron.training.training`` imports them with ``from ... import``):

* ``parse_args`` (``megatron.training.arguments``, ``megatron.training.initialize``): the
  ``--adacheck*`` flags are added after the script's own ``extra_args_provider`` and
  checked after parsing (:func:`add_args`, :func:`check_args`);
* ``save_checkpoint`` / ``load_checkpoint`` (``megatron.training.checkpointing``,
  ``megatron.training.training``, ...): with ``--adacheck`` they delegate to
  :func:`save_checkpoint` / :func:`load_checkpoint` below, otherwise Megatron-LM's own run;
* ``setup_model_and_optimizer`` (``megatron.training.training``): with ``--adacheck`` the
  optimizer it returns gets the post-step hooks (:func:`adacheck_megatron.hooks.wrap_optimizer_step`).

``patches/megatron-lm-core_v*.patch`` (one per Megatron-LM tag, see ``patches/README.md``) is
the other way: a few lines in Megatron-LM that call the same :func:`add_args`,
:func:`check_args`, :func:`save_checkpoint`, :func:`load_checkpoint` and :func:`setup_hooks`,
so both behave the same.

Megatron-LM trees: the launcher knows the functions above as Megatron-LM's tags core_v0.16.1,
core_v0.17.1, core_v0.18.2 and core_v0.19.0 have them (:data:`KNOWN_SIGNATURES`; from
core_v0.18 scripts parse with ``parse_and_validate_args``, which calls ``arguments.parse_args``;
core_v0.19 swaps the first two parameters of ``setup_model_and_optimizer`` and passes process
groups to ``save_checkpoint`` / ``load_checkpoint``, see :func:`check_groups`).  :func:`install`
refuses a tree whose functions have other parameters, before it replaces anything.

The delegation keeps Megatron-LM's contract: ``save_checkpoint`` returns None; ``load_checkpoint``
returns ``(iteration, num_floating_point_operations_so_far)`` and restores the sample counters
(``consumed_train_samples``, ``skipped_train_samples``, ``consumed_valid_samples``, saved with
each AdaCheck checkpoint) and the micro-batch calculator, as Megatron-LM's loader does; with
``--no-load-optim`` / ``--finetune`` in fp16/bf16 the fp32 master weights are reloaded from the
loaded model weights.  A load directory holding a native Megatron checkpoint and no AdaCheck
one is loaded by Megatron-LM's own code (an existing run switching to AdaCheck); the next save
is AdaCheck's.  ``--adacheck-dir DIR`` without ``--save`` / ``--load`` sets them to DIR, since
Megatron-LM saves and loads only when they are set.

Nothing in this module imports megatron at import time: Megatron-LM's ``arguments.py`` imports
it (patched tree) while ``megatron.training`` is still being imported.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import runpy
import sys
from typing import Optional, Sequence

from adacheck.checkpoint import lifecycle
from adacheck.errors import ConfigError

from .flags import add_adacheck_args, config_from_args

__all__ = ["add_args", "check_args", "save_checkpoint", "load_checkpoint", "install", "main",
           "adacheck_parse_args", "adacheck_save_checkpoint", "adacheck_load_checkpoint",
           "adacheck_setup_model_and_optimizer", "check_groups", "signature_problem",
           "KNOWN_SIGNATURES"]

# Megatron-LM's arguments restored from a checkpoint by its loader; kept in each AdaCheck
# checkpoint's extra_state under this key.
SAMPLE_COUNTERS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
EXTRA_KEY = "megatron_lm_args"

# Megatron-LM options whose checkpoints AdaCheck does not write (dest, flag).
UNSUPPORTED = (("use_torch_fsdp2", "--use-torch-fsdp2"),
               ("use_megatron_fsdp", "--use-megatron-fsdp"))
# Megatron-LM's non-persistent checkpoints: with --adacheck they go to AdaCheck's memory tier
NON_PERSISTENT = ("non_persistent_save_interval", "--non-persistent-save-interval")

_INSTALLED = "_adacheck_installed"

# ----------------------------------------------------------------------------- Megatron-LM trees

# The process groups Megatron-LM's save_checkpoint / load_checkpoint take (core_v0.19 passes the
# model's pg_collection groups) and core_v0.19's rng_state_key_prefix: see check_groups.
GROUP_PARAMS = ("tp_group", "pp_group", "dp_cp_group", "dp_group", "expt_dp_group")
PREFIX_PARAM = "rng_state_key_prefix"

# What the launcher and the patches rely on in megatron.training, as core_v0.16.1, core_v0.17.1,
# core_v0.18.2 and core_v0.19.0 have it: "module.function": (the accepted lists of its leading
# parameters, by position; the parameters it may have after them). tests/test_megatron_lm_patch.py
# checks each tag's source against this table.
KNOWN_SIGNATURES = {
    "arguments.parse_args": ([("extra_args_provider", "ignore_unknown_args")], ()),
    "checkpointing.save_checkpoint": (
        [("iteration", "model", "optimizer", "opt_param_scheduler",
          "num_floating_point_operations_so_far", "checkpointing_context")],
        ("pipeline_rank", "expert_rank", "tensor_rank", "pipeline_parallel", "expert_parallel",
         "non_persistent_ckpt", "train_data_iterator", "preprocess_common_state_dict_fn",
         "release") + GROUP_PARAMS + (PREFIX_PARAM,)),
    "checkpointing.load_checkpoint": (
        [("ddp_model", "optimizer", "opt_param_scheduler", "load_arg", "strict",
          "checkpointing_context")],
        ("skip_load_to_model_and_opt",) + GROUP_PARAMS + (PREFIX_PARAM,)),
    # core_v0.19 swapped the first two; the wrapper uses only what it returns
    "training.setup_model_and_optimizer": (
        [("model_provider_func", "model_type"), ("model_type", "model_provider_func")],
        ("checkpointing_context", "cfg_container", "pg_collection")),
    "async_utils.maybe_finalize_async_save": ([("blocking", "terminate")], ()),
}


def signature_problem(where: str, params: Sequence[str]) -> Optional[str]:
    """None when ``params`` (the parameter names, in order, of Megatron-LM's
    ``megatron.training.<where>``, a key of :data:`KNOWN_SIGNATURES`) are ones the launcher and
    the patches know; else what differs, in words."""
    leading, rest = KNOWN_SIGNATURES[where]
    params = list(params)
    for lead in leading:
        if tuple(params[:len(lead)]) == lead:
            unknown = [p for p in params[len(lead):] if p not in rest]
            if not unknown:
                return None
            return f"{where}() has parameters AdaCheck does not know: {', '.join(unknown)}"
    return (f"{where}({', '.join(params)}) does not begin with "
            + " or ".join(f"({', '.join(lead)})" for lead in leading))


def _parallel_state_group(name: str):
    from megatron.core import parallel_state as ps
    return {"tp_group": ps.get_tensor_model_parallel_group,
            "pp_group": ps.get_pipeline_model_parallel_group,
            "dp_cp_group": lambda: ps.get_data_parallel_group(with_context_parallel=True),
            "dp_group": ps.get_data_parallel_group,
            "expt_dp_group": ps.get_expert_data_parallel_group}[name]()


def _ranks(group):
    import torch.distributed as dist
    if isinstance(group, (list, tuple)):
        return [_ranks(g) for g in group]
    return list(dist.get_process_group_ranks(group))


def _group_problem(groups: dict) -> Optional[str]:
    prefix = groups.get(PREFIX_PARAM) or ""
    if prefix:
        return (f"{PREFIX_PARAM}={prefix!r} (a model of several parallel grids) is not supported "
                "with --adacheck")
    for name in GROUP_PARAMS:
        given = groups.get(name)
        if given is None:
            continue
        mine = _parallel_state_group(name)
        if given is not mine and _ranks(given) != _ranks(mine):
            return (f"{name} holds ranks {_ranks(given)}, megatron-core's parallel_state group "
                    f"{_ranks(mine)}: AdaCheck saves and loads the parallel_state layout only "
                    "(process groups of a model's own are not supported with --adacheck)")
    return None


def check_groups(groups: dict) -> None:
    """Collectively (every rank calls it, as every rank saves and loads): raise the same
    ConfigError on every rank when, on any rank, Megatron-LM passed ``save_checkpoint`` /
    ``load_checkpoint`` a process group (``GROUP_PARAMS``) whose ranks differ from
    megatron-core's parallel_state group of that name, or a non-empty ``rng_state_key_prefix``.
    AdaCheck's layout, replica choice and exchange use the parallel_state groups; core_v0.19
    passes the model's ``pg_collection`` groups, which hold the same ranks in a run of one
    parallel grid. A group that is None stands for parallel_state's."""
    from .parallel import comm
    problems = comm().all_gather_object(_group_problem(groups))
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise ConfigError(f"AdaCheck (rank {rank}): {problem}")


# ----------------------------------------------------------------------------- arguments

def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--adacheck*`` flags, unless the parser has them already (an extra_args_provider
    that added them, or both the patch and the launcher)."""
    if "--adacheck" not in getattr(parser, "_option_string_actions", {}):
        add_adacheck_args(parser)
    return parser


def _fail(parser: Optional[argparse.ArgumentParser], message: str):
    if parser is not None:
        parser.error(message)            # usage + message on stderr, exit status 2
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


def check_args(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None):
    """Validate the ``--adacheck*`` flags of parsed Megatron-LM ``args`` (a bad value exits
    with a parser error naming the flag); sets ``args.adacheck_config`` (None without
    ``--adacheck``, so native checkpoints never pickle an AdaCheck object) and, with
    ``--adacheck-dir`` alone, ``args.save`` / ``args.load``. Returns ``args``."""
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        _fail(parser, str(e))
    if not cfg.enabled:
        args.adacheck_config = None
        return args
    for dest, flag in UNSUPPORTED:
        if getattr(args, dest, None):
            _fail(parser, f"{flag} is not supported with --adacheck")
    if getattr(args, NON_PERSISTENT[0], None) and not cfg.tiers.memory:
        _fail(parser, f"{NON_PERSISTENT[1]} with --adacheck needs --adacheck-tiers-memory: AdaCheck keeps the "
                      "non-persistent checkpoints in its memory tier (and the persistent ones there and in "
                      "--adacheck-dir)")
    if cfg.online.enabled and getattr(args, "use_precision_aware_optimizer", False):
        # Transformer Engine's FusedAdam reads param.decoupled_grad, which the deltas do not record
        _fail(parser, "--use-precision-aware-optimizer (and --optimizer-cpu-offload, which needs it) is not "
                      "supported with --adacheck-online")
    if cfg.save_dir:
        for dest in ("save", "load"):
            if getattr(args, dest, None) is None:
                setattr(args, dest, cfg.save_dir)
    args.adacheck_config = cfg
    return args


def _config(args):
    cfg = getattr(args, "adacheck_config", None)
    return cfg if cfg is not None else config_from_args(args)


def saving_config(args):
    """The configuration a save uses: the parsed one, with ``async_save`` as Megatron-LM's
    validation left it. Megatron-LM validates after parsing and may turn ``--async-save`` off
    (core_v0.16.1: it needs ``--use-persistent-ckpt-worker``, else "Disabling --async-save");
    AdaCheck then saves synchronously too, as the user was told."""
    cfg = _config(args)
    final = bool(getattr(args, "async_save", cfg.async_save))
    return cfg if final == cfg.async_save else dataclasses.replace(cfg, async_save=final)


def _print_rank0(message: str) -> None:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(message, flush=True)


# ----------------------------------------------------------------------------- save / load

def save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far=0, checkpointing_context=None, *, args,
                    non_persistent_ckpt=False, tp_group=None, pp_group=None, dp_cp_group=None,
                    dp_group=None, expt_dp_group=None, rng_state_key_prefix=""):
    """Megatron-LM's ``save_checkpoint`` with ``--adacheck``: an AdaCheck checkpoint of
    iteration ``iteration`` (with the sample counters); a non-persistent one goes to the memory
    tier only.  Returns None like Megatron-LM's.  The process groups and
    ``rng_state_key_prefix`` are Megatron-LM's (core_v0.19 passes them): :func:`check_groups`
    refuses them unless they are megatron-core's parallel_state groups (or None) and ''."""
    check_groups(dict(tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group,
                      dp_group=dp_group, expt_dp_group=expt_dp_group,
                      rng_state_key_prefix=rng_state_key_prefix))
    from .checkpointing import save_checkpoint as adacheck_save
    adacheck_save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                  checkpointing_context, args=args, config=saving_config(args),
                  extra_state=_extra_state(args, iteration), non_persistent_ckpt=bool(non_persistent_ckpt))
    return None


def _extra_state(args, iteration: int, pending: int = 0) -> dict:
    """Megatron-LM's sample counters at ``iteration`` (``pending``: samples of this iteration
    the training loop has not added yet, for a base taken inside the post-step hook)."""
    counters = {k: getattr(args, k) for k in SAMPLE_COUNTERS if isinstance(getattr(args, k, None), int)}
    if "consumed_train_samples" in counters:
        counters["consumed_train_samples"] += pending
    counters["iteration"] = int(iteration)
    return {EXTRA_KEY: counters}


def setup_hooks(model, optimizer, opt_param_scheduler, args) -> None:
    """After Megatron-LM built the optimizer: the post-step point, and the online mode when
    --adacheck-online is given (its bases carry Megatron-LM's sample counters)."""
    from .hooks import wrap_optimizer_step
    wrap_optimizer_step(optimizer)
    cfg = _config(args)
    if cfg.online.enabled and optimizer is not None:
        from . import online
        on = online.online_of(optimizer)
        if on is None:   # the load inside setup attaches first
            on = online.attach(model, optimizer, opt_param_scheduler, args, cfg)
            on.extra_state = lambda: _extra_state(args, on.iteration, pending=int(args.global_batch_size))
        if on.recorder.base_step is None and isinstance(getattr(args, "iteration", None), int):
            on.iteration = args.iteration   # e.g. a native checkpoint Megatron-LM loaded itself


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
                    checkpointing_context=None, *, args, tp_group=None, pp_group=None,
                    dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix=""):
    """Megatron-LM's ``load_checkpoint`` with ``--adacheck``: ``(iteration,
    num_floating_point_operations_so_far)``, ``(0, 0)`` when there is no checkpoint yet; None
    when the directory holds a native Megatron checkpoint and no AdaCheck one: the caller then
    loads it with Megatron-LM's own code.  The process groups and ``rng_state_key_prefix``:
    as for :func:`save_checkpoint` (refused unless parallel_state's, or None, and '')."""
    check_groups(dict(tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group,
                      dp_group=dp_group, expt_dp_group=expt_dp_group,
                      rng_state_key_prefix=rng_state_key_prefix))
    from .checkpointing import load_checkpoint as adacheck_load, native_checkpoint
    cfg = _config(args)
    load_dir = cfg.save_dir or getattr(args, load_arg, None)
    native = native_checkpoint(load_dir)
    if native is not None:
        _print_rank0(f"AdaCheck: {native} is a native Megatron checkpoint: loading it with "
                     "Megatron-LM's loader; the next save is AdaCheck's")
        return None
    converting = _converting(args)
    if not converting:
        # Megatron-LM loads inside setup_model_and_optimizer: attach the online mode first, so
        # that the load replays its deltas and continues its chain
        setup_hooks(model, optimizer, opt_param_scheduler, args)
    step = getattr(args, "ckpt_step", None)
    iteration, flops, extra = adacheck_load(model, optimizer, opt_param_scheduler, load_arg, strict,
                                            checkpointing_context, args=args, config=cfg,
                                            iteration=None if step is None else int(step),
                                            return_extra_state=True)
    finetune = bool(getattr(args, "finetune", False))
    if iteration and not finetune:
        counters = extra.get(EXTRA_KEY, {})
        for k in SAMPLE_COUNTERS:
            setattr(args, k, int(counters.get(k, 0)))
        # iterations replayed from online deltas after the base consumed one global batch each
        # no batch-size ramp-up with --adacheck-online
        args.consumed_train_samples += (iteration - int(counters.get("iteration", iteration))) * int(
            args.global_batch_size)
        try:
            from megatron.core.num_microbatches_calculator import update_num_microbatches
            update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
        except (ImportError, AssertionError):   # no calculator set up (not a Megatron-LM run)
            pass
        try:
            from megatron.training.checkpointing import set_loaded_iteration
            set_loaded_iteration(iteration)
        except ImportError:
            pass
    if optimizer is not None:
        for group in getattr(optimizer, "param_groups", []):
            group.setdefault("default_config", True)   # as Megatron-LM's loader
    if iteration:
        _print_rank0(f"AdaCheck: loaded iteration {iteration} from {load_dir}")
    if getattr(args, "adacheck_convert_save", None):
        _convert_save_and_exit(iteration, flops, model, optimizer, opt_param_scheduler, args, cfg)
    return iteration, flops


def _converting(args) -> bool:
    """A conversion run: Megatron-LM's --ckpt-convert-format (native output) or
    --adacheck-convert-save (AdaCheck output); it loads, saves once and exits."""
    return bool(getattr(args, "ckpt_convert_format", None) or getattr(args, "adacheck_convert_save", None))


def _convert_save_and_exit(iteration, flops, model, optimizer, opt_param_scheduler, args, cfg) -> None:
    """--adacheck-convert-save DIR: the state just loaded (online deltas replayed) as one AdaCheck
    checkpoint in DIR, then exit, as Megatron-LM's --ckpt-convert-format does."""
    import torch.distributed as dist

    from .checkpointing import save_converted
    if not iteration:
        raise ConfigError(f"--adacheck-convert-save: no checkpoint was loaded from {cfg.save_dir or args.load}")
    save_converted(iteration, model, optimizer, opt_param_scheduler, args.adacheck_convert_save, args=args,
                   config=cfg, flops=flops, extra_state=_extra_state(args, iteration))
    if dist.is_initialized():
        dist.barrier()
    _print_rank0(f"AdaCheck: converted iteration {iteration} -> {args.adacheck_convert_save}")
    sys.exit(0)


# ----------------------------------------------------------------------------- wrappers

def _get_args():
    from megatron.training.global_vars import get_args
    return get_args()


def _mark(wrapper, original):
    wrapper.__wrapped__ = original
    setattr(wrapper, _INSTALLED, True)
    return wrapper


def adacheck_parse_args(original):
    """``parse_args(extra_args_provider=None, ignore_unknown_args=False)`` with the AdaCheck flags."""
    if getattr(original, _INSTALLED, False):
        return original

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *rest, **kwargs):
        seen = {}

        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            seen["parser"] = parser
            return add_args(parser)

        return check_args(original(provider, *rest, **kwargs), seen.get("parser"))

    return _mark(parse_args, original)


def _positional(original, n, a, kw):
    """The first ``n`` parameters of a call of ``original`` (names differ across versions)."""
    bound = inspect.signature(original).bind(*a, **kw)
    bound.apply_defaults()
    return bound.arguments, list(bound.arguments.values())[:n]


_NATIVE = object()   # a delegate's answer: let Megatron-LM's own function do it


def _delegating(original, delegate):
    """``original`` calling ``delegate(named arguments, first six positional values, args)``
    instead when --adacheck is on, unless the delegate answers _NATIVE."""
    if getattr(original, _INSTALLED, False):
        return original

    @functools.wraps(original)
    def wrapper(*a, **kw):
        args = _get_args()
        if getattr(args, "adacheck", False):
            named, first = _positional(original, 6, a, kw)
            out = delegate(named, first, args)
            if out is not _NATIVE:
                return out
        return original(*a, **kw)

    return _mark(wrapper, original)


def adacheck_save_checkpoint(original):
    """Megatron-LM's ``save_checkpoint``, delegating to :func:`save_checkpoint` with --adacheck
    (a non-persistent checkpoint goes to the memory tier only; the save of a
    ``--ckpt-convert-format`` run stays Megatron-LM's: AdaCheck -> native, online deltas replayed
    by the load)."""
    return _delegating(original, lambda named, first, args: _NATIVE if getattr(args, "ckpt_convert_format", None)
                       else save_checkpoint(*first, args=args, **_groups(named),
                                            non_persistent_ckpt=bool(named.get("non_persistent_ckpt", False))))


def _groups(named: dict) -> dict:
    """The process groups and rng_state_key_prefix of a call (those its signature has)."""
    return {k: named[k] for k in GROUP_PARAMS + (PREFIX_PARAM,) if k in named}


def adacheck_load_checkpoint(original):
    """Megatron-LM's ``load_checkpoint``, delegating to :func:`load_checkpoint` with --adacheck
    (a directory without an AdaCheck checkpoint is Megatron-LM's to load)."""
    def delegate(named, first, args):
        loaded = load_checkpoint(*first, args=args, **_groups(named))
        return _NATIVE if loaded is None else loaded
    return _delegating(original, delegate)


def adacheck_setup_model_and_optimizer(original):
    """Megatron-LM's ``setup_model_and_optimizer``; with --adacheck the optimizer it returns
    runs the post-step hooks."""
    if getattr(original, _INSTALLED, False):
        return original

    @functools.wraps(original)
    def wrapper(*a, **kw):
        result = original(*a, **kw)
        args = _get_args()
        if getattr(args, "adacheck", False):
            setup_hooks(result[0], result[1], result[2], args)
        return result

    return _mark(wrapper, original)


def adacheck_finalize_async_save(original):
    """Megatron-LM's ``maybe_finalize_async_save(blocking, terminate)``: its own queue, then (with
    --adacheck --async-save) AdaCheck's save in flight, reported once it has committed, or waited
    for when ``blocking`` (before the next save and at the end of training)."""
    if getattr(original, _INSTALLED, False):
        return original

    @functools.wraps(original)
    def wrapper(*a, **kw):
        out = original(*a, **kw)
        if getattr(_get_args(), "adacheck", False):
            named, _ = _positional(original, 1, a, kw)
            lifecycle.finish_saves(block=bool(named.get("blocking", False)))
        return out

    return _mark(wrapper, original)


def install() -> dict:
    """Install AdaCheck into the imported ``megatron.training`` (idempotent). Returns
    ``{"module.attribute": wrapper}`` for every attribute replaced.  Raises ConfigError, having
    replaced nothing, when a function it replaces has parameters :data:`KNOWN_SIGNATURES` does
    not know (a Megatron-LM tree other than core_v0.16.1 - core_v0.19.0)."""
    import megatron.training  # noqa: F401  (imports arguments, checkpointing, initialize, training)
    from megatron.training import arguments, checkpointing, training
    factories = [(arguments, "parse_args", adacheck_parse_args),
                 (checkpointing, "save_checkpoint", adacheck_save_checkpoint),
                 (checkpointing, "load_checkpoint", adacheck_load_checkpoint),
                 (training, "setup_model_and_optimizer", adacheck_setup_model_and_optimizer)]
    async_utils = sys.modules.get("megatron.training.async_utils")
    if async_utils is not None and hasattr(async_utils, "maybe_finalize_async_save"):
        factories.append((async_utils, "maybe_finalize_async_save", adacheck_finalize_async_save))
    for module, name, _ in factories:
        where = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
        problem = signature_problem(where, inspect.signature(getattr(module, name)).parameters)
        if problem is not None:
            raise ConfigError(f"this Megatron-LM tree is not one AdaCheck knows: "
                              f"megatron.training.{problem}. The launcher and the patches know "
                              "Megatron-LM core_v0.16.1, core_v0.17.1, core_v0.18.2 and "
                              "core_v0.19.0 (patches/README.md)")
    replace = {}
    for module, name, factory in factories:
        original = getattr(module, name)
        wrapped = factory(original)
        if wrapped is not original:
            replace[id(original)] = wrapped
    done = {}
    for modname, module in list(sys.modules.items()):
        if module is None or not (modname == "megatron" or modname.startswith("megatron.")):
            continue
        for attr, value in list(vars(module).items()):
            new = replace.get(id(value))
            if new is not None:
                setattr(module, attr, new)
                done[f"{modname}.{attr}"] = new
    return done


# ----------------------------------------------------------------------------- command line

USAGE = """usage: python -m adacheck_megatron.launch SCRIPT [ARGS...]

Runs a Megatron-LM training script (e.g. pretrain_gpt.py) unpatched, with AdaCheck installed:
its --adacheck* flags, save/load through AdaCheck with --adacheck, and the post-step hooks.
Run it from the Megatron-LM root, or with the Megatron-LM tree on PYTHONPATH."""


def _import_megatron_training() -> Optional[str]:
    """None, or why megatron.training cannot be imported."""
    try:
        import megatron.training  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name in ("megatron", "megatron.training"):
            return ("cannot import megatron.training (Megatron-LM's training package; the "
                    "megatron-core wheel does not have it): run from the Megatron-LM root "
                    "or put the Megatron-LM tree on PYTHONPATH")
        return (f"importing megatron.training failed: {e} (a dependency of Megatron-LM is "
                "missing; install Megatron-LM's requirements)")
    except ImportError as e:
        return f"importing megatron.training failed: {e}"
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"adacheck_megatron.launch: error: no such script: {script}", file=sys.stderr)
        return 2
    script_dir = os.path.dirname(os.path.abspath(script))
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)      # as `python SCRIPT` does (model_provider.py, ...)
    why = _import_megatron_training()
    if why is not None:
        print(f"adacheck_megatron.launch: error: {why}", file=sys.stderr)
        return 2
    try:
        install()
    except ConfigError as e:
        print(f"adacheck_megatron.launch: error: {e}", file=sys.stderr)
        return 2
    sys.argv = [script] + argv[1:]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
