"""Online gradient deltas for megatron-core training (``--adacheck-online``).

``attach(model, optimizer, opt_param_scheduler, args)`` taps the torch optimizers inside
Megatron's optimizer (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer``, and the parts of a ``ChainedOptimizer``) and uses the one
post-step point (:mod:`adacheck_megatron.hooks`): after every ``optimizer.step()`` the
consumed main gradients and the step's scalars become a delta of the last base checkpoint.
Gradients are recorded before megatron-core clips them (``_tap_clipping``), with the norm,
and clipped again on replay by its own function: with ``--grad-reduce-in-bf16`` they are exact
bf16 values then and take 2 bytes each instead of 4.  The hook runs before the training loop
advances the LR scheduler, so a delta records the scheduler *before* the step plus the
increment the loop applies after a successful step; replay applies it with the scheduler's
own ``step``.

Gradients that data-parallel ranks hold identically (no distributed optimizer) are stored
once per replica group, by a balanced choice of ranks (``_replica_share``); with the
distributed optimizer each rank stores its own shard.  Keys carry the coordinates of the ranks
that hold the same tensor (``make_tap``), so equal keys mean the same tensor.

Bases: every ``--adacheck-online-base-interval`` iterations (taken inside the hook: the
scheduler is advanced for the save and put back, so the base holds exactly the state the
loop will have after this iteration), and every explicit ``save_checkpoint``.  Recovery:
``adacheck_megatron.load_checkpoint`` replays the committed deltas of the base it loaded and
returns the iteration reached: in the saving layout, or with another data-parallel size (every
rank follows a saving rank's record; with the distributed optimizer each rank rebuilds the
saving ranks' shards that overlap its own and steps them: ``_replay_shards``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from collections import defaultdict
from typing import Optional

import torch

from adacheck import online as O
from adacheck.checkpoint import CheckpointReader
from adacheck.errors import ConfigError, StateError
from adacheck.optimtap import OptimizerTap, Shadow
from adacheck.planner import place

from . import hooks
from . import state as S
from .checkpointing import load_scheduler, rank_state, set_rank_state

log = logging.getLogger("adacheck")

_ACTIVE: Optional["OnlineMegatron"] = None


def active() -> Optional["OnlineMegatron"]:
    return _ACTIVE


def _distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return any(isinstance(o, DistributedOptimizer) for o in S.parts(optimizer))


def _kind(part) -> Optional[str]:
    """"dense" or "expert" when every param group of one of Megatron's optimizers says so
    (megatron-core marks each group ``is_expert_parallel``), else None."""
    flags = {g.get("is_expert_parallel") for g in part.optimizer.param_groups}
    return {frozenset([False]): "dense", frozenset([True]): "expert"}.get(frozenset(flags))


def make_tap(optimizer) -> OptimizerTap:
    """Keys name the ranks that hold the same gradient.  Distributed optimizer: this rank's own
    shards (``tp.pp.ep.dp``).  Otherwise the gradients are what Megatron's DDP all-reduced:
    those of the dense optimizer over the data-parallel group (every rank at the same TP / PP
    ranks, over all expert-parallel ranks: ``tp.pp``), those of the expert optimizer over the
    expert data-parallel group (the same PP / expert / expert-TP ranks: ``pp.ep.etp``; the
    expert grid is laid out apart from the dense one).  An optimizer that is neither, and every
    one in records of versions before this naming, uses ``tp.pp.ep`` (kept as the alias that
    reads those records)."""
    from megatron.core import parallel_state as ps
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep, etp = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    old = f"tp{tp}.pp{pp}.ep{ep}."
    parts = S.parts(optimizer)
    if _distributed(optimizer):
        return OptimizerTap([o.optimizer for o in parts], prefix=old + f"dp{ps.get_data_parallel_rank()}.")
    names = {"dense": f"tp{tp}.pp{pp}.", "expert": f"pp{pp}.ep{ep}.etp{etp}."}
    return OptimizerTap([o.optimizer for o in parts], prefix=[names.get(_kind(o), old) for o in parts],
                        aliases=[old] * len(parts))


def _replica_share(tap: OptimizerTap, optimizer, comm) -> set:
    """The gradients this rank writes when every data-parallel rank steps the same (not
    distributed) optimizer: the ranks holding the same gradients under the same names
    (``make_tap``) split them by the balanced plan, so each is stored once per replica group:
    for dense gradients the ranks at the same tensor / pipeline / context-parallel ranks, for
    expert ones those at the same pipeline / expert / expert-TP ranks.  A group also needs the
    same names and sizes (checked: a digest per kind).  An optimizer that is neither kind (its
    param groups not marked) is not split: each rank writes all of its gradients."""
    from .checkpointing import same_coords, topology
    kinds = {}
    for o in S.parts(optimizer):
        kind = _kind(o)
        for g in o.optimizer.param_groups:
            for p in g["params"]:
                kinds[tap.key_of(p)] = kind
    keys = defaultdict(list)
    for k in sorted(tap.tensors):
        keys[kinds.get(k)].append(k)
    digest = {kind: hashlib.sha256(json.dumps([[k, tap.tensors[k].numel()] for k in ks]).encode()).hexdigest()
              for kind, ks in keys.items() if kind is not None}
    alls = comm.all_gather_object([topology(), digest])
    me, mine = comm.rank, set(keys.pop(None, []))
    for kind, ks in keys.items():
        coords = _DENSE_COORDS if kind == "dense" else _EXPERT_COORDS
        group = [r for r, (t, d) in enumerate(alls) if same_coords(t, alls[me][0], coords) and d.get(kind) == digest[kind]]
        if kind == "expert":    # (place() breaks ties towards a group's first rank: start at the other end)
            group.reverse()
        writers, _ = place([(tap.tensors[k].numel() * 4, k, list(range(len(group)))) for k in ks], len(group))
        mine |= {k for k, w in writers.items() if group[w[0]] == me}
    return mine


class OnlineMegatron:
    def __init__(self, model, optimizer, opt_param_scheduler, args, config):
        from .checkpointing import _comm
        if not (config.save_dir or getattr(args, "save", None)):
            raise ConfigError("--adacheck-online needs --adacheck-dir or --save: deltas are written after "
                              "every iteration")
        for o in S.parts(optimizer):
            if getattr(getattr(o, "config", None), "use_precision_aware_optimizer", False):
                raise ConfigError("--adacheck-online does not support --use-precision-aware-optimizer (nor "
                                  "--optimizer-cpu-offload, which needs it): that optimizer takes its gradients "
                                  "from param.decoupled_grad, which the online deltas do not record; drop "
                                  "--adacheck-online or that flag")
        self.model, self.optimizer, self.scheduler = model, optimizer, opt_param_scheduler
        self.args, self.config = args, config
        self.save_dir = config.save_dir or args.save
        self.increment = int(args.global_batch_size)
        self.iteration = 0
        self.tap = make_tap(optimizer)
        mine = None if _distributed(optimizer) else _replica_share(self.tap, optimizer, _comm())
        self.recorder = O.OnlineRecorder(self.tap, config.online, self.save_dir, _comm, self._take_base,
                                         fsync=config.fsync, mine=mine, rank_state=rank_state, preclip=preclip)
        _tap_clipping()
        self._ok = True
        self.extra_state = None     # callable -> dict saved with each base (Megatron-LM counters)
        hooks.wrap_optimizer_step(optimizer)
        hooks.add_post_step_hook(self._post_step)

    def close(self) -> None:
        global _ACTIVE
        hooks.remove_post_step_hook(self._post_step)
        self.recorder.close()
        if _ACTIVE is self:
            _ACTIVE = None

    def _post_step(self, optimizer, update_successful: bool) -> None:
        if optimizer is not self.optimizer:
            return
        self.iteration += 1
        self._ok = update_successful
        scalars = {"iteration": self.iteration, "update_successful": bool(update_successful),
                   "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                   "increment": self.increment if update_successful else 0,
                   "grad_scalers": grad_scalers(optimizer)}
        self.recorder.after_step(self.iteration, scalars)

    def before_clip(self, params, max_norm, total_norm) -> None:
        """Megatron is about to clip these main gradients in place: record them as they are
        (with --grad-reduce-in-bf16 they are exact bf16 values, 2 bytes each; once scaled by
        the clip coefficient they are not) and the norm and limit, so that replay clips them
        again with megatron-core's own function (:func:`preclip`)."""
        norm = float(total_norm)
        if self.tap.replaying or not math.isfinite(norm):
            return      # (a norm JSON cannot hold: the clipped gradients are recorded instead)
        args = {"norm": norm, "clip": float(max_norm)}
        for p in params:
            key = self.tap.key_of(p)
            if key is not None and p.grad is not None:
                self.recorder.note_preclip(key, p.grad, args)

    def _take_base(self) -> None:
        """A base at this iteration, as the loop will be once it has stepped the scheduler."""
        from .checkpointing import save_checkpoint
        sched = self.scheduler
        before = sched.state_dict() if sched is not None else None
        if sched is not None and self._ok:
            sched.step(increment=self.increment)
        t0 = time.perf_counter()
        try:
            save_checkpoint(self.iteration, self.model, self.optimizer, sched, args=self.args, config=self.config,
                            extra_state=self.extra_state() if self.extra_state is not None else None)
        finally:
            if sched is not None:
                load_scheduler(sched, before)
        log.info("AdaCheck online: base checkpoint at iteration %d in %.2fs", self.iteration,
                 time.perf_counter() - t0)


def attach(model, optimizer, opt_param_scheduler, args, config) -> OnlineMegatron:
    """Start the online mode for this training job (one per process)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.close()
    _ACTIVE = OnlineMegatron(model, optimizer, opt_param_scheduler, args, config)
    return _ACTIVE


def saved(save_dir: str, manifest, iteration: int, seconds: float) -> None:
    """Called by save_checkpoint after a commit: that checkpoint is the new base."""
    on = _ACTIVE
    if on is not None and os.path.abspath(save_dir) == os.path.abspath(on.save_dir):
        on.iteration = iteration
        on.recorder.start_chain(manifest.tag, iteration, int(manifest.stats.get("file_bytes", 0)), seconds)


def _tap_clipping() -> None:
    """Let the active online mode see the gradients before megatron-core clips them.  Every
    optimizer clips through ``clip_grad_by_total_norm_fp32`` as named in
    ``megatron.core.optimizer.optimizer`` (``MegatronOptimizer.clip_grad_norm``, and
    ``ChainedOptimizer.step`` with the global norm); that name is replaced once per process by a
    wrapper that calls :meth:`OnlineMegatron.before_clip`, then the original, unchanged."""
    from megatron.core.optimizer import optimizer as mo
    original = getattr(mo, "clip_grad_by_total_norm_fp32", None)
    if original is None or getattr(original, "_adacheck_original", None) is not None:
        return      # (not there: the gradients are recorded as clipped, which replays too)

    @functools.wraps(original)
    def clip(parameters, max_norm, total_norm, use_decoupled_grad=False):
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        on = _ACTIVE
        if on is not None and not use_decoupled_grad:
            on.before_clip(params, max_norm, total_norm)
        return original(params, max_norm, total_norm, use_decoupled_grad)

    clip._adacheck_original = original
    mo.clip_grad_by_total_norm_fp32 = clip


def preclip(key: str, grad: torch.Tensor, args: dict) -> None:
    """Clip a recorded pre-clip gradient in place as Megatron did (its own function, with the
    recorded norm and limit; elementwise, so one tensor at a time gives the same bits)."""
    from megatron.core.optimizer import clip_grads
    holder = grad.view(grad.shape)
    holder.grad = grad
    clip_grads.clip_grad_by_total_norm_fp32([holder], args["clip"], args["norm"])


def grad_scalers(optimizer) -> list:
    """fp16: each part's loss scale and its growth / hysteresis trackers after the step (a skipped
    step changes only these), to be set again after replay."""
    return [o.grad_scaler.state_dict() if getattr(o, "grad_scaler", None) is not None else None
            for o in S.parts(optimizer)]


def set_grad_scalers(optimizer, saved) -> None:
    for o, sd in zip(S.parts(optimizer), saved or []):
        if sd is not None and getattr(o, "grad_scaler", None) is not None:
            o.grad_scaler.load_state_dict(sd)


def _replay_shards(comm, tap: OptimizerTap, ckpt_dir: str, manifest, steps, model, optimizer, verify: bool) -> dict:
    """Replay deltas of the distributed optimizer recorded on another number of data-parallel
    ranks (``O.replay_partitions``): the saving ranks' main-parameter shards of the same
    replicas (below) that overlap this rank's are rebuilt from the base, stepped
    with their records, and the ranges this rank holds now are copied into its main weights
    and optimizer state.  ``Replayed.last`` is the last record."""
    from .checkpointing import same_coords, sharded_state_dict, topology
    topo = topology()
    saved = manifest.layout.get("ranks", [])
    subs = S.distributed_optimizers(optimizer)
    by_param = S._param_to_sharded(sharded_state_dict(model, optimizer, is_loading=True, with_optimizer=False))
    metas = {S.param_ident(m): m for m in by_param.values()}
    held = [(O.Span((oi, S.param_ident(S._model_meta(by_param, model_param))), a, b - a, 0), (oi, model_param))
            for oi, opt in enumerate(subs) for model_param, a, b in S._local_ranges(opt)]
    # the saving ranks that held the same replicas: for dense parameters those at this rank's
    # tensor / pipeline / context-parallel ranks (over every expert-parallel rank: the dense
    # data-parallel group spans them), for expert-parallel ones those at its pipeline,
    # expert-parallel and expert-tensor-parallel ranks (the expert grid is laid out apart from
    # the dense one: a rank's tensor- and expert-tensor-parallel ranks may differ)
    saving = {}
    for r, ro in enumerate(manifest.rank_objects):
        got = {k: [_shard_span(v)] for k, v in ro["partitions"].items()
               if same_coords(saved[r], topo, _EXPERT_COORDS if v.get("expert") else _DENSE_COORDS)}
        if got:
            saving[r] = got

    # per optimizer: its state names and the step count every shard shares (after the base load)
    names, steps_of = [], []
    for opt in subs:
        st = next((v for v in opt.optimizer.state.values() if v), {})
        names.append(sorted(x for x in st if x != "step"))
        steps_of.append(st.get("step"))
    device = next(p for g in optimizer.param_groups for p in g["params"]).device
    readers = []

    def rebuild(r: int) -> Shadow:
        if not readers:
            readers.append(CheckpointReader(ckpt_dir, manifest, verify=verify))
        never = readers[0].objects().get("optimizer_never_stepped") or []
        tensors, state = {}, [defaultdict(dict) for _ in subs]
        for k, (sp,) in saving[r].items():
            oi, name = sp.name
            if name not in metas:
                raise StateError(f"saving rank {r}'s optimizer shard of {name} is not a parameter of this model")
            fresh = never[oi] if oi < len(never) else False
            got = S.distopt_read_shard(readers[0], metas[name], sp.start, sp.start + sp.numel,
                                       ["param"] + ([] if fresh else names[oi]))
            tensors[k] = got.pop("param").to(device)
            if got:
                state[oi][tensors[k]] = dict({x: v.to(device) for x, v in got.items()}, step=steps_of[oi].clone())
        return Shadow.given(tensors, state)

    @torch.no_grad()
    def put(sink, shadow: Shadow, key: str, src: int, at: int, n: int) -> None:
        oi, model_param = sink
        t = shadow.tensors[key]
        st = shadow.state[oi].get(t, {})
        live = subs[oi]._get_main_param_and_optimizer_states(model_param)
        if st and "exp_avg" not in live:      # the base had applied no update yet
            S.init_empty_state([subs[oi]])
            live = subs[oi]._get_main_param_and_optimizer_states(model_param)
        for x in live:
            value = t if x == "param" else st.get(x)
            if x != "step" and value is not None:
                live[x].view(-1)[at:at + n].copy_(value.view(-1)[src:src + n])
        if "step" in st:
            subs[oi].optimizer.state[live["param"]]["step"] = st["step"].clone()

    return O.replay_partitions(comm, tap, ckpt_dir, steps, saving, held, rebuild, put,
                               min(saving, default=0), verify=verify, preclip=preclip, expect=EXPECT)


def _optional(kind):
    return lambda v: v is None or isinstance(v, kind)


# the fields of a delta record that recover() restores (written by OnlineMegatron._post_step)
EXPECT = {"iteration": (O.is_int, "an integer"), "increment": (O.is_int, "an integer"),
          "scheduler": (_optional(dict), "the scheduler's state (an object) or null"),
          "grad_scalers": (_optional(list), "a list of loss-scaler states or null")}

_DENSE_COORDS = ("tp_rank", "pp_rank", "cp_rank")
_EXPERT_COORDS = ("pp_rank", "ep_rank", "etp_rank")


def _shard_span(v: dict) -> O.Span:
    """A saved shard (``S.distopt_partition_map``: one range of one parameter), named by its
    optimizer and parameter."""
    (name, start, numel, offset), = v["pieces"]
    return O.Span((int(v["optimizer"]), name), start, numel, offset)


@torch.no_grad()
def _refresh_model_params(optimizer) -> None:
    """Model weights from the main weights, with megatron-core's own code (and the
    distributed optimizer's parameter all-gather)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer
    for o in S.parts(optimizer):
        if isinstance(o, FP32Optimizer):
            continue
        o._copy_main_params_to_model_params()
        if isinstance(o, DistributedOptimizer):
            for chunk in o.model_chunks:
                chunk.start_param_sync(force_sync=True)


def recover(comm, ckpt_dir: str, manifest, model, optimizer, opt_param_scheduler, latest: bool,
            same_layout: bool, iteration: int, until: Optional[int] = None,
            record_rank: Optional[int] = None, shards: bool = False, verify: bool = True,
            strict: bool = True) -> int:
    """Replay the committed deltas of the base just loaded (collective), all of them or those up
    to iteration ``until``; returns the iteration. ``record_rank``: the saving job's rank whose
    records this rank follows when the layout differs only in data-parallel size and every
    data-parallel rank ran the same optimizer (see checkpointing.replay_rank); ``shards``: the
    layout differs only in data-parallel size and the distributed optimizer's shards are
    rebuilt (``_replay_shards``); neither: replay only in the saving layout.  ``strict``: damaged
    deltas fail the load (after the job holds the last intact step); else it goes on from there
    with a warning."""
    on = _ACTIVE if (_ACTIVE is not None and _ACTIVE.optimizer is optimizer) else None
    world = int(manifest.topology.get("world_size", 1))
    steps, why, damage = O.chain(comm, ckpt_dir, manifest.step, world, until=until, strict=strict)
    if until is not None and damage is None and until != (steps[-1].step if steps else manifest.step):
        raise ConfigError(f"{ckpt_dir} (iteration {manifest.step}) does not reach iteration {until} with "
                          f"committed online deltas")
    if steps and not same_layout and record_rank is None and not shards:
        where = ("only in the saving layout or on another number of data-parallel ranks (with the distributed "
                 "optimizer: from a base saved by this version; with expert parallelism and expert tensor "
                 "parallelism > 1, from a base that recorded each rank's expert-tensor-parallel rank)")
        if until is not None and until != manifest.step:
            raise ConfigError(f"iteration {until} is reached by replaying the online deltas of {ckpt_dir}, which "
                              f"replay {where}; load it with that layout (and save to reshape)")
        log.warning("AdaCheck: %s has %d committed delta iterations (to %d); they replay %s, so this job starts "
                    "from the base's iteration %d", ckpt_dir, len(steps), steps[-1].step, where, manifest.step)
        steps = []
    result = None
    if steps:
        tap = on.tap if on is not None else make_tap(optimizer)
        t0 = time.perf_counter()
        try:
            if shards:
                result = _replay_shards(comm, tap, ckpt_dir, manifest, steps, model, optimizer, verify)
            else:
                result = O.replay(comm, tap, ckpt_dir, steps, verify=verify, preclip=preclip,
                                  record_rank=comm.rank if same_layout else record_rank, expect=EXPECT)
        finally:
            if on is None:
                tap.remove()
        last = result.last
        if last is not None:
            _refresh_model_params(optimizer)
            set_grad_scalers(optimizer, last.get("grad_scalers"))
            if opt_param_scheduler is not None and last.get("scheduler") is not None:
                load_scheduler(opt_param_scheduler, last["scheduler"])
                if last["increment"]:
                    opt_param_scheduler.step(increment=last["increment"])
            if same_layout:   # (as the base load: RNG states belong to the saving layout)
                set_rank_state(last["rank_state"])
            iteration = int(last["iteration"])
            O.describe_replay(result.steps, manifest.step, time.perf_counter() - t0, why)
    damaged = damage is not None or (result is not None and result.damage is not None)
    if on is not None:
        on.iteration = iteration
        on.tap.reindex()
        if latest and same_layout and not damaged and \
                os.path.abspath(os.path.dirname(ckpt_dir)) == os.path.abspath(on.save_dir):
            on.recorder.start_chain(manifest.tag, int(manifest.step), resume_after=iteration)
        else:
            on.recorder.base_step = None      # (a damaged chain is left as it is: the next step takes a base)
    (result or O.Replayed([], None)).conclude(strict, ckpt_dir, manifest.step, damage)
    return iteration
