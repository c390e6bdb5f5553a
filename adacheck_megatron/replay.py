"""Recovery of Megatron online deltas: the optimizer tap that names every tensor the same way in
the recording and the recovering job (``make_tap``), megatron-core's clipping applied again
(``preclip``), and ``recover``, which replays the committed deltas of a base just loaded: in the
saving layout, on another number of data-parallel ranks following a saving rank's record, or
with the distributed optimizer rebuilding the saving ranks' shards (``_replay_shards``)."""
from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from typing import List, Optional

import torch

from adacheck import online as O
from adacheck.checkpoint import CheckpointReader
from adacheck.errors import ConfigError, StateError
from adacheck.optimtap import OptimizerTap, Shadow

from . import state as S
from .parallel import COORDS, SIZES, load_scheduler, same_coords, set_rank_state, sharded_state_dict, topology

log = logging.getLogger("adacheck")


def distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return any(isinstance(o, DistributedOptimizer) for o in S.parts(optimizer))


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
    from megatron.core import parallel_state as ps
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep, etp = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    old = f"tp{tp}.pp{pp}.ep{ep}."
    parts = S.parts(optimizer)
    if distributed(optimizer):
        return OptimizerTap([o.optimizer for o in parts], prefix=old + f"dp{ps.get_data_parallel_rank()}.")
    names = {"dense": f"tp{tp}.pp{pp}.", "expert": f"pp{pp}.ep{ep}.etp{etp}."}
    return OptimizerTap([o.optimizer for o in parts], prefix=[names.get(kind_of(o), old) for o in parts],
                        aliases=[old] * len(parts))


def is_same_layout(saved: List[dict], topo: dict, world: int) -> bool:
    return len(saved) == world and all(saved[0].get(k) == topo[k] for k in SIZES)


def only_dp_differs(saved: List[dict], topo: dict) -> bool:
    return bool(saved) and all(saved[0].get(k) == topo[k] for k in SIZES if k != "dp")


def replay_rank(saved: List[dict], topo: dict, replicated: bool) -> Optional[int]:
    """The saving job's rank whose online deltas this rank replays when only the data-parallel
    size changed and every data-parallel rank ran the same (not distributed) optimizer: the one
    at the same model-parallel coordinates, same data-parallel rank if it had one, else 0."""
    if not replicated or not only_dp_differs(saved, topo):
        return None
    same = [r for r, lay in enumerate(saved) if same_coords(lay, topo, COORDS)]
    return next((r for r in same if saved[r].get("dp_rank") == topo["dp_rank"]),
                next((r for r in same if saved[r].get("dp_rank") == 0), None))


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
    topo = topology()
    saved = manifest.layout.get("ranks", [])
    subs = S.distributed_optimizers(optimizer)
    by_param = S.param_to_sharded(sharded_state_dict(model, optimizer, is_loading=True, with_optimizer=False))
    metas = {S.param_ident(m): m for m in by_param.values()}
    held = [(O.Span((oi, S.param_ident(S.model_meta(by_param, model_param))), a, b - a, 0), (oi, model_param))
            for oi, opt in enumerate(subs) for model_param, a, b in S.local_ranges(opt)]
    # the saving ranks that held the same replicas: for dense parameters those at this rank's
    # tensor / pipeline / context-parallel ranks (over every expert-parallel rank: the dense
    # data-parallel group spans them), for expert-parallel ones those at its pipeline,
    # expert-parallel and expert-tensor-parallel ranks (the expert grid is laid out apart from
    # the dense one: a rank's tensor- and expert-tensor-parallel ranks may differ)
    saving = {}
    for r, ro in enumerate(manifest.rank_objects):
        got = {k: [_shard_span(v)] for k, v in ro["partitions"].items()
               if same_coords(saved[r], topo, EXPERT_COORDS if v.get("expert") else DENSE_COORDS)}
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

DENSE_COORDS = ("tp_rank", "pp_rank", "cp_rank")
EXPERT_COORDS = ("pp_rank", "ep_rank", "etp_rank")


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
            strict: bool = True, on=None) -> int:
    """Replay the committed deltas of the base just loaded (collective), all of them or those up
    to iteration ``until``; returns the iteration. ``record_rank``: the saving job's rank whose
    records this rank follows when the layout differs only in data-parallel size and every
    data-parallel rank ran the same optimizer (see :func:`replay_rank`); ``shards``: the
    layout differs only in data-parallel size and the distributed optimizer's shards are
    rebuilt (``_replay_shards``); neither: replay only in the saving layout.  ``strict``: damaged
    deltas fail the load (after the job holds the last intact step); else it goes on from there
    with a warning."""
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


def recover_after_load(comm, ckpt_dir: str, manifest, objects: dict, model, optimizer, opt_param_scheduler,
                       iteration: int, until: Optional[int], latest: bool, verify: bool, strict: bool,
                       on=None) -> int:
    """After a base was loaded (optimizer state and scheduler included): replay its committed
    deltas where this layout can (see :func:`recover`), choosing how from the saving layout;
    returns the iteration the job is at.  ``on``: the online mode recording into the same
    directory, which continues the chain."""
    saved = manifest.layout.get("ranks", [])
    topo = topology()
    replicated = objects.get("distributed_optimizer") is None and not S.distributed_optimizers(optimizer)
    same = is_same_layout(saved, topo, comm.world_size)
    # distributed optimizer on another data-parallel size: shards rebuilt from the base (with
    # expert parallelism: from bases that say which shards are experts' and, with expert
    # tensor parallelism, each saving rank's expert-TP rank)
    maps = [(ro or {}).get("partitions") for ro in manifest.rank_objects]
    shards = (not replicated and not same and only_dp_differs(saved, topo) and all(m is not None for m in maps)
              and (topo["ep"] == 1 or (all("expert" in v for m in maps for v in m.values())
                                       and (topo["etp"] == 1 or all("etp_rank" in s for s in saved)))))
    return recover(comm, ckpt_dir, manifest, model, optimizer, opt_param_scheduler, latest=latest,
                   same_layout=same, iteration=iteration, until=until,
                   record_rank=replay_rank(saved, topo, replicated), shards=shards, verify=verify, strict=strict,
                   on=on)
