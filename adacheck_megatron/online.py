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
``adacheck_megatron.load_checkpoint`` replays the committed deltas of the base it loaded
(:mod:`adacheck_megatron.replay`).  The online mode of a job sits on its optimizer
(``checkpointing.online_of``): saving and loading find it there.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import weakref
from collections import defaultdict

import torch

from adacheck.online import recorder as online, recovery
from adacheck.errors import ConfigError
from adacheck.online.optimtap import OptimizerTap

from . import hooks, parallel
from .saved import StepScalars
from .state import distributed_optimizers, optimizer_parts
from .checkpointing import ONLINE, checkpointer, online_of, save_checkpoint
from .parallel import load_scheduler, rank_state, topology
from .replay import DENSE_COORDS, EXPERT_COORDS, grad_scalers, kind_of, make_tap, preclip

log = logging.getLogger("adacheck")

# The online modes recording in this process, for the one clipping tap megatron-core's module
# gets (_tap_clipping): it gives each the gradients of the tensors its tap knows.
_RECORDING: "weakref.WeakSet[OnlineMegatron]" = weakref.WeakSet()


def _replica_share(tap: OptimizerTap, optimizer, comm, spread=None) -> set:
    """The gradients this rank writes when every data-parallel rank steps the same (not
    distributed) optimizer: the ranks holding the same gradients under the same names
    (``make_tap``) split them by the balanced plan, so each is stored once per replica group:
    for dense gradients the ranks at the same tensor / pipeline / context-parallel ranks, for
    expert ones those at the same pipeline / expert / expert-TP ranks.  A group also needs the
    same names and sizes (checked: a digest per kind).  An optimizer that is neither kind (its
    param groups not marked) is not split: each rank writes all of its gradients."""
    kinds = {}
    for o in optimizer_parts(optimizer):
        kind = kind_of(o)
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
        coords = DENSE_COORDS if kind == "dense" else EXPERT_COORDS
        group = [r for r, (t, d) in enumerate(alls) if recovery.same_coords(t, alls[me][0], coords) and d.get(kind) == digest[kind]]
        if kind == "expert":    # place() breaks ties towards a group's first rank: start at the other end
            group.reverse()
        mine |= online.replica_share(tap, ks, group, me, spread)
    return mine


class OnlineMegatron:
    def __init__(self, model, optimizer, opt_param_scheduler, args, config):
        if not (config.save_dir or getattr(args, "save", None)):
            raise ConfigError("--adacheck-online needs --adacheck-dir or --save: deltas are written after "
                              "every iteration")
        for o in optimizer_parts(optimizer):
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
        rec = checkpointer(optimizer, config).recording(parallel.comm(), self.save_dir)
        mine = None if distributed_optimizers(optimizer) else _replica_share(self.tap, optimizer, parallel.comm(),
                                                                              rec.spread)
        self.recorder = online.OnlineRecorder(self.tap, config.online, rec, parallel.comm, self._take_base,
                                              fsync=config.fsync, mine=mine, rank_state=rank_state, preclip=preclip)
        _tap_clipping()
        _RECORDING.add(self)
        self._ok = True
        self.extra_state = None     # callable -> dict saved with each base (Megatron-LM counters)
        hooks.wrap_optimizer_step(optimizer)
        hooks.add_post_step_hook(self._post_step)

    def close(self) -> None:
        hooks.remove_post_step_hook(self._post_step)
        self.recorder.close()
        _RECORDING.discard(self)
        if getattr(self.optimizer, ONLINE, None) is self:
            setattr(self.optimizer, ONLINE, None)

    def _post_step(self, optimizer, update_successful: bool) -> None:
        if optimizer is not self.optimizer:
            return
        self.iteration += 1
        self._ok = update_successful
        scalars = StepScalars(iteration=self.iteration, update_successful=bool(update_successful),
                              scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
                              increment=self.increment if update_successful else 0,
                              grad_scalers=grad_scalers(optimizer))
        self.recorder.after_step(self.iteration, scalars.tree())

    def before_clip(self, params, max_norm, total_norm) -> None:
        """Megatron is about to clip these main gradients in place: record them as they are
        (with --grad-reduce-in-bf16 they are exact bf16 values, 2 bytes each; once scaled by
        the clip coefficient they are not) and the norm and limit, so that replay clips them
        again with megatron-core's own function (:func:`preclip`)."""
        norm = float(total_norm)
        if self.tap.replaying or not math.isfinite(norm):
            return      # a norm JSON cannot hold: the clipped gradients are recorded instead
        args = {"norm": norm, "clip": float(max_norm)}
        for p in params:
            self.recorder.note_preclip_of(p, p.grad, args)

    def _take_base(self) -> None:
        """A base at this iteration, as the loop will be once it has stepped the scheduler."""
        sched = self.scheduler
        before = sched.state_dict() if sched is not None else None
        if sched is not None and self._ok:
            sched.step(increment=self.increment)
        try:
            save_checkpoint(self.iteration, self.model, self.optimizer, sched, args=self.args, config=self.config,
                            extra_state=self.extra_state() if self.extra_state is not None else None)
        finally:
            if sched is not None:
                load_scheduler(sched, before)


def attach(model, optimizer, opt_param_scheduler, args, config) -> OnlineMegatron:
    """Start the online mode for this optimizer's training (it replaces one attached before)."""
    old = online_of(optimizer)
    if old is not None:
        old.close()
    on = OnlineMegatron(model, optimizer, opt_param_scheduler, args, config)
    setattr(optimizer, ONLINE, on)
    return on


def _tap_clipping() -> None:
    """Let the active online mode see the gradients before megatron-core clips them.  Every
    optimizer clips through ``clip_grad_by_total_norm_fp32`` as named in
    ``megatron.core.optimizer.optimizer`` (``MegatronOptimizer.clip_grad_norm``, and
    ``ChainedOptimizer.step`` with the global norm); that name is replaced once per process by a
    wrapper that calls :meth:`OnlineMegatron.before_clip`, then the original, unchanged."""
    from megatron.core.optimizer import optimizer as mo
    original = getattr(mo, "clip_grad_by_total_norm_fp32", None)
    if original is None or getattr(original, "_adacheck_original", None) is not None:
        return      # not there: the gradients are recorded as clipped, which replays too

    @functools.wraps(original)
    def clip(parameters, max_norm, total_norm, use_decoupled_grad=False):
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        if not use_decoupled_grad:
            for on in list(_RECORDING):      # each records the gradients of the tensors its tap knows
                on.before_clip(params, max_norm, total_norm)
        return original(params, max_norm, total_norm, use_decoupled_grad)

    clip._adacheck_original = original
    mo.clip_grad_by_total_norm_fp32 = clip


