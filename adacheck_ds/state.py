"""DeepSpeed engine state <-> AdaCheck logical tensors, for ZeRO stages 0-3 (the wrapper kinds
in :mod:`.wrappers` say where each rank's fragments live).  The names do not depend on the layout:
  model/<p>        the module parameter in the module's dtype (bf16/fp16/fp32), declared
                   derivable from master/<p> where each fragment's cast is proven equal
  master/<p>       the fp32 master weights, where the optimizer keeps a separate copy
  optim/<key>/<p>  optimizer state (exp_avg, exp_avg_sq, step, ...), per parameter
  buffer/<b>       module buffers
A tensor-parallel parameter (an engine built with a Megatron-DeepSpeed ``mpu``, marked
``tensor_model_parallel`` with a ``partition_dim``) is this rank's slice of one logical tensor
``tp`` times as large along that dimension; a load reads the slice of the engine it loads into.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils.bwc import (bwc_pipeline_parallel_world_size, bwc_tensor_model_parallel_rank,
                                 bwc_tensor_model_parallel_world_size)

from adacheck.format.boxes import flat_views
from adacheck.checkpoint import CheckpointReader, Pieces
from adacheck.integration import Kind, LocalShard, Span
from adacheck.errors import ConfigError, StateError
from adacheck.format.hashing import same_bytes
from adacheck.types import Box, torch_dtype

from .saved import Objects, RankObjects
from .wrappers import Frag, Layout, wrapper_of
from .wrappers.base import relink


def tensor_parallel(engine) -> Tuple[int, int]:
    """(rank, size) of the engine's tensor-parallel group (Megatron-DeepSpeed's ``mpu``)."""
    mpu = getattr(engine, "mpu", None)
    if mpu is None:
        return 0, 1
    return int(bwc_tensor_model_parallel_rank(mpu)), int(bwc_tensor_model_parallel_world_size(mpu))


def pipeline(engine) -> Tuple[int, int]:
    """(stage, number of stages) of the engine's pipeline (a PipelineEngine's grid, or a
    Megatron-DeepSpeed ``mpu``); (0, 1) without one."""
    mpu = getattr(engine, "mpu", None)
    if mpu is None or bwc_pipeline_parallel_world_size(mpu) <= 1:
        return 0, 1
    return int(mpu.get_pipeline_model_parallel_rank()), int(bwc_pipeline_parallel_world_size(mpu))


def _expert_names(engine) -> Dict[str, str]:
    """DeepSpeed-MoE experts: each name of a rank's local expert i of a MoE layer -> the name of
    global expert ``ep_rank * num_local_experts + i`` (as DeepSpeed's native expert files name
    them), so that the same expert has the same name on every rank that holds it, whatever the
    expert-parallel size."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups
    out: Dict[str, str] = {}
    for mname, m in engine.module.named_modules():
        if not isinstance(m, MoE):
            continue
        local, ep_rank = m.num_local_experts, groups._get_expert_parallel_rank(m.expert_group_name)
        experts = m.deepspeed_moe.experts.deepspeed_experts
        at = f"{mname}.deepspeed_moe.experts.deepspeed_experts." if mname else "deepspeed_moe.experts.deepspeed_experts."
        for i, expert in enumerate(experts):
            mine, theirs = f"{at}{i}.", f"{at}{ep_rank * local + i}."
            for n, _ in [*expert.named_parameters(), *expert.named_buffers()]:
                out[mine + n] = theirs + n
    return out


def named(engine, buffers: bool = False) -> List[Tuple[str, torch.Tensor]]:
    """The engine's parameters (or non-None buffers) in module order, by their logical names:
    the module's, a MoE expert's under its global id (:func:`_expert_names`)."""
    rename = _expert_names(engine) if getattr(engine, "has_moe_layers", False) else {}
    items = engine.module.named_buffers() if buffers else engine.module.named_parameters()
    return [(rename.get(n, n), t) for n, t in items if t is not None]


def pipeline_layers(module) -> Optional[dict]:
    """A PipelineModule's structure, what a conversion rebuilds it from (None for other
    modules): ``parts`` (the first layer index of each stage, and the number of layers) and per
    layer index ``["module"]`` (its parameters and buffers are ``<index>.*``), ``["function"]``
    (no state), or ``["tied", key, holds, attrs]`` (a TiedLayerSpec: its state is
    ``tied_modules.<key>.*``; ``holds``: the layer is the tied module itself, not a function of it,
    so DeepSpeed's native save writes it at this index; ``attrs``: its tied weight attributes)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    if not isinstance(module, PipelineModule):
        return None
    layers: List[list] = []
    for spec in module._layer_specs:
        if isinstance(spec, TiedLayerSpec):
            layers.append(["tied", spec.key, spec.forward_fn is None, list(spec.tied_weight_attr)])
        elif isinstance(spec, (LayerSpec, torch.nn.Module)):
            layers.append(["module"])
        else:
            layers.append(["function"])
    return {"parts": [int(x) for x in module.parts], "layers": layers}


def moe_layers(module) -> Optional[List[dict]]:
    """The DeepSpeed-MoE layers of a module, what a conversion rebuilds them from (None without
    any): each one's ``path``, ``hidden`` size, number of ``experts``, ``ep_size`` and whether it
    has a ``residual`` MLP."""
    from deepspeed.moe.layer import MoE
    out = [{"path": n, "hidden": int(m.deepspeed_moe.gate.wg.weight.shape[1]), "experts": int(m.num_experts),
            "ep_size": int(m.ep_size), "residual": bool(m.use_residual)}
           for n, m in module.named_modules() if isinstance(m, MoE)]
    return out or None


def pipe_copy(p) -> bool:
    """A tied parameter's copy on a later pipeline stage (DeepSpeed marks those
    ``ds_pipe_replicated``: the first stage that holds it owns it)."""
    return bool(getattr(p, "ds_pipe_replicated", False))


def refuse_topology(ckpt_dir: str, m, what: str, pipeline_ok: bool = False, experts_ok: bool = False) -> None:
    """A checkpoint of a PipelineEngine or of a model with DeepSpeed-MoE experts: ``what`` does
    not write those layouts (their native files are per layer / per expert), so it is refused
    with what to do instead."""
    pp = int(m.framework.get("pp_world_size", 1))
    experts = any(".deepspeed_experts." in n for n in m.tensors)
    if (pp > 1 and not pipeline_ok) or (experts and not experts_ok):
        kind = f"a {pp}-stage PipelineEngine" if pp > 1 else "a model with DeepSpeed-MoE experts"
        raise StateError(f"{ckpt_dir} was saved by {kind}; {what} does not write that layout yet. Load it "
                         "with AdaCheck enabled into the training job's engine (any number of pipeline stages "
                         "or expert-parallel size), or export its fp32 weights with the zero_to_fp32.py "
                         "beside it")


def refuse_config(raw: Optional[dict]) -> None:
    """Refuse, before DeepSpeed builds the engine, what AdaCheck cannot checkpoint that the
    DeepSpeed config (``raw``, as given) already says: NVMe offload (the optimizer state or the
    parameters live in swap files AdaCheck does not read) and DeepSpeed's AutoTP (its sliced
    layers do not say how their parameters are split)."""
    raw = raw or {}
    zero = raw.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) if isinstance(zero, dict) else None
        if isinstance(section, dict) and str(section.get("device", "")).lower() == "nvme":
            raise ConfigError(f"zero_optimization.{key}.device is \"nvme\": AdaCheck does not read DeepSpeed's NVMe "
                              "swap files, so it cannot checkpoint this engine; offload to \"cpu\" (supported at "
                              "ZeRO 1-3), or disable adacheck to use DeepSpeed's own checkpoints")
    autotp = (raw.get("tensor_parallel") or {}).get("autotp_size", 1) if isinstance(raw.get("tensor_parallel"), dict) else 1
    if isinstance(autotp, int) and autotp > 1:
        raise ConfigError(f"tensor_parallel.autotp_size is {autotp}: AdaCheck does not support DeepSpeed's AutoTP "
                          "yet (its sliced layers do not record how each parameter is split); use a model whose "
                          "tensor-parallel layers are marked as Megatron marks them (with an mpu), or disable adacheck")


def refuse_engine(engine) -> None:
    """Refuse, at ``deepspeed.initialize``, a built engine whose layout AdaCheck cannot
    checkpoint, rather than at its first save: an optimizer wrapper or parameter layout it does
    not know (:func:`describe` raises), and combinations not tested yet."""
    stages, moe = pipeline(engine)[1], getattr(engine, "has_moe_layers", False)
    if stages > 1 and moe:
        raise ConfigError("a PipelineEngine with DeepSpeed-MoE layers: AdaCheck supports each alone, not both "
                          "together yet; disable adacheck for this job")
    describe(engine)


def data_parallel(engine) -> Tuple[int, int]:
    """(rank, size) of the engine's data-parallel group (the mpu's, when it has one)."""
    if not torch.distributed.is_initialized():
        return 0, 1
    group = getattr(engine, "data_parallel_group", None)
    return torch.distributed.get_rank(group), int(getattr(engine, "dp_world_size", 1))


def data_parallel_ranks(engine) -> List[int]:
    """The global ranks of the engine's data-parallel group, in its rank order."""
    if not torch.distributed.is_initialized():
        return [0]
    group = getattr(engine, "data_parallel_group", None)
    if group is None:
        return list(range(torch.distributed.get_world_size()))
    return list(torch.distributed.get_process_group_ranks(group))


def _place_params(engine, lay: "Layout") -> None:
    """Each parameter's logical shape and the box of it this rank holds (``lay.origin``)."""
    lay.tp = tp_rank, tp = tensor_parallel(engine)
    for n, p in named(engine):
        local = tuple(getattr(p, "ds_shape", p.shape))
        dim, stride = getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1)
        if tp == 1 or not is_model_parallel_parameter(p):
            lay.origin[n] = (local, Box.full(local))
            if is_model_parallel_parameter(p) and isinstance(dim, int) and 0 <= dim < len(local) and stride == 1:
                lay.split[n] = dim   # (Megatron marks its layers at TP=1 too): a conversion may split it
            continue
        if not isinstance(dim, int) or not 0 <= dim < len(local):
            raise StateError(f"{n} is marked tensor-model-parallel but has no valid partition_dim "
                             f"({dim!r}); AdaCheck needs to know along which dimension it is split "
                             "(set it as Megatron's set_tensor_model_parallel_attributes does)")
        if stride != 1:
            raise StateError(f"{n} is split with partition_stride={stride}; AdaCheck supports contiguous "
                             "tensor-parallel slices (stride 1) only")
        full = list(local)
        full[dim] *= tp
        offs = [0] * len(local)
        offs[dim] = tp_rank * local[dim]
        lay.origin[n] = (tuple(full), Box(tuple(offs), local))
        lay.split[n] = dim


def tied_parameters(module: torch.nn.Module) -> Dict[str, str]:
    """Tied weights: every further name of a parameter object (the alias) -> the name
    ``named_parameters()`` lists it under (the first in module order), as DeepSpeed's
    ``shared_params`` records them.  Empty when no parameter has two names."""
    first: Dict[int, str] = {}
    out: Dict[str, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[n] = first[id(p)]
        else:
            first[id(p)] = n
    return out


def class_path(obj) -> str:
    """``module.Class`` of an object (the base optimizer a checkpoint was saved with)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def describe(engine) -> Layout:
    """Where this rank's part of every parameter lives in the engine, for any ZeRO stage (its
    optimizer wrapper's kind says: see adacheck_ds.wrappers)."""
    names = {p: n for n, p in named(engine)}
    lay = wrapper_of(engine).describe(engine.zero_optimization_stage(), names)
    _place_params(engine, lay)
    return lay


def _state_tensor(v) -> Optional[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    return None


def collect_shards(engine, lay: Layout) -> List[LocalShard]:
    shards: List[LocalShard] = []
    has_master = lay.wrapper.has_master
    proven = {n: True for n in lay.trained}   # this rank found no counter-example (yet)
    # declared replicas: a plain optimizer's state on every data-parallel rank, and what is not
    # split by tensor parallelism on every tensor-parallel rank
    tp_copy = {n for n in lay.origin if lay.tp[1] > 1 and n not in lay.split}
    for f in lay.frags:
        shape, origin = lay.origin[f.name]
        if has_master:
            lstart, lview = lay.lp_views[f.name]
            lo = f.start - lstart
            lp = lview.narrow(0, lo, f.numel)
            proven[f.name] = proven[f.name] and same_bytes(lp, f.master.to(lp.dtype))
        if lay.wrapper.flat_partitions and pipe_copy(f.param):
            # a tied weight's master and optimizer state on a later stage: the same values as on
            # the owning stage (DeepSpeed sums the tied gradients across the stages before each
            # step), in partitions cut elsewhere, so its boxes would overlap the owner's; stored
            # from the owner only (its module weights, whole on every stage, are compared by hash)
            continue
        if has_master:
            for b, t in flat_views(origin, f.start, f.master):
                shards.append(LocalShard(f"master/{f.name}", Kind.MASTER, shape, b, t,
                                         replicated=f.name in tp_copy))
        state = lay.base_optimizer.state.get(f.base_param, {}) if lay.base_optimizer else {}
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and v.numel() == f.base_param.numel() and v.dim() >= 1:
                view = v.detach().view(-1).narrow(0, f.offset, f.numel)
                for b, t in flat_views(origin, f.start, view):
                    shards.append(LocalShard(f"optim/{key}/{f.name}", Kind.OPTIM, shape, b, t,
                                             replicated=lay.wrapper.optim_replicated(f.name, tp_copy)))
            else:
                t = _state_tensor(v)
                if t is None:
                    raise StateError(f"optimizer state {key!r} of {f.name} is a {type(v).__name__} "
                                     f"that AdaCheck cannot map to parameters; supported: tensors "
                                     "(shaped like the parameter, or stored whole), and numbers")
                if t.dim() and tuple(t.shape) == tuple(shape):
                    # a load takes a tensor of the parameter's shape for its elements
                    raise StateError(f"optimizer state {key!r} of {f.name} has the parameter's shape "
                                     f"{list(shape)} but not the {f.base_param.numel()} elements of the "
                                     "tensor the optimizer steps; AdaCheck cannot tell whether it is "
                                     "per element or one value for the whole tensor")
                # a scalar or a small tensor of its own (a step count): whole, with each parameter
                shards.append(LocalShard(f"optim/{key}/{f.name}", Kind.OPTIM, tuple(t.shape), Box.full(t.shape), t))
    for n, (start, view) in lay.lp_views.items():
        shape, origin = lay.origin[n]
        derive = f"master/{n}" if (has_master and n in lay.trained) else None
        ok = proven[n] if derive else False
        if not has_master and n in lay.trained and view.dtype != torch.float32:
            raise StateError(f"{n} is {view.dtype} without fp32 master weights; unsupported layout")
        for b, t in flat_views(origin, start, view):
            shards.append(LocalShard(f"model/{n}", Kind.MODEL, shape, b, t, derive=derive, derive_ok=ok,
                                     replicated=lay.wrapper.model_replicated(n, tp_copy)))
    for n, buf in named(engine, buffers=True):
        if buf is not None:
            shards.append(LocalShard(f"buffer/{n}", Kind.BUFFER, tuple(buf.shape), Box.full(buf.shape),
                                     buf.detach()))
    return shards


# ----------------------------------------------------------------------------- load
@dataclass
class Staged:
    """What a load read on this rank (:func:`stage_load`), before anything is applied."""
    lay: Layout                                                      # the engine's, when read
    objects: Objects                                                 # the checkpoint's
    rank_objects: Optional[RankObjects]     # this rank's (None: a rank the saving job did not have)
    master: Dict[str, Pieces] = field(default_factory=dict)          # per frag (1-D)
    lp: Dict[str, Pieces] = field(default_factory=dict)              # per lp view (1-D)
    optim_state: Optional[dict] = None         # base optimizer state_dict, its tensors in Pieces
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    refresh: set = field(default_factory=set)       # module weights made from the masters (_refreshed)


def _master_source(r: CheckpointReader, n: str) -> str:
    if r.has(f"master/{n}"):
        return f"master/{n}"
    if r.has(f"model/{n}"):
        return f"model/{n}"
    raise StateError(f"the checkpoint has no weights for parameter {n!r}; was it saved from a "
                     "different model? (adacheck inspect --tensors lists what it holds)")


def _lp_source(r: CheckpointReader, n: str, dtype: torch.dtype) -> str:
    model = r.entry(f"model/{n}") if r.has(f"model/{n}") else None
    if model is not None and model.derived is None and model.dtype == str(dtype).replace("torch.", ""):
        return f"model/{n}"
    return _master_source(r, n)


#: backends whose all-gather of the module weights is slower than each rank reading every master
#: weight from mapped checkpoint files and casting it (gloo moves tensors through sockets: on the
#: 2-core VM, 42 MB of bf16 weights at DP=2 took 0.05-0.07 s to gather, 0.02 s to read and cast)
READ_RATHER_THAN_GATHER = ("gloo",)


def _refreshed(lay: Layout, r: CheckpointReader, keep: set) -> set:
    """The module weights this load does not read but has DeepSpeed make again from the master
    weights it loads (:meth:`Wrapper.refresh`), or none: every trained parameter's, when each is
    restored and the checkpoint holds each as its master's cast (a derivation proved at save
    time), so the cast gives back every saved bit.  ZeRO-3: each rank's module partition is its
    master partition's cast (a read would read those master weights again).  ZeRO-1/2 and the
    bf16 optimizer, where every rank holds whole module weights: each rank casts its own master
    partition and DeepSpeed all-gathers the rest, unless the gather goes over a backend of
    READ_RATHER_THAN_GATHER and the storage maps the files: then each rank reads every master
    weight and casts it, as DeepSpeed's own load reads the whole module weights on every rank (an
    object store would download them once per rank)."""
    trained = [n for n in lay.lp_views if n in lay.trained]
    if not lay.wrapper.refresh_rebuilds or not trained or any(n not in keep for n in trained):
        return set()
    if not all(r.is_cast_of(f"model/{n}", f"master/{n}", lay.lp_views[n][1].dtype) for n in trained):
        return set()
    if r.store.maps and any(torch.distributed.get_world_size(g) > 1
                            and torch.distributed.get_backend(g) in READ_RATHER_THAN_GATHER
                            for g in lay.wrapper.refresh_groups()):
        return set()
    return set(trained)


def _names_in(r: CheckpointReader, prefix: str) -> set:
    return {n[len(prefix):] for n in r.names() if n.startswith(prefix)}


def module_names(engine) -> Tuple[set, set]:
    """The names of the engine's parameters and (non-None) buffers."""
    return {n for n, _ in named(engine)}, {n for n, _ in named(engine, buffers=True)}


def _check_names(engine, r: CheckpointReader, strict: bool, everywhere: Optional[Tuple[set, set]] = None) -> set:
    """Parameters to restore; like nn.Module.load_state_dict(strict=...) for missing/unexpected
    (``everywhere``: the parameter and buffer names of every pipeline stage, which a checkpoint
    may hold besides this stage's own)."""
    params = dict(named(engine))
    every_param, every_buffer = everywhere if everywhere is not None else module_names(engine)
    saved = _names_in(r, "model/") | _names_in(r, "master/")
    missing = [n for n in params if n not in saved]
    unexpected = sorted(saved - every_param)
    buffers = {n for n, _ in named(engine, buffers=True)}
    missing += sorted(buffers - _names_in(r, "buffer/"))
    unexpected += sorted(_names_in(r, "buffer/") - every_buffer)
    if strict and (missing or unexpected):
        frozen = [n for n in missing if n in params and not params[n].requires_grad]
        hint = (" (frozen parameters are missing when the checkpoint was saved with "
                "exclude_frozen_parameters=True)" if frozen else "")
        raise StateError(f"the checkpoint does not match the model: missing "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                         f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}{hint}; pass "
                         "load_module_strict=False to load the parameters both have")
    return set(params) - set(missing)   # buffers: stage_load takes those the checkpoint has


def stage_load(engine, r: CheckpointReader, load_optimizer_states: bool, strict: bool, rank: int,
               everywhere: Optional[Tuple[set, set]] = None) -> Staged:
    """This rank's part of checkpoint ``r`` for ``engine`` (``strict``: as
    ``load_module_strict``; ``everywhere``: as :func:`_check_names`), read; nothing of the
    engine is changed."""
    lay = describe(engine)
    objects = Objects.of(r.objects(), f"the objects of {r.dir}")
    saved_rank = rank < r.manifest.topology.get("world_size", 1)
    st = Staged(lay, objects, RankObjects.of(r.objects(rank), f"rank {rank}'s objects of {r.dir}")
                if saved_rank else None)
    keep = _check_names(engine, r, strict, everywhere)
    for n in keep:
        src = r.entry(_master_source(r, n))
        shape = lay.origin[n][0]
        if tuple(src.shape) != shape:
            tp = f" (as {lay.tp[1]} tensor-parallel slices)" if n in lay.split else ""
            raise StateError(f"parameter {n}: checkpoint shape {list(src.shape)} != model shape "
                             f"{list(shape)}{tp}; the checkpoint belongs to another model configuration")
    for f in lay.frags:
        if f.name in keep:
            st.master[f"{f.name}@{f.start}"] = r.pieces(_master_source(r, f.name), f.start, f.start + f.numel,
                                                        dtype=f.master.dtype, within=lay.origin[f.name][1])
    st.refresh = _refreshed(lay, r, keep)
    for n, (start, view) in lay.lp_views.items():
        if n in keep and n not in st.refresh:
            st.lp[n] = r.pieces(_lp_source(r, n, view.dtype), start, start + view.numel(), dtype=view.dtype,
                                within=lay.origin[n][1])
    for n, buf in named(engine, buffers=True):
        if buf is not None and r.has(f"buffer/{n}"):
            st.buffers[n] = r.read(f"buffer/{n}").to(buf.dtype)
    if lay.base_optimizer is not None and load_optimizer_states:
        with lay.wrapper.stepping():
            st.optim_state = _stage_optimizer(lay, r, objects.param_groups)
    return st


def _stage_optimizer(lay: Layout, r: CheckpointReader, saved_groups) -> Optional[dict]:
    base = lay.base_optimizer
    groups = base.param_groups
    if saved_groups is not None and len(saved_groups) != len(groups):
        raise StateError(f"the checkpoint has {len(saved_groups)} optimizer param groups but the "
                         f"engine has {len(groups)}; param groups must match to restore the optimizer")
    keys = state_keys(r)
    frags_of: Dict[int, List[Frag]] = {}
    for f in lay.frags:
        frags_of.setdefault(id(f.base_param), []).append(f)
    state, index = {}, 0
    out_groups = []
    for gi, g in enumerate(groups):
        ids = []
        for p in g["params"]:
            ids.append(index)
            entry = state_entry(r, lay, keys, frags_of.get(id(p), []), p.numel(), p.shape)
            if entry:
                state[index] = entry
            index += 1
        hyper = dict(saved_groups[gi]) if saved_groups is not None else {k: v for k, v in g.items() if k != "params"}
        hyper["params"] = ids
        out_groups.append(hyper)
    return {"state": state, "param_groups": out_groups}


def state_keys(r: CheckpointReader) -> List[str]:
    """The optimizer state names (exp_avg, step, ...) a checkpoint holds."""
    return sorted({name.split("/")[1] for name in r.names() if name.startswith("optim/")})


def state_entry(r: CheckpointReader, lay: Layout, keys, frags, numel: int, shape) -> dict:
    """The base optimizer's state of one tensor it steps (``numel`` elements, ``shape``) made of
    ``frags`` (anything with name / start / numel / offset), read from the checkpoint, each
    tensor of it in :class:`Pieces` (:func:`settled` copies them); elements no fragment covers
    (alignment padding) are zero."""
    entry = {}
    for key in keys:
        frs = [f for f in frags if r.has(f"optim/{key}/{f.name}")]
        if not frs:
            continue
        e0 = r.entry(f"optim/{key}/{frs[0].name}")
        if e0.shape == ():
            vals = {r.read(f"optim/{key}/{f.name}").item() for f in frs}
            if len(vals) != 1:
                raise StateError(f"optimizer state {key!r} differs between parameters that now "
                                 f"share one partition ({sorted(vals)}); cannot merge them")
            t = r.read(f"optim/{key}/{frs[0].name}")
            # a Python int (DeepSpeed's Adam counts steps that way) was saved as int64
            entry[key] = t.item() if t.dtype == torch.int64 else t
        elif tuple(e0.shape) != tuple(lay.origin[frs[0].name][0]):
            # a tensor of its own shape, stored whole with each parameter (collect_shards)
            ts = [r.read(f"optim/{key}/{f.name}") for f in frs]
            if any(not torch.equal(t, ts[0]) for t in ts[1:]):
                raise StateError(f"optimizer state {key!r} differs between parameters that now "
                                 "share one partition; cannot merge them")
            entry[key] = ts[0]
        else:
            entry[key] = _flat_of(r, lay, f"optim/{key}/", frs, numel, torch_dtype(e0.dtype), shape)
    return entry


def _flat_of(r: CheckpointReader, lay: Layout, prefix: str, frags, numel: int, dtype, shape=None) -> Pieces:
    flat = Pieces(numel, dtype, shape)        # (what no fragment covers, alignment padding, is zero)
    for f in frags:
        name = prefix + f.name if prefix else _master_source(r, f.name)
        flat.place(f.offset, r.pieces(name, f.start, f.start + f.numel, dtype=dtype, within=lay.origin[f.name][1]))
    return flat


def settled(base_optimizer, optim_state: dict) -> dict:
    """``optim_state`` (:func:`_stage_optimizer`'s) for ``base_optimizer.load_state_dict``, each
    tensor in pieces copied into the one the optimizer holds for it now where its load would keep
    that one as it is (the same shape, dtype and device: memory already in use), else into a new
    tensor where the load keeps it (on a GPU: one copy, not a host copy moved again)."""
    params = [p for g in base_optimizer.param_groups for p in g["params"]]
    state = {}
    for index, entry in optim_state["state"].items():
        have = base_optimizer.state.get(params[index], {})
        out = {}
        for key, v in entry.items():
            if isinstance(v, Pieces):
                p, cur = params[index], have.get(key)
                fits = (isinstance(cur, torch.Tensor) and cur.dtype == v.dtype and cur.device == p.device
                        and tuple(cur.shape) == v.shape and cur.is_contiguous()
                        and (not v.dtype.is_floating_point or v.dtype == p.dtype))
                # else new memory where the load would move it: the parameter's device, its dtype
                v = v.copy_into(cur) if fits else v.tensor(p.dtype if p.is_floating_point() else v.dtype, p.device)
            out[key] = v
        state[index] = out
    return dict(optim_state, state=state)


# ----------------------------------------------------------------------------- partitions
def partition_map(lay: Layout, key_of: Callable[[torch.Tensor], Optional[str]]) -> Dict[str, dict]:
    """What each tensor this rank's base optimizer steps is made of (key -> its element count
    and pieces): saved with an online base of a partitioned optimizer, so that a job on another
    number of data-parallel ranks can rebuild this rank's partitions and replay its deltas."""
    out: Dict[str, dict] = {}
    for f in lay.frags:
        key = key_of(f.base_param)
        if key is None:
            raise StateError(f"AdaCheck online: the optimizer tensor holding {f.name} has no key")
        d = out.setdefault(key, {"numel": f.base_param.numel(), "pieces": []})
        d["pieces"].append([f.name, f.start, f.numel, f.offset])
    return out


def read_partition(r: CheckpointReader, lay: Layout, numel: int, pieces: List[Span]) -> Tuple[torch.Tensor, dict]:
    """A saved rank's flat partition (``numel`` elements made of ``pieces``: partition_map's) from the checkpoint:
    its fp32 master weights and its base-optimizer state, padding zero as DeepSpeed makes it."""
    master = _flat_of(r, lay, "", pieces, numel, torch.float32).tensor()
    entry = state_entry(r, lay, state_keys(r), pieces, numel, (numel,))
    return master, {k: v.tensor() if isinstance(v, Pieces) else v for k, v in entry.items()}


def apply_load(engine, st: Staged) -> None:
    lay = st.lay
    with torch.no_grad():
        for f in lay.frags:
            if f"{f.name}@{f.start}" in st.master:
                st.master[f"{f.name}@{f.start}"].copy_into(f.master)
        for n, (start, view) in lay.lp_views.items():
            if n in st.lp:
                st.lp[n].copy_into(view)
        named_buffers = dict(named(engine, buffers=True))
        for n, t in st.buffers.items():
            named_buffers[n].copy_(t)
    if st.refresh:          # collective: every rank decided the same from the manifest
        lay.wrapper.refresh()
    if st.optim_state is not None:
        with lay.wrapper.stepping():
            lay.base_optimizer.load_state_dict(settled(lay.base_optimizer, st.optim_state))
        if st.optim_state["state"]:
            relink(engine.optimizer)
