"""megatron-core sharded state dicts <-> AdaCheck shards.

megatron-core already describes training state layout-independently: ``sharded_state_dict()``
of a model (and of its optimizer, given the model's) is a nested dict whose leaves are
``ShardedTensor`` (a key naming a logical tensor, its global shape, this rank's offset and
local shape, optionally a flat range of that local shard), ``ShardedObject`` (a piece of
non-tensor state with a key and a position in a grid), ``ShardedTensorFactory`` (built into
ShardedTensors before saving, merged back after loading) and plain values (the "common"
state). This module maps that vocabulary onto the core's: a ShardedTensor is a box of the
logical tensor named by its key (a flat range becomes up to 2*ndim-1 boxes), every holder of
the same box is a declared replica (``replica_id`` only says which of them Megatron's own
save would write; AdaCheck's planner chooses the writer by hash and balance), ShardedObjects
are saved once per key and grid position, and the common state is saved as JSON by rank 0.

Loading mirrors ``megatron.core.dist_checkpointing.load``: the target's sharded state dict
names the boxes it needs, each is read (from whatever stored boxes intersect it, so any
TP / PP / EP / DP layout works), and the result is the plain state dict the model's and the
optimizer's ``load_state_dict`` expect.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from adacheck.format import jsontree
from adacheck.format.boxes import flat_pieces
from adacheck.checkpoint import CheckpointReader, Pieces, RankObjectLookup
from adacheck.integration import Kind, LocalShard
from adacheck.errors import StateError
from adacheck.format.hashing import same_bytes
from adacheck.types import Box
from megatron.core.dist_checkpointing.dict_utils import (dict_list_map_inplace, merge,
                                                        nested_values)
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                      apply_factory_merges, is_main_replica)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from .saved import RankObjects

MASTER_PREFIX = "optimizer.state.fp32_param."


def kind_of(key: str) -> Kind:
    if key.startswith(MASTER_PREFIX):
        return Kind.MASTER
    if key.startswith("optimizer."):
        return Kind.OPTIM
    return Kind.MODEL


def _global_box(st: ShardedTensor) -> Box:
    """The box of the (non-flattened) local shard in global coordinates."""
    lengths = (1,) * st.prepend_axis_num + tuple(st.local_shape)
    if len(lengths) != len(st.global_shape) or len(st.global_offset) != len(st.global_shape):
        raise StateError(f"{st.key}: offsets {st.global_offset} / local shape {st.local_shape} "
                         f"(+{st.prepend_axis_num} prepended axes) do not match global shape "
                         f"{st.global_shape}")
    return Box(tuple(st.global_offset), lengths)


def _pieces(st: ShardedTensor) -> List[Tuple[Box, slice]]:
    """(global box, range of the flattened data) for each piece of ``st``'s data."""
    full = _global_box(st)
    if st.flattened_range is None:
        return [(full, slice(0, full.numel))]
    return flat_pieces(full, st.flattened_range.start, st.flattened_range.stop)


def _sharded_tensors(sharded: dict) -> List[ShardedTensor]:
    out = []
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensor):
            out.append(v)
        elif not isinstance(v, ShardedObject):
            raise StateError(f"unsupported sharded value {type(v).__name__} in a sharded state dict")
    return out


def describe(sharded_state_dict: dict) -> Tuple[List[LocalShard], Dict[str, object], dict]:
    """This rank's shards, its main-replica ShardedObjects (unique key -> data) and the
    common state of a sharded state dict built for saving (which this consumes)."""
    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
    tensors = _sharded_tensors(sharded)
    shards: List[LocalShard] = []
    # fp32 master pieces by model key: a bf16/fp16 model weight equal to its master cast
    # down is derivable. Each rank checks the part where it holds both (every holder of a
    # master piece also holds that region of the model weight, so together the ranks check
    # every element; the planner requires all holders to report no counter-example).
    masters: Dict[str, List[Tuple[Box, torch.Tensor]]] = {}
    for st in tensors:
        if st.key.startswith(MASTER_PREFIX) and st.data is not None:
            data = st.data.detach().reshape(-1)
            for box, rng in _pieces(st):
                masters.setdefault(st.key[len(MASTER_PREFIX):], []).append((box, data[rng]))
    for st in tensors:
        if st.data is None:
            raise StateError(f"{st.key}: a ShardedTensor without data cannot be saved")
        if st.flattened_range is not None and st.flattened_range.stop == st.flattened_range.start:
            continue
        data = st.data.detach()
        if st.flattened_range is None and tuple(data.shape) != tuple(st.local_shape):
            raise StateError(f"{st.key}: data of shape {list(data.shape)} for local shape "
                             f"{list(st.local_shape)}")
        flat = data.reshape(-1)
        kind = kind_of(st.key)
        derive = None
        if kind is Kind.MODEL and data.dtype in (torch.bfloat16, torch.float16):
            derive = MASTER_PREFIX + st.key
        for box, rng in _pieces(st):
            t = flat[rng].view(box.lengths)
            ok = derive is not None and _no_counter_example(box, t, masters.get(st.key, ()))
            shards.append(LocalShard(st.key, kind, tuple(st.global_shape), box, t,
                                     derive=derive, derive_ok=ok, replicated=True))
    objects = {}
    for v in nested_values(sharded):
        if isinstance(v, ShardedObject) and is_main_replica(v.replica_id):
            objects[v.unique_key] = v.data
    return shards, objects, common


def _no_counter_example(box: Box, t: torch.Tensor, masters) -> bool:
    """No element of model box ``box`` that this rank also holds a master for differs from
    that master cast to the model dtype."""
    for mbox, m in masters:
        inter = box.intersect(mbox)
        if inter is not None and not same_bytes(m.view(mbox.lengths)[inter.slices(mbox)].to(t.dtype),
                                                 t[inter.slices(box)]):
            return False
    return True


def _shape_of(tree):
    """The nesting of ``tree`` without its leaves (and without the optional shared step)."""
    if isinstance(tree, dict):
        return {k: _shape_of(v) for k, v in tree.items() if k not in ("common_step", "state")}
    if isinstance(tree, (list, tuple)):
        return [_shape_of(v) for v in tree]
    return None


def reconcile_common(saved: dict, target: dict) -> dict:
    """The common (non-tensor) state to load: the saved one when this job's has the same
    structure; otherwise (the optimizer was split differently, e.g. expert parameters in
    their own optimizer at EP=2 but not at EP=1) this job's own, with what the checkpoint
    decides carried over: the optimizer step and the grad scaler. Hyper-parameters then
    come from this job's configuration and the LR scheduler's restored state."""
    if _shape_of(saved.get("optimizer")) == _shape_of(target.get("optimizer")) or "optimizer" not in target:
        return saved
    out = dict(saved, optimizer=target["optimizer"])
    step = jsontree.find(saved.get("optimizer"), "common_step")
    scaler = jsontree.find(saved.get("optimizer"), "grad_scaler")
    for d in list(jsontree.dicts(out["optimizer"])):
        if "param_groups" in d:     # a torch optimizer's state dict
            if step is not None:
                d.setdefault("state", {})["common_step"] = step
            else:
                d.setdefault("state", {}).pop("common_step", None)
        if scaler is not None and "grad_scaler" in d:
            d["grad_scaler"] = scaler
    return out


def optimizer_parts(optimizer) -> list:
    """The Megatron optimizers a (possibly chained) Megatron optimizer steps, in order."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _fresh(torch_optimizer) -> bool:
    """No update was ever applied (e.g. every step so far skipped by the fp16 loss scaler)."""
    return not any(st for st in torch_optimizer.state.values())


def never_stepped(optimizer) -> List[bool]:
    """Per torch optimizer inside a Megatron optimizer: it has no state yet."""
    return [_fresh(o.optimizer) for o in optimizer_parts(optimizer) if getattr(o, "optimizer", None) is not None]


def drop_fresh_state(state_dict, never: List[bool]) -> None:
    """Empty the torch optimizer state inside the loadable ``state_dict`` (a Megatron optimizer's,
    or a ChainedOptimizer's by position) of each part saved with ``never`` stepped: it was
    saved without moments, and an Adam state without its step cannot even be loaded."""
    parts = [state_dict] if len(never) == 1 else [v for _, v in sorted(state_dict.items())]
    for part, fresh in zip(parts, never):
        inner = part.get("optimizer", part) if isinstance(part, dict) else None
        if fresh and isinstance(inner, dict) and "state" in inner:
            inner["state"] = {}


def _read_padded(reader: CheckpointReader, name: str, meta: ShardedTensor, dtype) -> torch.Tensor:
    """This rank's box of ``meta`` from the checkpoint's tensor ``name`` of another shape: refused
    unless ``meta`` declares padding (a vocabulary padded to a multiple of the TP size), when the
    part both shapes have is read and the rest of this model's padding is zero."""
    shape = tuple(reader.entry(name).shape)
    if not (meta.allow_shape_mismatch and meta.flattened_range is None and len(shape) == len(meta.global_shape)):
        raise StateError(f"{name}: the checkpoint holds shape {list(shape)} but this model "
                         f"needs {list(meta.global_shape)}; model configurations differ")
    box = _global_box(meta)
    out = torch.zeros(box.lengths, dtype=dtype)
    inter = box.intersect(Box.full(shape))
    if inter is not None:
        reader.read(name, inter, out=out[inter.slices(box)])
    return out


def saved_objects(reader: CheckpointReader, candidates: Tuple[int, ...] = ()) -> RankObjectLookup:
    """megatron-core's ShardedObjects of a checkpoint by unique key, each saving rank's main
    replicas in its objects, read when first asked for: ``candidates`` first (a load in the layout
    it saved: this rank, then the ranks that may hold replicas of its state, lowest first)."""
    return RankObjectLookup(reader, candidates, lambda tree, where: RankObjects.of(tree, where).sharded_objects)


def stage_load(sharded_state_dict: dict, reader: CheckpointReader, common: dict,
               sharded_objects: Dict[str, object], strict: bool = True, absent: Tuple[str, ...] = (),
               unread: set = frozenset()):
    """The plain state dict for ``sharded_state_dict`` (built with ``is_loading=True``),
    read from ``reader``; ``common`` is the saved common state, ``sharded_objects`` the saved
    ShardedObjects of all ranks by unique key. Missing tensors are an error unless not
    ``strict``, when they keep the value the target already has and are returned by name.
    Tensors whose key contains one of ``absent`` may be missing silently (they keep the
    target's value): state the saving job did not have yet.  Tensors whose data lies in
    ``unread`` (:func:`distopt_refreshed`) keep the target's value, to be made later."""
    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    sharded, target_common = extract_sharded_base(sharded)
    common = reconcile_common(common, target_common)
    missing: List[str] = []

    def fill(v):
        if isinstance(v, ShardedObject):
            if v.unique_key not in sharded_objects:
                raise StateError(f"{reader.dir}: the checkpoint has no object {v.unique_key!r} "
                                  f"(saved: {sorted(sharded_objects)[:8]})")
            return sharded_objects[v.unique_key]
        if not isinstance(v, ShardedTensor):
            return v
        if v.data is not None and _place(v) in unread:
            return v.data
        if not reader.has(v.key):
            if any(a in v.key for a in absent):
                return v.data
            if strict:
                raise StateError(f"{reader.dir}: the checkpoint has no tensor {v.key!r}; is it a "
                                  "checkpoint of this model? (load with strict=False to keep the "
                                  "current values of missing tensors)")
            missing.append(v.key)
            return v.data
        if tuple(reader.entry(v.key).shape) != tuple(v.global_shape):
            return _read_padded(reader, v.key, v, v.dtype).view(tuple(v.local_shape))
        if v.flattened_range is None:
            out = torch.empty(tuple(v.local_shape), dtype=v.dtype)
        else:
            out = torch.empty(v.flattened_range.stop - v.flattened_range.start, dtype=v.dtype)
        flat = out.view(-1)
        for box, rng in _pieces(v):
            reader.read(v.key, box, out=flat[rng].view(box.lengths))
        if v.data is not None and v.data.device.type != "cpu":
            out = out.to(v.data.device)
        return out

    dict_list_map_inplace(fill, sharded)
    state = common
    merge(state, nonpersistent)
    merge(state, sharded)
    state = apply_factory_merges(state, factories)
    return state, missing


# ------------------------------------------------------------------ DistributedOptimizer
# megatron-core 0.16 can describe a DistributedOptimizer's state per parameter only by
# gathering it over data-parallel ranks ('fully_reshardable') or by its internal buffers
# ('dp_reshardable', which only reshards over DP); flat ranges in ShardedTensors are no
# longer supported. AdaCheck reads each rank's own range of each parameter straight from
# the optimizer: no gather, no copy, and the same logical tensors a plain optimizer gives.

_DISTOPT_NAMES = {"param": "fp32_param"}


def _distopt_name(k: str, meta: ShardedTensor) -> str:
    """The logical tensor of a DistributedOptimizer's state ``k`` ("param": the main weights) of
    the parameter ``meta``: the name a plain optimizer's sharded state dict gives it."""
    return f"optimizer.state.{_DISTOPT_NAMES.get(k, k)}.{meta.key}"


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside ``optimizer`` ([] if it uses none)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    dist = [o for o in subs if isinstance(o, DistributedOptimizer)]
    if dist and len(dist) != len(subs):
        raise StateError("a ChainedOptimizer mixing DistributedOptimizer and other optimizers is "
                         "not supported by AdaCheck")
    return dist


def param_to_sharded(model_sd: dict) -> Dict[int, ShardedTensor]:
    out = {}
    for v in nested_values(model_sd):
        if isinstance(v, ShardedTensor) and v.data is not None:
            out[id(v.data)] = v
    return out


def local_ranges(opt):
    """(model_param, start, stop) of the flattened parameter that this DP rank's optimizer owns."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                for model_param, ranges in bucket["param_map"].items():
                    r = ranges["param"]
                    if r.end > r.start:
                        yield model_param, r.start, r.end


def model_meta(by_param, model_param) -> ShardedTensor:
    try:
        return by_param[id(model_param)]
    except KeyError:
        raise StateError(f"a parameter of shape {list(model_param.shape)} handled by the "
                         "DistributedOptimizer is not in the model's sharded_state_dict") from None


def init_empty_state(subs) -> None:
    """Give never-stepped optimizers the state torch's Adam creates lazily at its first
    step (zeros, overwritten by the load; the parameters are not touched, unlike a dummy
    step), so that the state to load into has its final keys."""
    for opt in subs:
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


def distopt_describe(optimizer, model_sd: dict) -> Tuple[List[LocalShard], list]:
    """Shards of this rank's DistributedOptimizer state, and its non-tensor state per
    sub-optimizer (param groups with the shared step, grad scaler)."""
    by_param = param_to_sharded(model_sd)
    shards: List[LocalShard] = []
    commons = []
    for opt in distributed_optimizers(optimizer):
        # never stepped (e.g. every step so far skipped by the fp16 loss scaler): Megatron's
        # state_dict needs the step its Adam creates at the first update, so the save describes
        # that initial state (the optimizer itself is left without state; the load drops it again)
        fresh = _fresh(opt.optimizer)
        if fresh:
            init_empty_state([opt])
        try:
            commons.append(opt.state_dict())
            for model_param, start, stop in local_ranges(opt):
                meta = model_meta(by_param, model_param)
                for k, t in opt._get_main_param_and_optimizer_states(model_param).items():
                    if k == "step":
                        continue   # shared by all parameters; in the param groups
                    name = _distopt_name(k, meta)
                    flat = t.detach().reshape(-1)
                    if flat.numel() != stop - start:
                        raise StateError(f"{name}: optimizer holds {flat.numel()} elements for the range "
                                         f"[{start}, {stop})")
                    for box, rng in flat_pieces(_global_box(meta), start, stop):
                        shards.append(LocalShard(name, kind_of(name), tuple(meta.global_shape), box,
                                                 flat[rng].view(box.lengths), replicated=True))
        finally:
            if fresh:
                opt.optimizer.state.clear()
    return shards, commons


def distopt_partition_map(optimizer, model_sd: dict, key_of: Callable[[torch.Tensor], Optional[str]]) -> Dict[str, dict]:
    """What each main-parameter shard this rank's DistributedOptimizers step is (tap key -> the
    torch optimizer's index, its element count, whether it is an expert-parallel parameter and
    its one piece: the logical parameter and the flat range): saved with an online base, so that a job on another number of
    data-parallel ranks can rebuild this rank's shards and replay its deltas."""
    by_param = param_to_sharded(model_sd)
    out: Dict[str, dict] = {}
    for oi, opt in enumerate(distributed_optimizers(optimizer)):
        for model_param, start, stop in local_ranges(opt):
            main = opt._get_main_param_and_optimizer_states(model_param)["param"]
            key = key_of(main)
            if key is None:
                raise StateError("AdaCheck online: a main-parameter shard of the DistributedOptimizer has no key")
            # expert-parallel parameters (megatron's mark: not all-reduced over the data-parallel
            # group) are replicated over the expert data-parallel group, not the dense one
            out[key] = {"optimizer": oi, "numel": stop - start, "expert": not getattr(model_param, "allreduce", True),
                        "pieces": [[param_ident(model_meta(by_param, model_param)), start, stop - start, 0]]}
    return out


def param_ident(meta: ShardedTensor) -> str:
    """A parameter's name in a partition map: its logical tensor and where it lies in it
    (megatron-core stacks the layers' parameters, and experts, under one key)."""
    return f"{meta.key}@{','.join(str(o) for o in _global_box(meta).offsets)}"


def _read_range(reader: CheckpointReader, name: str, meta: ShardedTensor, start: int, stop: int, dtype) -> torch.Tensor:
    """Elements [start, stop) of this rank's box of ``meta`` flattened, from the checkpoint's tensor
    ``name``; one of another shape (a vocabulary padded for another TP size) as :func:`_read_padded`
    gives it."""
    if tuple(reader.entry(name).shape) != tuple(meta.global_shape):
        return _read_padded(reader, name, meta, dtype).reshape(-1)[start:stop].clone()
    return reader.read_flat(name, start, stop, dtype=dtype, within=_global_box(meta))


def _stage_range(reader: CheckpointReader, name: str, meta: ShardedTensor, start: int, stop: int, dtype):
    """:func:`_read_range` not copied yet: :class:`Pieces` (verified views of the mapped shard
    files, copied once at apply by :func:`_copy`), or a tensor for a saved tensor of another
    shape."""
    if tuple(reader.entry(name).shape) != tuple(meta.global_shape):
        return _read_range(reader, name, meta, start, stop, dtype)
    return reader.pieces(name, start, stop, dtype=dtype, within=_global_box(meta))


def _copy(dst: torch.Tensor, src) -> torch.Tensor:
    """``dst`` set to what :func:`_stage_range` staged."""
    return src.copy_into(dst) if isinstance(src, Pieces) else dst.copy_(src)


def distopt_read_shard(reader: CheckpointReader, meta: ShardedTensor, start: int, stop: int,
                       names) -> Dict[str, torch.Tensor]:
    """Elements [start, stop) of a flattened parameter's main weights ("param") and optimizer
    state (``names``) from the checkpoint: a DistributedOptimizer shard of any rank."""
    return {k: _read_range(reader, _distopt_name(k, meta), meta, start, stop, torch.float32) for k in names}


def distopt_stage_load(optimizer, model_sd: dict, reader: CheckpointReader, commons: list):
    """Read this rank's ranges of every DistributedOptimizer state (nothing is changed yet)."""
    subs = distributed_optimizers(optimizer)
    if not commons:
        raise StateError(f"{reader.dir}: the checkpoint has no DistributedOptimizer state; load "
                          "with --no-load-optim to take the weights only")
    by_param = param_to_sharded(model_sd)
    init_empty_state(subs)
    staged = []
    for opt in subs:
        part = []
        for model_param, start, stop in local_ranges(opt):
            meta = model_meta(by_param, model_param)
            tensors = {}
            for k, t in opt._get_main_param_and_optimizer_states(model_param).items():
                if k != "step":
                    tensors[k] = _stage_range(reader, _distopt_name(k, meta), meta, start, stop, t.dtype)
            part.append((model_param, tensors))
        staged.append(part)
    return staged


def distopt_stage_main(optimizer, model_sd: dict, reader: CheckpointReader) -> list:
    """This rank's shards of the main weights of every DistributedOptimizer, read from the
    checkpoint (nothing is changed yet): a load without the optimizer state (``--no-load-optim``,
    ``--finetune``) whose module weights megatron-core makes from them (:func:`distopt_refreshed`)."""
    by_param = param_to_sharded(model_sd)
    return [[(model_param, _stage_range(reader, _distopt_name("param", meta), meta, start, stop, torch.float32))
             for model_param, start, stop in local_ranges(opt) for meta in [model_meta(by_param, model_param)]]
            for opt in distributed_optimizers(optimizer)]


@torch.no_grad()
def distopt_set_main(optimizer, staged: list) -> None:
    """Set the main-weight shards :func:`distopt_stage_main` read."""
    for opt, part in zip(distributed_optimizers(optimizer), staged):
        for model_param, main in part:
            _copy(opt._get_main_param_and_optimizer_states(model_param)["param"], main)


def _place(meta: ShardedTensor) -> tuple:
    """Which part of which logical tensor a ShardedTensor is (a sharded state dict built to load
    into holds other tensors than the parameters)."""
    return meta.key, tuple(meta.global_offset), meta.flattened_range is None


def distopt_refreshed(optimizer, model_chunks, model_sd: dict, reader: CheckpointReader) -> set:
    """The parameters (:func:`_place`) whose module weights this load does not read but has
    megatron-core make again from the main weights it loads (:func:`distopt_refresh`: each rank
    casts its main shards into the parameter buffers, then they are all-gathered), or none:
    every parameter in the model's buffers, when the checkpoint holds each as its main weights'
    proved cast (so the cast gives back every saved bit) and megatron-core's copy is that cast
    (bf16 / fp16 / fp32 parameters; not with the precision-aware optimizer, FP8 or Megatron-FSDP,
    which copy otherwise).  Rebuilding them read every data-parallel rank's fp32 main weights on
    every rank."""
    subs = distributed_optimizers(optimizer)
    for opt in subs:
        config, ddp = getattr(opt, "config", None), getattr(opt, "ddp_config", None)
        if (getattr(opt, "is_stub_optimizer", True) or getattr(config, "use_precision_aware_optimizer", True)
                or getattr(ddp, "use_megatron_fsdp", True)):
            return set()
    if not subs or any(not hasattr(chunk, "param_to_bucket_group") for chunk in model_chunks):
        return set()
    by_param, out = param_to_sharded(model_sd), set()
    for chunk in model_chunks:
        for param in chunk.param_to_bucket_group:       # what the all-gather writes: every buffer's parameters
            meta = by_param.get(id(param))
            if meta is None or param.dtype not in (torch.bfloat16, torch.float16, torch.float32) or _float8(param) \
                    or not reader.is_cast_of(meta.key, MASTER_PREFIX + meta.key, param.dtype):
                return set()
            out.add(_place(meta))
    return out


def _float8(param) -> bool:
    try:
        from megatron.core.fp8_utils import is_float8tensor
    except ImportError:     # a megatron-core without it has no FP8 parameters of this kind
        return False
    return bool(is_float8tensor(param))


def distopt_refresh(optimizer, model_chunks) -> None:
    """The module weights from the loaded main weights, with megatron-core's own code (collective
    over the data-parallel group): each rank's main shard cast into the parameter buffer, then
    the buffers all-gathered synchronously (a gather still in flight is waited for first)."""
    for opt in distributed_optimizers(optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in model_chunks:
        for group in list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", [])):
            if getattr(group, "param_gather_handle", None) is not None:
                group.param_gather_handle.wait()
                group.param_gather_handle = None
        chunk.start_param_sync(force_sync=True)


def _distopt_commons(subs, saved: list) -> list:
    """The saved non-tensor state per sub-optimizer; when the optimizer is split differently
    now (expert parameters in their own optimizer or not), this job's own with the saved
    step and grad scaler (see reconcile_common)."""
    if len(saved) == len(subs) and all(
            len(a["optimizer"]["param_groups"]) == len(b.optimizer.param_groups) for a, b in zip(saved, subs)):
        return saved
    step = jsontree.find(saved, "step")
    scaler = jsontree.find(saved, "grad_scaler")
    out = []
    for opt in subs:
        sd = opt.state_dict()
        for g in sd["optimizer"]["param_groups"]:
            if step is not None:
                g["step"] = step
        if scaler is not None and "grad_scaler" in sd:
            sd["grad_scaler"] = scaler
        out.append(sd)
    return out


def distopt_apply(optimizer, staged, commons, never: Optional[List[bool]] = None) -> None:
    """Set the staged state; ``never``: per sub-optimizer, saved before any update was applied
    (its state is left empty, as the saving job's was)."""
    subs = distributed_optimizers(optimizer)
    never = list(never or []) + [False] * len(subs)
    for opt, part, common, fresh in zip(subs, staged, _distopt_commons(subs, commons), never):
        opt.load_state_dict(common)   # param groups, shared step, grad scaler; allocates state
        # megatron-core's setter copies each tensor into the one it holds, except with the
        # precision-aware optimizer (scaled state): there it gets tensors of its own
        own = getattr(getattr(opt, "config", None), "use_precision_aware_optimizer_no_fp8_or_ds_fp8", True) is False
        # DistributedOptimizer.load_state_dict gives every parameter the same step tensor and
        # torch's Adam increments each parameter's step in place: a shared tensor would
        # advance once per parameter per step (silently wrong bias correction). One each:
        for st in opt.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
        for model_param, tensors in part:
            live = opt._get_main_param_and_optimizer_states(model_param)
            if set(live) - {"step"} != set(tensors):
                raise StateError(f"optimizer state keys {sorted(live)} differ from the loaded "
                                 f"{sorted(tensors)}")
            if own:       # (the same copies, straight from the files)
                for k, src in tensors.items():
                    _copy(live[k], src)
            else:
                opt._set_main_param_and_optimizer_states(model_param, dict(
                    {k: src.tensor() if isinstance(src, Pieces) else src for k, src in tensors.items()},
                    step=live.get("step")))
        if fresh:
            opt.optimizer.state.clear()
