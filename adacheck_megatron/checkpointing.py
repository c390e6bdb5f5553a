"""AdaCheck's save_checkpoint / load_checkpoint with Megatron-LM's contract.

    save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far=0, args=...)
    iteration, flops = load_checkpoint(model, optimizer, opt_param_scheduler, args=...)

``model`` is the list of model chunks (DDP-wrapped, one per virtual pipeline stage),
``optimizer`` a megatron-core optimizer (FP32Optimizer, Float16OptimizerWithFloat16Params,
DistributedOptimizer or a ChainedOptimizer of them), ``args`` the training arguments with
the ``--adacheck*`` flags (Megatron-LM's ``get_args()`` when not given). The checkpoint
goes to ``--adacheck-dir`` (else ``--save``) as ``iter_0000123``; ``latest`` names the
newest complete one. What is saved is what megatron-core's ``sharded_state_dict`` describes
(model, optimizer with fp32 masters and moments, DistributedOptimizer included), plus the
iteration, the LR scheduler, the FLOPs counter, a JSON-able copy of the arguments and, per
rank, the RNG states (python, numpy, torch, and the model-parallel RNG tracker).

A checkpoint loads into any (TP, PP, EP, DP, distributed optimizer or not) layout of the
same model: every logical tensor is read by box. RNG states are restored only into the
layout that saved them (as Megatron-LM does); elsewhere a warning says they were skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from adacheck.compat import not_installed

try:
    import megatron.core
except ModuleNotFoundError as e:
    raise not_installed(e, "megatron", "megatron-core", "megatron") from None

import adacheck
from adacheck import checkpoint as core, jobs
from adacheck.integration import LocalState, Restore
from adacheck.online import recovery
from adacheck.cli.convert import refuse_existing
from adacheck.storage.backends import is_url
from adacheck.config import AdaCheckConfig
from adacheck.online.deltas import base_for_step
from adacheck.errors import ConfigError
from adacheck.types import Manifest

from . import parallel
from .saved import Objects, RankObjects, tracked_checkpoint
from .state import (MASTER_PREFIX, describe, distopt_apply, distopt_describe, distopt_partition_map, distopt_refresh,
                    distopt_refreshed, distopt_set_main, distopt_stage_load, distopt_stage_main, distributed_optimizers,
                    drop_fresh_state, never_stepped, stage_load, saved_objects)
from .flags import config_from_args
from .hooks import add_post_step_hook, wrap_optimizer_step
from .parallel import (SIZES, chunk_key, is_same_layout, json_args, layout_name, load_scheduler,
                       main_replica_ranks, rank_state, replica_ranks, set_rank_state, sharded_state_dict, sync_params, topology,
                       unwrap)
from .replay import Replay

# The online mode of a job (adacheck_megatron.online) sits on its optimizer under this name.
ONLINE = "adacheck_online"


def online_of(optimizer):
    """The online mode recording this optimizer's steps, if one was attached."""
    return getattr(optimizer, ONLINE, None) if optimizer is not None else None


def checkpointer(optimizer, config: AdaCheckConfig) -> core.Checkpointer:
    """This job's Checkpointer (its caches, its asynchronous save in flight) with the options of
    ``config``: kept on its optimizer, not on args, which Megatron-LM pickles into its checkpoints."""
    return jobs.kept_on(optimizer, core.Options.from_config(config))


def poll_async_save(optimizer, update_successful: bool = True) -> None:
    """Post-step hook: report this job's asynchronous save once it has committed (cheap)."""
    job = jobs.kept(optimizer)
    if job is not None:
        job.poll()


log = logging.getLogger("adacheck")

def _args(args):
    if args is not None:
        return args
    try:
        from megatron.training import get_args   # Megatron-LM's global arguments
    except ImportError:
        raise ConfigError("adacheck_megatron needs the training arguments: pass args=... "
                          "(Megatron-LM's megatron.training is not importable here)") from None
    return get_args()


def _config(args, config: Optional[AdaCheckConfig]) -> AdaCheckConfig:
    return config if config is not None else config_from_args(args)


# ---------------------------------------------------------------------------------- save

def save_checkpoint(iteration: int, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far: float = 0, checkpointing_context=None,
                    *, args: Optional[argparse.Namespace] = None, config: Optional[AdaCheckConfig] = None,
                    extra_state: Optional[dict] = None, non_persistent_ckpt: bool = False) -> Optional[Manifest]:
    """Collectively save an AdaCheck checkpoint of iteration ``iteration`` (Megatron-LM's
    ``save_checkpoint`` contract).

    With the memory tier and Megatron-LM's ``--non-persistent-save-interval``: a
    ``non_persistent_ckpt`` goes to the memory tier only, every other save to the memory tier
    and, at once, to the checkpoint directory (``--adacheck-tiers-persist-interval`` then
    does not apply); without that flag, every ``persist_interval``-th is copied there.

    Args:
        iteration: the training iteration saved (the tag ``iter_<7 digits>``).
        model, optimizer, opt_param_scheduler: the job's, as Megatron-LM passes them.
        num_floating_point_operations_so_far: kept, and returned by the load.
        checkpointing_context: accepted for Megatron-LM's signature; not used.
        args: the training arguments (default: Megatron-LM's global ones).
        config: the AdaCheck options (default: from ``args``' ``--adacheck-*`` flags).
        extra_state: more JSON-able values / tensors to keep (rank 0's copy), returned by
            ``load_checkpoint(..., return_extra_state=True)``.
        non_persistent_ckpt: a save for the memory tier only (above).

    Returns:
        Its manifest; None for an asynchronous save (``--async-save``: it commits in the
        background; the optimizer's steps report it, the next save or load and the exit wait
        for it).
    """
    args = _args(args)
    cfg = _config(args, config)
    save_dir = cfg.directory(getattr(args, "save", None), "save", "--adacheck-dir or --save")
    t0 = time.perf_counter()
    comm = parallel.comm()
    on = online_of(optimizer)
    sync_params(model)

    def collect():
        topo = topology()
        sd = sharded_state_dict(model, optimizer, is_loading=False)
        distopt = None
        if optimizer is not None and distributed_optimizers(optimizer):
            dshards, distopt = distopt_describe(optimizer, sd)
        shards, sharded_objects, common = describe(sd)
        if distopt is not None:
            shards += dshards
        objects = Objects(
            common=common, iteration=int(iteration),
            opt_param_scheduler=opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
            num_floating_point_operations_so_far=float(num_floating_point_operations_so_far),
            args=json_args(args), extra_state=extra_state or {}, distributed_optimizer=distopt,
            optimizer_never_stepped=never_stepped(optimizer) if optimizer is not None else [])
        framework = {"name": "megatron", "megatron_core": megatron.core.__version__,
                     "torch": torch.__version__, "adacheck": adacheck.__version__,
                     "layout": {k: topo[k] for k in SIZES},
                     "dtype": "bf16" if getattr(args, "bf16", False) else
                              "fp16" if getattr(args, "fp16", False) else "fp32",
                     "distributed_optimizer": bool(getattr(args, "use_distributed_optimizer", False)),
                     "model_chunks": len(list(model)),
                     "names": {"model": "", "master": MASTER_PREFIX}}
        rank_objects = RankObjects(rng=rank_state(), sharded_objects=sharded_objects)
        if distopt is not None and on is not None:
            # what this rank's shards are: its deltas replay on another data-parallel size too
            rank_objects.partitions = distopt_partition_map(optimizer, sd, on.tap.key_of)
        return LocalState(
            shards=shards, objects=objects.tree(),
            rank_objects=rank_objects.tree(),
            layout=topo, framework=framework, step=int(iteration))

    job, tag = checkpointer(optimizer, cfg), f"iter_{int(iteration):07d}"
    # the core refuses a non-persistent save without the memory tier
    persist = None
    if non_persistent_ckpt or (cfg.tiers.memory and getattr(args, "non_persistent_save_interval", None)):
        persist = not non_persistent_ckpt
    if cfg.async_save and on is None and optimizer is not None:
        # with online deltas the bases stay synchronous: the next steps' deltas need them committed
        wrap_optimizer_step(optimizer)
        add_post_step_hook(poll_async_save)
        job.save_async(comm, save_dir, tag, collect, persist=persist)
        if comm.rank == 0:
            log.info("AdaCheck: iteration %d snapshotted in %.2fs; %s commits in the background", iteration,
                     time.perf_counter() - t0, tag)
        return None
    manifest = job.save(comm, save_dir, tag, collect, recorder=on.recorder if on is not None else None,
                        persist=persist)
    if on is not None and on.recorder.base_tag == manifest.tag:
        on.iteration = int(iteration)    # the new base of its chain
    if comm.rank == 0:
        st = manifest.stats
        log.info("AdaCheck: saved iteration %d to %s in %.2fs (%d bytes written, %d referenced)",
                 iteration, os.path.join(save_dir, manifest.tag), time.perf_counter() - t0,
                 st.get("file_bytes", 0), st.get("referenced_bytes", 0))
    return manifest


# ---------------------------------------------------------------------------------- load

def refuse_existing_output(target: str) -> None:
    """A conversion run never writes over a checkpoint: every rank looks at ``target`` before
    any rank writes (one barrier), and all raise the same ConfigError if it exists."""
    refuse_existing(target, barrier=parallel.comm().barrier)


def save_converted(iteration: int, model, optimizer, opt_param_scheduler, out_dir: str, *,
                   args: argparse.Namespace, config: AdaCheckConfig, flops: float = 0,
                   extra_state: Optional[dict] = None) -> Manifest:
    """``--adacheck-convert-save DIR``: the state just loaded (online deltas replayed) as one
    AdaCheck checkpoint in ``out_dir``, without online recording; refused when ``out_dir``
    already holds that iteration."""
    refuse_existing_output(os.path.join(out_dir, f"iter_{int(iteration):07d}"))
    cfg = dataclasses.replace(config, save_dir=out_dir, async_save=False,
                              online=dataclasses.replace(config.online, enabled=False))
    return save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops, None, args=args, config=cfg,
                           extra_state=extra_state)


def native_checkpoint(load_dir: Optional[str]) -> Optional[str]:
    """The Megatron (torch_dist / legacy) checkpoint to load instead, when ``load_dir`` holds
    one and no AdaCheck checkpoint: an existing run switching to AdaCheck loads its last
    native checkpoint with Megatron's own loader; the next save is AdaCheck's."""
    if not load_dir or is_url(load_dir) or os.path.exists(os.path.join(load_dir, "latest")):
        return None
    return tracked_checkpoint(load_dir)


@dataclass
class Staged:
    """What a load read on this rank, before anything is applied."""
    objects: Objects                   # the checkpoint's objects (iteration, scheduler, ...)
    state: dict                        # the plain state dict to load (model chunks, plain optimizer)
    rng: Optional[dict]                # this rank's RNG states (None: not restored)
    missing: list                      # tensors not in the checkpoint (strict=False): kept as they are
    distopt: Optional[list]            # the DistributedOptimizers' state (with the optimizer state)
    refreshed: set                     # parameters megatron-core makes from the main weights (not read)
    mains: Optional[list]              # the main-weight shards alone (a load of the weights only)


class _Load(Restore):
    """One load into this job's model, optimizer and scheduler: what each rank reads before anything
    is applied (``read``), applies (``apply``), and takes back when any rank failed (``undo``).
    Honours ``--no-load-optim``, ``--no-load-rng`` and ``--finetune`` (weights only)."""

    def __init__(self, model, optimizer, opt_param_scheduler, args, strict: bool, comm):
        self.model, self.optimizer, self.scheduler, self.args, self.strict, self.comm = (
            model, optimizer, opt_param_scheduler, args, strict, comm)
        # ShardedObjects whose main replica another rank saved
        self.reads_objects_of = main_replica_ranks()
        finetune = bool(getattr(args, "finetune", False))
        self.load_optim = not finetune and not getattr(args, "no_load_optim", False)
        self.load_rng = not finetune and not getattr(args, "no_load_rng", False)
        # building the state dict to load into creates a never-stepped optimizer's state (as Megatron
        # does); if the load fails on any rank, every rank removes that state again (undo), so training
        # goes on exactly as before the failed load
        self.inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])
                      if getattr(o, "optimizer", None) is not None] if optimizer is not None else []
        self.empty = [[p for p, st in o.state.items() if not st] + [p for g in o.param_groups for p in g["params"]
                                                                    if p not in o.state] for o in self.inner]

    def how_to_load(self, tag: str, manifest) -> str:
        """How a Megatron-LM user loads checkpoint ``tag`` (error messages)."""
        return (f"--ckpt-step {manifest.step} (load_checkpoint(..., iteration={manifest.step}))"
                if manifest.step is not None else f"load_checkpoint(..., tag={tag!r})")

    def undo(self) -> None:
        for o, params in zip(self.inner, self.empty):
            for p in params:
                o.state.pop(p, None)

    def read(self, r: core.CheckpointReader) -> Staged:
        model, optimizer, comm, load_optim = self.model, self.optimizer, self.comm, self.load_optim
        objects = Objects.of(r.objects(), f"the objects of {r.dir}")
        saved_layout = r.manifest.layout.get("ranks", [])
        same = is_same_layout(saved_layout, topology(), comm.world_size, comm.rank)
        sharded_objects = saved_objects(r, (comm.rank, *replica_ranks()) if same else ())
        sd = sharded_state_dict(model, optimizer, is_loading=True, with_optimizer=load_optim)
        with_distopt = optimizer is not None and bool(distributed_optimizers(optimizer))
        dist = load_optim and with_distopt
        saved_dist = objects.distributed_optimizer is not None
        if load_optim and optimizer is not None and dist != saved_dist:
            raise ConfigError(
                f"{r.dir} was saved {'with' if saved_dist else 'without'} the distributed optimizer "
                f"and this job runs {'with' if dist else 'without'} it; their optimizer states are "
                "laid out differently (not supported yet): match --use-distributed-optimizer, or "
                "load the weights only with --no-load-optim")
        dstaged = distopt_stage_load(optimizer, sd, r, objects.distributed_optimizer) if dist else None
        # module weights saved as their main weights' casts: megatron-core makes them in apply() from
        # the main weights this rank loads (with the optimizer state, or alone: its own shard, not
        # the whole model's main weights that rebuilding the module weights would read)
        unread = distopt_refreshed(optimizer, model, sd, r) if with_distopt else set()
        mains = distopt_stage_main(optimizer, sd, r) if unread and not load_optim else None
        # an optimizer that had applied no update when saved has no moments in the checkpoint;
        # the state Megatron creates for loading is dropped again in apply()
        fresh = load_optim and not dist and any(objects.optimizer_never_stepped)
        state, missing = stage_load(sd, r, objects.common, sharded_objects, strict=self.strict,
                                    absent=("optimizer.state.",) if fresh else (), unread=unread)
        rng = None
        if self.load_rng:
            if same:
                rng = RankObjects.of(r.objects(comm.rank), f"rank {comm.rank}'s objects of {r.dir}").rng
            elif comm.rank == 0:
                saved = layout_name(saved_layout[0]) if saved_layout else "?"
                warnings.warn(f"AdaCheck: RNG states not restored: the checkpoint was saved with "
                              f"{saved} on {len(saved_layout)} ranks, this job runs "
                              f"{layout_name(topology())} on {comm.world_size}")
        return Staged(objects, state, rng, missing, dstaged, unread, mains)

    def apply(self, staged: Staged) -> Objects:
        optimizer, args, objects = self.optimizer, self.args, staged.objects
        chunks = list(self.model)
        for i, chunk in enumerate(chunks):
            unwrap(chunk).load_state_dict(staged.state[chunk_key(i, len(chunks))], strict=self.strict)
        if staged.mains is not None:       # collective, as below
            distopt_set_main(optimizer, staged.mains)
            distopt_refresh(optimizer, chunks)
        if not self.load_optim and optimizer is not None and hasattr(optimizer, "reload_model_params") and (
                getattr(args, "fp16", False) or getattr(args, "bf16", False)):
            optimizer.reload_model_params()   # fp32 masters from the loaded weights, as Megatron-LM
        if self.load_optim and optimizer is not None:
            if staged.distopt is not None:
                distopt_apply(optimizer, staged.distopt, objects.distributed_optimizer,
                              objects.optimizer_never_stepped)
                if staged.refreshed:      # collective: every rank decided the same from the manifest
                    distopt_refresh(optimizer, chunks)
            else:
                if any(objects.optimizer_never_stepped):     # exactly as saved: the first update creates the state
                    drop_fresh_state(staged.state["optimizer"], objects.optimizer_never_stepped)
                optimizer.load_state_dict(staged.state["optimizer"])
            if self.scheduler is not None and objects.opt_param_scheduler is not None:
                load_scheduler(self.scheduler, objects.opt_param_scheduler)
        if staged.rng is not None:
            set_rank_state(staged.rng)
        if staged.missing and self.comm.rank == 0:
            warnings.warn(f"AdaCheck: {len(staged.missing)} tensors not in the checkpoint kept their "
                          f"current values: {staged.missing[:8]}")
        return objects


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg: str = "load", strict: bool = True,
                    checkpointing_context=None, *, args: Optional[argparse.Namespace] = None,
                    config: Optional[AdaCheckConfig] = None, tag: Optional[str] = None,
                    return_extra_state: bool = False, iteration: Optional[int] = None):
    """Load the newest complete checkpoint (or ``tag``) into this layout (Megatron-LM's
    ``load_checkpoint`` contract). Honours ``--no-load-optim``, ``--no-load-rng`` and
    ``--finetune`` (weights only, iteration 0).

    Args:
        model, optimizer, opt_param_scheduler: the job's, as Megatron-LM passes them.
        load_arg: the argument naming the directory (``load``; ``pretrained_checkpoint``...).
        strict: every model tensor must be in the checkpoint.
        checkpointing_context: accepted for Megatron-LM's signature; not used.
        args, config: as for :func:`save_checkpoint`.
        tag: the checkpoint to load (default: the newest complete one).
        return_extra_state: also return the saved ``extra_state``.
        iteration: load that iteration instead: the newest checkpoint that holds it, or whose
            committed online deltas reach it (replayed up to it; same layout only).

    Returns:
        ``(iteration, num_floating_point_operations_so_far)``, ``(0, 0)`` when the directory
        holds no checkpoint yet; with ``return_extra_state`` a third item, ``extra_state``.
    """
    args = _args(args)
    cfg = _config(args, config)
    load_dir = cfg.directory(getattr(args, load_arg, None), "load", f"--adacheck-dir or --{load_arg}")
    job = checkpointer(optimizer, cfg)
    store, where = job.locate(load_dir)
    until = None
    if iteration is not None:
        if tag is not None:
            raise ConfigError("load_checkpoint takes a tag or an iteration, not both")
        tag, until = base_for_step(where, int(iteration), store), int(iteration)
    if tag is None and not job.has_checkpoint(load_dir, parallel.comm()):
        # complete checkpoints without a 'latest': the load names them, see checkpoint.resolve
        log.warning("AdaCheck: no checkpoint in %s; training from scratch", load_dir)
        return (0, 0, {}) if return_extra_state else (0, 0)
    finetune = bool(getattr(args, "finetune", False))
    comm = parallel.comm()
    t0 = time.perf_counter()
    loading = _Load(model, optimizer, opt_param_scheduler, args, strict, comm)
    loaded = job.load(comm, load_dir, tag, loading)
    ckpt_dir, objects = loaded.ckpt_dir, loaded.result
    iteration = 0 if finetune else objects.iteration
    on = online_of(optimizer)
    replay = (Replay(comm, model, optimizer, opt_param_scheduler, objects)
              if loading.load_optim and opt_param_scheduler is not None else None)
    done = recovery.after_load(comm, job, loaded, replay, until=until,
                               without="the optimizer state (not with --no-load-optim / --finetune)",
                               recorder=on.recorder if on is not None else None)
    iteration = done.step if done.steps else iteration
    if on is not None and replay is not None:
        on.iteration = iteration
    flops = 0 if finetune else objects.num_floating_point_operations_so_far
    if comm.rank == 0:
        log.info("AdaCheck: loaded %s (iteration %s) in %.2fs", ckpt_dir, objects.iteration,
                 time.perf_counter() - t0)
    if return_extra_state:
        return iteration, flops, objects.extra_state
    return iteration, flops
