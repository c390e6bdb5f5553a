"""Recovery of Megatron online deltas: the optimizer tap that names every tensor the same way in
the recording and the recovering job (``make_tap``), megatron-core's clipping applied again
(``preclip``), and :class:`Replay`, which tells :func:`adacheck.online.recovery.recover` how a base's
committed deltas replay in this job: in the saving layout, on another number of data-parallel
ranks following a saving rank's record, or with the distributed optimizer rebuilding the
saving ranks' shards (``Replay._shards``)."""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer

from adacheck import integration
from adacheck.online import recovery
from adacheck.errors import StateError
from adacheck.online.optimtap import OptimizerTap, Shadow

from .saved import Objects, RankObjects, StepScalars
from .state import (distopt_read_shard, distributed_optimizers, init_empty_state, local_ranges, model_meta,
                    optimizer_parts, param_ident, param_to_sharded)
from .parallel import (COORDS, SIZES, is_same_layout, layout_name, load_scheduler, set_rank_state,
                       sharded_state_dict, topology)

log = logging.getLogger("adacheck")


def kind_of(part) -> Optional[str]:
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
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep, etp = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    old = f"tp{tp}.pp{pp}.ep{ep}."
    parts = optimizer_parts(optimizer)
    if distributed_optimizers(optimizer):
        return OptimizerTap([o.optimizer for o in parts], prefix=old + f"dp{ps.get_data_parallel_rank()}.")
    names = {"dense": f"tp{tp}.pp{pp}.", "expert": f"pp{pp}.ep{ep}.etp{etp}."}
    return OptimizerTap([o.optimizer for o in parts], prefix=[names.get(kind_of(o), old) for o in parts],
                        aliases=[old] * len(parts))


def preclip(key: str, grad: torch.Tensor, args: dict) -> None:
    """Clip a recorded pre-clip gradient in place as Megatron did (its own function, with the
    recorded norm and limit; elementwise, so one tensor at a time gives the same bits)."""
    clip_grads.clip_grad_by_total_norm_fp32([recovery.holder(grad)], args["clip"], args["norm"])


def grad_scalers(optimizer) -> list:
    """fp16: each part's loss scale and its growth / hysteresis trackers after the step (a skipped
    step changes only these), to be set again after replay."""
    return [o.grad_scaler.state_dict() if getattr(o, "grad_scaler", None) is not None else None
            for o in optimizer_parts(optimizer)]


def set_grad_scalers(optimizer, saved) -> None:
    for o, sd in zip(optimizer_parts(optimizer), saved or []):
        if sd is not None and getattr(o, "grad_scaler", None) is not None:
            o.grad_scaler.load_state_dict(sd)


DENSE_COORDS = ("tp_rank", "pp_rank", "cp_rank")
EXPERT_COORDS = ("pp_rank", "ep_rank", "etp_rank")


@torch.no_grad()
def _refresh_model_params(optimizer) -> None:
    """Model weights from the main weights, with megatron-core's own code (and the
    distributed optimizer's parameter all-gather)."""
    for o in optimizer_parts(optimizer):
        if isinstance(o, FP32Optimizer):
            continue
        o._copy_main_params_to_model_params()
        if isinstance(o, DistributedOptimizer):
            for chunk in o.model_chunks:
                chunk.start_param_sync(force_sync=True)


class Replay:
    """How this job replays the deltas of a base it loaded (adacheck.online.recovery.Replaying): in the
    saving layout; on another number of data-parallel ranks following a saving rank's record
    (every data-parallel rank ran the same, not distributed, optimizer); or with the
    distributed optimizer, rebuilding the saving ranks' shards (:meth:`_shards`)."""
    expect = StepScalars.expect()     # the fields of a delta record restore() uses

    def __init__(self, comm, model, optimizer, opt_param_scheduler, objects: Objects):
        self.comm, self.model, self.optimizer, self.scheduler = comm, model, optimizer, opt_param_scheduler
        self.objects = objects        # the base's (loaded)

    def plan(self, manifest) -> integration.ReplayPlan:
        saved = manifest.layout.get("ranks", [])
        topo = topology()
        world = int(manifest.topology.get("world_size", 1))
        if is_same_layout(saved, topo, self.comm.world_size, self.comm.rank):
            return integration.ReplayPlan(True)
        only_dp = bool(saved) and all(saved[0].get(k) == topo[k] for k in SIZES if k != "dp")
        maps = [RankObjects.of(ro, f"rank {r}'s objects of the base").partitions if ro else None
                for r, ro in enumerate(manifest.rank_objects)]
        if self.objects.distributed_optimizer is None and not distributed_optimizers(self.optimizer):
            # every data-parallel rank ran the same optimizer on the same gradients
            follow = recovery.follow_rank(saved, topo, COORDS) if only_dp else None
            if follow is not None:
                return integration.ReplayPlan(False, record_rank=follow)
        elif only_dp and all(m is not None for m in maps) and (
                topo["ep"] == 1 or (all("expert" in v for m in maps for v in m.values())
                                    and (topo["etp"] == 1 or all("etp_rank" in s for s in saved)))):
            # distributed optimizer on another data-parallel size: shards rebuilt from the base
            # (with expert parallelism: from bases that say which shards are experts' and, with
            # expert tensor parallelism, each saving rank's expert-TP rank)
            return integration.ReplayPlan(False, partitions=lambda: self._shards(manifest, maps))
        return integration.ReplayPlan(False, refused=(
            f"they were recorded in another layout ({layout_name(saved[0]) if saved else '?'} on {world} ranks) and "
            "replay only in it or on another number of data-parallel ranks (with the distributed optimizer: from "
            "a base saved by this version; with expert parallelism and expert tensor parallelism > 1, from a base "
            "that recorded each rank's expert-tensor-parallel rank)"))

    def tap(self) -> OptimizerTap:
        return make_tap(self.optimizer)

    def preclip(self, key: str, grad: torch.Tensor, args: dict) -> None:
        preclip(key, grad, args)

    def restore(self, last: dict, plan: integration.ReplayPlan) -> None:
        _refresh_model_params(self.optimizer)
        scalars = StepScalars.of(last, "the last delta record")
        set_grad_scalers(self.optimizer, scalars.grad_scalers)
        if self.scheduler is not None and scalars.scheduler is not None:
            load_scheduler(self.scheduler, scalars.scheduler)
            if scalars.increment:
                self.scheduler.step(increment=scalars.increment)
        if plan.same_layout:   # as the base load: RNG states belong to the saving layout
            set_rank_state(last["rank_state"])

    def _shards(self, manifest, maps: list) -> integration.Partitions:
        """The distributed optimizer's shards of the saving ranks that held the same replicas as
        this rank, rebuilt from the base: main weights and optimizer state."""
        model, optimizer = self.model, self.optimizer
        topo = topology()
        saved = manifest.layout.get("ranks", [])
        subs = distributed_optimizers(optimizer)
        by_param = param_to_sharded(sharded_state_dict(model, optimizer, is_loading=True, with_optimizer=False))
        metas = {param_ident(m): m for m in by_param.values()}
        held = [(integration.Span((oi, param_ident(model_meta(by_param, model_param))), a, b - a, 0),
                 (oi, model_param)) for oi, opt in enumerate(subs) for model_param, a, b in local_ranges(opt)]
        # the saving ranks that held the same replicas: for dense parameters those at this rank's
        # tensor / pipeline / context-parallel ranks (over every expert-parallel rank: the dense
        # data-parallel group spans them), for expert-parallel ones those at its pipeline,
        # expert-parallel and expert-tensor-parallel ranks (the expert grid is laid out apart from
        # the dense one: a rank's tensor- and expert-tensor-parallel ranks may differ)
        saving = {}
        for r, partitions in enumerate(maps):
            got = {k: [_shard_span(v)] for k, v in partitions.items()
                   if recovery.same_coords(saved[r], topo, EXPERT_COORDS if v.get("expert") else DENSE_COORDS)}
            if got:
                saving[r] = got
        # per optimizer: its state names and the step count every shard shares (after the base load)
        names, steps_of = [], []
        for opt in subs:
            st = next((v for v in opt.optimizer.state.values() if v), {})
            names.append(sorted(x for x in st if x != "step"))
            steps_of.append(st.get("step"))
        device = next(p for g in optimizer.param_groups for p in g["params"]).device

        def rebuild(reader, r: int) -> Shadow:
            never = self.objects.optimizer_never_stepped     # of the base that reader reads
            tensors, state = {}, [defaultdict(dict) for _ in subs]
            for k, (sp,) in saving[r].items():
                oi, name = sp.name
                if name not in metas:
                    raise StateError(f"saving rank {r}'s optimizer shard of {name} is not a parameter of this model")
                fresh = never[oi] if oi < len(never) else False
                got = distopt_read_shard(reader, metas[name], sp.start, sp.start + sp.numel,
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
                init_empty_state([subs[oi]])
                live = subs[oi]._get_main_param_and_optimizer_states(model_param)
            for x in live:
                value = t if x == "param" else st.get(x)
                if x != "step" and value is not None:
                    live[x].view(-1)[at:at + n].copy_(value.view(-1)[src:src + n])
            if "step" in st:
                subs[oi].optimizer.state[live["param"]]["step"] = st["step"].clone()

        return integration.Partitions(saving, held, rebuild, put, min(saving, default=0))


def _shard_span(v: dict) -> integration.Span:
    """A saved shard (``state.distopt_partition_map``: one range of one parameter), named by its
    optimizer and parameter."""
    (name, start, numel, offset), = v["pieces"]
    return integration.Span((int(v["optimizer"]), name), start, numel, offset)
