"""AdaCheck <-> megatron-core ``torch_dist`` (dist_checkpointing) checkpoints, offline.

Both formats name the same logical tensors (megatron-core's sharded keys), so conversion
needs no model and no particular layout: one process moves whole logical tensors.

``to_torch_dist(src, out)``: every model / optimizer tensor of an AdaCheck Megatron checkpoint
becomes one full-size ShardedTensor of a torch_dist checkpoint, written by megatron-core's
own ``dist_checkpointing.save``; the common state (optimizer param groups and step,
iteration, LR scheduler, FLOPs counter, arguments) is what Megatron keeps there. The result
loads with megatron-core's ``dist_checkpointing.load`` into any TP / PP / EP / DP layout of
the model with the same optimizer kind (``sharded_state_dict`` of a plain optimizer; of a
DistributedOptimizer with ``distrib_optim_sharding_type: fully_reshardable``). RNG states
are per rank and layout and are not converted (load with ``--no-load-rng``).

``from_torch_dist(src, save_dir)``: the reverse, for a torch_dist checkpoint of a plain
optimizer or of a DistributedOptimizer saved as ``fully_reshardable`` (the ``dp_reshardable``
layout describes internal buffers, not parameters, and is refused with a hint). Tensors are
read one at a time with megatron-core's own loader.

Peak memory: ``to_torch_dist`` streams: megatron-core's ``dist_checkpointing.save`` gets a state
dict of shape-only (meta) tensors and a save strategy that writes the same torch_dist files
(PyTorch DCP, one file per tensor) while reading each logical tensor from the AdaCheck
checkpoint only when its bytes are due, so about two logical tensors are in memory at once
(PyTorch's writer still holds the previous one while the next is read). ``from_torch_dist`` too: the
AdaCheck save gets deferred tensors, read one at a time with megatron-core's loader when they
are hashed and again when written (two reads of the source, one tensor in memory; a weight
and its fp32 master are compared once, two tensors).
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import warnings
from typing import Callable, Optional

import megatron.core
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from adacheck import checkpoint as core
from adacheck.integration import Kind, LocalShard, LocalState
from adacheck.format import jsontree
from adacheck.cli.convert import output_dir
from adacheck.errors import ConfigError, StateError
from adacheck.plan.exchange import SoloComm, one_process_group

from adacheck.types import Box, Manifest, torch_dtype

from .saved import Objects, RankObjects, tracked_checkpoint
from .parallel import json_args
from .state import MASTER_PREFIX, kind_of

_DISTOPT_PARAM = "optimizer.state.param."
_TOP_LEVEL = ("iteration", "opt_param_scheduler", "num_floating_point_operations_so_far", "args",
              "checkpoint_version", "rng_state", "rerun_state_machine_state")


def _solo_group():
    """dist_checkpointing needs a process group (exchange.one_process_group); returns its teardown."""
    if not torch.cuda.is_available():   # dist_checkpointing synchronizes CUDA even offline
        from .cpu import enable_cpu
        enable_cpu()
    return one_process_group()


def _streaming_strategy(load: Callable[[str], torch.Tensor]):
    """A torch_dist save strategy whose tensors are read only when written: the state dict holds
    meta tensors (shapes and dtypes for the plan and metadata) and ``load(key)`` gives the bytes.
    The files are PyTorch DCP's, as megatron-core's own torch_dist strategy writes them (tensors
    under their sharded keys, sharded objects as pickled lists under their unique keys; one
    file per item), so megatron-core's loader reads them into any layout."""


    class Planner(DefaultSavePlanner):
        def resolve_data(self, item):
            if item.type == WriteItemType.BYTE_IO:     # already serialized, as megatron-core does
                return self.lookup_object(item.index)
            t = load(item.index.fqn)
            want = self.lookup_object(item.index)
            if t.dtype != want.dtype or t.shape != want.shape:
                raise StateError(f"{item.index.fqn}: read {t.dtype}{list(t.shape)}, the manifest says "
                                 f"{want.dtype}{list(want.shape)}")
            return t

    # a TorchDistSaveShardedStrategy, not a SaveShardedStrategy: megatron-core 0.19 removed the
    # base class, and its dist_checkpointing.save replaces any strategy of another class
    class Streaming(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            flat = {}
            for v in nested_values(sharded_state_dict):
                if isinstance(v, ShardedTensor):
                    flat[v.key] = v.data
                elif isinstance(v, ShardedObject):
                    buf = io.BytesIO()
                    torch.save([v.data], buf)
                    flat[v.unique_key] = buf
            # one file per tensor: PyTorch's writer keeps every tensor of a file referenced until
            # the file is closed, so one file for all would hold the whole state in memory
            writer = dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=False, thread_count=1,
                                          sync_files=True)
            dcp.save(flat, storage_writer=writer, planner=Planner(flatten_state_dict=False,
                                                                  flatten_sharded_tensors=False))

    return Streaming("torch_dist", 1)


def to_torch_dist(src: str, out_dir: str, tag: Optional[str] = None, verify: bool = True,
                  progress: Optional[Callable[[int, int], None]] = None) -> str:
    """Convert AdaCheck checkpoint ``src`` to a torch_dist checkpoint ``<out_dir>/iter_NNNNNNN``
    (plus Megatron-LM's ``latest_checkpointed_iteration.txt``); returns that directory."""

    r = core.CheckpointReader(core.resolve(src, tag), verify=verify, cache_bytes=32 << 20)   # streams
    r.framework("megatron", "Megatron", "torch_dist conversion needs an AdaCheck checkpoint of megatron-core")
    objects = Objects.of(r.objects(), f"the objects of {r.dir}")
    iteration = objects.iteration
    final = os.path.join(out_dir, f"iter_{iteration:07d}")
    distopt = objects.distributed_optimizer
    common = dict(objects.common)
    if distopt is not None:   # DistributedOptimizer, as its 'fully_reshardable' state dict
        opt = [dict(d, param_state_sharding_type="fully_reshardable") for d in distopt]
        common["optimizer"] = opt[0] if len(opt) == 1 else dict(enumerate(opt))
    state = dict(common, iteration=iteration, opt_param_scheduler=objects.opt_param_scheduler,
                 num_floating_point_operations_so_far=objects.num_floating_point_operations_so_far,
                 args=argparse.Namespace(**objects.args), checkpoint_version=3.0)
    names = sorted(n for n, e in r.manifest.tensors.items() if e.kind in ("model", "master", "optim"))
    tensors, sources = {}, {}
    for n in names:
        key = n
        if distopt is not None and n.startswith(MASTER_PREFIX):
            key = _DISTOPT_PARAM + n[len(MASTER_PREFIX):]
        e = r.manifest.tensors[n]
        shape = tuple(e.shape)
        tensors[key] = ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=torch_dtype(e.dtype),
                                                                        device="meta"), replica_id=0)
        sources[key] = n
    state["adacheck_tensors"] = tensors
    done = [0]

    def load(key: str) -> torch.Tensor:
        t = r.read(sources[key])
        done[0] += 1
        if progress:
            progress(done[0], len(names))
        return t
    objs = {}
    for i in range(len(r.manifest.rank_objects)):
        objs.update(RankObjects.of(r.objects(i), f"rank {i}'s objects of {r.dir}").sharded_objects)
    state["adacheck_objects"] = {uk: dataclasses.replace(ShardedObject.empty_from_unique_key(uk), data=v)
                                 for uk, v in sorted(objs.items())}
    done_with_group = _solo_group()
    try:
        with output_dir(final, os.path.join(out_dir, "latest_checkpointed_iteration.txt"), str(iteration)) as tmp:
            dist_checkpointing.save(state, tmp, sharded_strategy=_streaming_strategy(load))
    finally:
        done_with_group()
    return final


def _fully_reshardable(src: str, opt) -> Optional[list]:
    """The DistributedOptimizers' common state in a torch_dist checkpoint's optimizer entry ``opt``,
    saved ``fully_reshardable`` (None: a plain optimizer); the other layouts are refused."""
    def distopt(d) -> bool:
        return isinstance(d, dict) and "param_state_sharding_type" in d

    if distopt(opt):
        subs = [opt]
    elif isinstance(opt, dict) and any(distopt(d) for d in opt.values()):    # a ChainedOptimizer's
        subs = [opt[k] for k in sorted(opt)]
    else:
        return None
    kinds = {d["param_state_sharding_type"] for d in subs if distopt(d)}
    if kinds - {"fully_reshardable"}:
        raise StateError(f"{src}: DistributedOptimizer state saved as {sorted(kinds)} describes "
                         "internal buffers, not parameters; re-save it with the 'fully_reshardable' "
                         "layout (Megatron-LM: --dist-ckpt-optim-fully-reshardable)")
    return [{k: v for k, v in d.items() if k not in ("param_state_sharding_type", "param_state")} for d in subs]


def _plain_sharded_objects(src: str) -> dict:
    """A torch_dist checkpoint's ShardedObjects that are plain values, by unique key (RNG states are
    per rank and layout: not converted; any other is left out with a warning). The common state,
    a ShardedObject 'common_state' from megatron-core 0.19 on, is load_common_state_dict's."""
    sharded_objects, skipped = {}, []
    want = {v.unique_key: ShardedObject.empty_from_unique_key(v.unique_key)
            for v in load_sharded_metadata(src).values()
            if isinstance(v, ShardedObject) and v.key not in ("rng_state", "common_state")}
    loaded = dist_checkpointing.load(want, src) if want else {}
    for uk in sorted(want):   # load also returns the common state, merged in
        got = loaded[uk]
        try:
            jsontree.encode(got, uk)
        except StateError:
            skipped.append(uk)
            continue
        sharded_objects[uk] = got
    if skipped:
        warnings.warn(f"AdaCheck: {len(skipped)} sharded objects are not plain values and were not "
                      f"converted: {skipped[:8]}")
    return sharded_objects


def _deferred_shards(src: str, meta: dict, progress: Optional[Callable[[int, int], None]]):
    """(the shards of every tensor of a torch_dist checkpoint, each read with megatron-core's loader
    only when the save hashes or writes it; their source, to release). A weight that is its master
    cast down is saved as that derivation."""
    reads, total = [0], [0]

    def read(key: str) -> torch.Tensor:   # one tensor, with megatron-core's loader
        m = meta[key]
        want = ShardedTensor.from_rank_offsets(key, torch.empty(tuple(m.global_shape), dtype=m.dtype),
                                               replica_id=0)
        t = dist_checkpointing.load({"t": want}, src)["t"]
        reads[0] += 1
        if progress:
            progress(min(reads[0], total[0]), total[0])
        return t

    source = core.DeferredSource(read)
    key_of = {MASTER_PREFIX + k[len(_DISTOPT_PARAM):] if k.startswith(_DISTOPT_PARAM) else k: k
              for k in sorted(meta)}
    plan = []   # name, shape, kind, its master, compare them?
    for name in sorted(key_of):
        shape = tuple(meta[key_of[name]].global_shape)
        kind = kind_of(name)
        master = MASTER_PREFIX + name if kind is Kind.MODEL and MASTER_PREFIX + name in key_of else None
        plan.append((name, shape, kind, master,
                     master is not None and tuple(meta[key_of[master]].global_shape) == shape))
    # reads: each tensor to hash it and again to write it, and each compared pair once
    total[0] = 2 * len(plan) + 2 * sum(compare for *_, compare in plan)
    shards = []
    for name, shape, kind, master, compare in plan:
        ok = False
        if compare:   # is the weight its master cast down? (then only the master is stored)
            t = source.get(key_of[name])
            ok = bool(torch.equal(read(key_of[master]).to(t.dtype), t))
        shards.append(LocalShard(name, kind, shape, Box.full(shape),
                                      source.tensor(key_of[name], shape, meta[key_of[name]].dtype),
                                      derive=master, derive_ok=ok))
    total[0] -= sum(sh.derive_ok for sh in shards)   # a weight that is its master cast is not written
    return shards, source


def from_torch_dist(src: str, save_dir: str, progress: Optional[Callable[[int, int], None]] = None,
                    fsync: bool = True) -> Manifest:
    """Convert the torch_dist checkpoint directory ``src`` (``iter_NNNNNNN``, or a save dir
    with Megatron-LM's latest_checkpointed_iteration.txt) into an AdaCheck checkpoint under
    ``save_dir``; returns its manifest."""

    src = tracked_checkpoint(src) or src
    if not os.path.isfile(os.path.join(src, "metadata.json")):
        raise ConfigError(f"{src} is not a torch_dist checkpoint (no metadata.json)")
    done_with_group = _solo_group()
    try:
        common = dist_checkpointing.load_common_state_dict(src)
        meta = dist_checkpointing.load_tensors_metadata(src)
        distopt = _fully_reshardable(src, common.get("optimizer"))
        sharded_objects = _plain_sharded_objects(src)
        shards, source = _deferred_shards(src, meta, progress)
    except BaseException:
        done_with_group()
        raise
    rest = {k: v for k, v in common.items() if k not in _TOP_LEVEL}
    if distopt is not None:
        rest.pop("optimizer", None)
    args = common.get("args")
    iteration = int(common.get("iteration", 0))
    objects = Objects(common=rest, iteration=iteration, opt_param_scheduler=common.get("opt_param_scheduler"),
                      num_floating_point_operations_so_far=float(common.get("num_floating_point_operations_so_far", 0)),
                      args=json_args(args) if isinstance(args, argparse.Namespace) else {},
                      distributed_optimizer=distopt)
    framework = {"name": "megatron", "megatron_core": megatron.core.__version__, "torch": torch.__version__,
                 "converted_from": os.path.abspath(src), "distributed_optimizer": distopt is not None,
                 "layout": {}, "names": {"model": "", "master": MASTER_PREFIX}}
    state = LocalState(shards=shards, objects=objects.tree(),
                            rank_objects=RankObjects(sharded_objects=sharded_objects).tree(),
                            layout={}, framework=framework, step=iteration)
    try:   # the save reads each tensor from src when it hashes it and again when it writes it
        return core.save(SoloComm(), save_dir, f"iter_{iteration:07d}", lambda: state, fsync=fsync,
                         reference_previous=False)
    finally:
        source.release()
        done_with_group()
