"""AdaCheck <-> native DeepSpeed checkpoints of any ZeRO stage, data-parallel and
(Megatron-DeepSpeed) tensor-parallel size, of PipelineEngines (per-layer files, both ways) and
of DeepSpeed-MoE models (per-expert files, to native), written and read by DeepSpeed itself in
engines built around a shell module (the checkpoint's parameters and buffers, no forward code)
with the run's DeepSpeed config; docs/cli.md and docs/deepspeed.md describe how, and what was
tested.

- ``to-native``: the newest committed state (online deltas replayed, in the saving layout,
  first into a temporary base when the target layout differs), saved by DeepSpeed's own
  ``save_checkpoint`` in the target layout;
- ``from-native``: what DeepSpeed's own ``load_checkpoint`` reads, on as many ranks as saved it,
  saved by AdaCheck;
- ``materialise``: one AdaCheck base at the newest recoverable step, in the saving layout.

Tied weights (one nn.Parameter under several names, a GPT-2's ``lm_head.weight``) are one
parameter of the shell under each name, so native files hold every name in ``module`` and
DeepSpeed's ``shared_params``, as DeepSpeed's own save writes them; ``from-native`` reads the
tied names from ``shared_params`` (or, without ZeRO, from the tensors torch.save stored once),
and AdaCheck's save records them (``SavedModel.shared``).  A checkpoint saved before AdaCheck
recorded them converts without the other names (load it in the training job and save once).

Run ``adacheck convert ... --to deepspeed|adacheck`` (ranks started on this machine) or one rank
each under torchrun: ``torchrun --nproc_per_node 8 -m adacheck_ds.native to-native SRC OUT
--zero-stage 2``.  Guaranteed: the output is renamed into place only when every rank is done,
and no existing checkpoint of the same tag is overwritten.  Refused with a ConfigError or
StateError: parameters missing from the source, sub-parameter splits, a TP size that does not
divide a split dimension, a native TP checkpoint without ``universal_checkpoint_info``, and
online deltas to be replayed in another layout than the saving one.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import glob
import importlib
import json
import logging
import os
import pickle
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

import adacheck_ds
from adacheck.storage import commit
from adacheck.online import deltas
from adacheck.cli import local_ranks
from adacheck.checkpoint import CheckpointReader, resolve
from adacheck.cli.convert import publish, refuse_existing
from adacheck.errors import ConfigError, StateError
from adacheck.types import torch_dtype
from .saved import Objects
from .state import refuse_topology

DIRECTIONS = ("to-native", "from-native", "materialise")
# keys DeepSpeed writes into its model-states dict; some versions hand some of them back as
# client state (load_checkpoint's second result), where they are not the user's
_DS_METADATA = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
                "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
                "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions",
                "universal_checkpoint_info", "folding", "ds_autoep_layers", "autoep_layers"}


@dataclass
class ModelSpec:
    params: list                     # [(name, shape, dtype name, requires_grad)] in module order
    buffers: list                    # [(name, shape, dtype name)]
    groups: List[List[str]]          # parameter names per optimizer group, as DeepSpeed got them
    optimizer: Optional[str]         # class path of a client optimizer (None: the config's block)
    ds_config: dict
    lr_scheduler: Optional[dict] = None   # state of a client LR scheduler (no "scheduler" block)
    stage: int = 0                   # the saving layout (for replay / native loads)
    world: int = 1                   # all its ranks (data-parallel x tensor-parallel)
    tp: int = 1                      # its tensor-parallel size
    split: Dict[str, int] = field(default_factory=dict)   # tensor-parallel parameters: split dim
    shared: Dict[str, str] = field(default_factory=dict)  # tied weights: alias -> name in params
    pipeline: Optional[dict] = None  # a PipelineEngine's layers and stages (state.pipeline_layers)
    moe: Optional[list] = None       # DeepSpeed-MoE layers (state.moe_layers)

    @property
    def pp(self) -> int:
        return len(self.pipeline["parts"]) - 1 if self.pipeline else 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


# ------------------------------------------------------------------ the model description
def spec_from_adacheck(ckpt_dir: str, ds_config: Optional[dict] = None):
    """The shell of an AdaCheck DeepSpeed checkpoint, and its manifest."""
    r = CheckpointReader(ckpt_dir, verify=False)
    m = r.manifest
    r.framework("deepspeed", "DeepSpeed", "this conversion rebuilds DeepSpeed engines (Megatron: --to "
                "torch-dist, or load in the training job and save to materialise online deltas)")
    objects = Objects.of(r.objects(), f"the objects of {ckpt_dir}")
    saved = objects.model(ckpt_dir)
    if saved is None:
        raise StateError(f"{ckpt_dir} was saved by an AdaCheck version that did not record the model "
                         "description (model_spec); convert it with --to deepspeed-universal, or load it "
                         "in the training job and save once")
    refuse_topology(ckpt_dir, m, "the conversion to native DeepSpeed files", pipeline_ok=saved.pipeline is not None,
                    experts_ok=bool(saved.moe) and not any(layer["residual"] for layer in saved.moe))
    cfg = ds_config if ds_config is not None else saved.ds_config
    if not isinstance(cfg, dict):
        raise ConfigError(f"{ckpt_dir} does not hold the run's DeepSpeed config; pass it with --ds-config FILE")
    entries = {name: m.tensors.get(f"model/{name}") for name, _ in saved.parameters}
    missing = [name for name, e in entries.items() if e is None]
    if missing:
        raise StateError(f"{ckpt_dir} does not hold the parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         "(saved with exclude_frozen_parameters?); a native checkpoint needs every parameter")
    params = [(n, tuple(entries[n].shape), entries[n].dtype, trainable) for n, trainable in saved.parameters]
    shared = dict(saved.shared or {})
    bad = {a: s for a, s in shared.items() if s not in entries or a in entries}
    if bad:
        raise StateError(f"{ckpt_dir}: the tied weights {dict(list(bad.items())[:3])} do not name "
                         "other names of its parameters; the model description is damaged")
    buffers = [(n, tuple(m.tensors[f"buffer/{n}"].shape), m.tensors[f"buffer/{n}"].dtype)
               for n in saved.buffers if f"buffer/{n}" in m.tensors]
    return ModelSpec(params, buffers, saved.groups, saved.optimizer, cfg,
                     lr_scheduler=objects.lr_scheduler if "scheduler" not in cfg else None,
                     stage=int(m.framework.get("zero_stage", 0)), world=int(m.topology.get("world_size", 1)),
                     tp=int(saved.tensor_parallel.get("size", 1)), split=saved.partition_dims,
                     shared=shared, pipeline=saved.pipeline, moe=saved.moe), m


_UNSUPPORTED_SPLITS = ("parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params",
                       "parameter_to_average_patterns")


def split_from_patterns(names: List[str], info: Optional[dict], where: str) -> Dict[str, int]:
    """Which parameters of a native tensor-parallel checkpoint are split, and along which
    dimension, from the model's ``universal_checkpoint_info`` (DeepSpeed's convention)."""
    if not info or not any(k in info for k in ("tp_replicated_parameter_patterns",
                                               "parameter_with_row_parallelism_patterns")):
        raise StateError(f"{where} is a tensor-parallel checkpoint without universal_checkpoint_info, so "
                         "which parameters are split (and along which dimension) is not recorded; load it in "
                         "the training job with AdaCheck enabled and save once (AdaCheck records it)")

    def matches(key, name):
        return any(isinstance(p, str) and re.match(p, name) for p in info.get(key) or [])

    for key in _UNSUPPORTED_SPLITS:
        # pattern lists; parameter_with_sub_params describes its pieces in structured entries
        odd = [n for n in names if matches(key, n)] or \
            (["..."] if key == "parameter_with_sub_params" and info.get(key) else [])
        if odd:
            raise StateError(f"{where}: {key} ({odd[:3]}) are split in pieces AdaCheck does not "
                             "convert offline; load the checkpoint in the training job with AdaCheck enabled "
                             "and save once")
    return {n: (1 if matches("parameter_with_row_parallelism_patterns", n) else 0)
            for n in names if not matches("tp_replicated_parameter_patterns", n)}


def reach(ckpt_dir: str, m, world: int, step: Optional[int] = None):
    """(online steps to replay, the step a load ends at, the DeepSpeed tag for that state)."""
    pending, last = deltas.reach(ckpt_dir, m.step, world, step, generation=m.framework.get("generation"))
    return pending, last, (f"global_step{last}" if pending else m.tag)


def _native_dir(src: str, tag: Optional[str]) -> str:
    if tag is None:
        tag = commit.read_latest(src)
    d = os.path.join(src, tag) if tag is not None else src
    if not glob.glob(os.path.join(d, "*model_states.pt")):
        raise ConfigError(f"{d} is not a native DeepSpeed checkpoint (no *model_states.pt); pass the "
                          "directory DeepSpeed saved into (with its 'latest') or the tag directory")
    return d


def native_aliases(module: dict, recorded, buffer_names) -> Dict[str, str]:
    """Tied weights in the module state dict of a native model-states file: alias -> the name
    the parameter is stored under.  DeepSpeed's ``shared_params`` when the file has it (it is
    written with ZeRO); else (without ZeRO) the entries torch.save stored as one tensor as an
    earlier entry (the same storage, offset, shape and strides)."""
    if isinstance(recorded, dict):
        bad = [a for a, s in recorded.items() if a not in module or s not in module]
        if bad:
            raise StateError(f"shared_params names {bad[:3]}, which the module state dict does "
                             "not hold; the model-states file is damaged")
        return dict(recorded)
    first: Dict[tuple, str] = {}
    out: Dict[str, str] = {}
    for n, t in module.items():
        if n in buffer_names or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
               t.dtype)
        if key in first:
            out[n] = first[key]
        else:
            first[key] = n
    return out


def _load_plain(path: str) -> dict:
    """A DeepSpeed torch.save file, read without running code (tensors, sizes, dicts, lists and
    plain values: what DeepSpeed writes)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise StateError(f"{path} holds objects other than tensors and plain values, which AdaCheck does not "
                         f"unpickle ({str(e).splitlines()[0]}); load it in the training job with AdaCheck enabled "
                         "and save once instead") from None


_LAYER_FILE = re.compile(r"layer_(\d+)-.*model_states\.pt$")


def native_pipeline(ckpt_dir: str, stage_files: List[str], pp: int):
    """A native PipelineEngine checkpoint's model, rebuilt from DeepSpeed's own files: each stage's
    ``mp_rank_XX_model_states.pt`` (its parameter names per optimizer group and its buffer names)
    and the per-layer files (each layer's state dict, in module order, under its global index).
    Returns (params, buffers, groups, pipeline) as :class:`ModelSpec` and
    :func:`adacheck_ds.state.pipeline_layers` describe them.

    A layer whose parameters are named ``<index>.*`` is a module; a layer file without such names
    holds a tied module (``tied_modules.<key>.*``, the key whose names its state dict has); an index
    with neither is a function, or the tied module used as a function on a stage that lists the
    tied weight but holds no file of it (one is placed in the first free index of that stage, or
    after the last layer).  A stage that holds no layer of its own, or a layout that leaves the
    stage boundaries ambiguous in a way that matters, is refused."""
    states = [_load_plain(f) for f in stage_files]
    files: Dict[int, dict] = {}
    for f in glob.glob(os.path.join(ckpt_dir, "layer_*model_states.pt")):
        m = _LAYER_FILE.search(os.path.basename(f))
        if m is None:       # (a MoE layer's per-expert file: layer_<l>_expert_...)
            continue
        if int(m.group(1)) in files:
            raise StateError(f"{ckpt_dir} holds more than one file of layer {int(m.group(1))} (a tensor-parallel "
                             "pipeline?); this conversion reads pipelines without tensor parallelism")
        files[int(m.group(1))] = _load_plain(f)
    groups: List[List[str]] = []
    stage_names: List[set] = []
    buffer_names: List[str] = []
    frozen: Dict[str, tuple] = {}
    for sd in states:
        names = set()
        for i, g in enumerate(sd.get("param_shapes") or []):
            while len(groups) <= i:
                groups.append([])
            groups[i] += [n for n in g if n not in groups[i]]
            names |= set(g)
        for n, shape in (sd.get("frozen_param_shapes") or {}).items():
            frozen[n] = tuple(shape)
            names.add(n)
        buffer_names += [b for b in sd.get("buffer_names") or [] if b not in buffer_names]
        stage_names.append(names | set(sd.get("buffer_names") or []))
    index = lambda n: int(n.split(".", 1)[0]) if n.split(".", 1)[0].isdigit() else None   # noqa: E731
    tied_key = lambda n: n.split(".")[1] if n.startswith("tied_modules.") else None     # noqa: E731
    known = [sorted({index(n) for n in names if index(n) is not None}) for names in stage_names]
    if any(not k for k in known):
        raise StateError(f"{ckpt_dir}: a pipeline stage holds no layer with parameters of its own, so its "
                         "boundaries cannot be told from the files; load the checkpoint in the training job "
                         "with AdaCheck enabled and save once")
    everything = set().union(*stage_names)
    tied_state = {}     # key -> its names within the tied module
    for n in everything:
        if tied_key(n) is not None:
            tied_state.setdefault(tied_key(n), set()).add(n.split(".", 2)[2])

    def tied_weights(key):   # (the tied module's parameters: what DeepSpeed keeps equal across stages)
        return sorted(tied_state[key] - {b.split(".", 2)[2] for b in buffer_names if tied_key(b) == key})
    layers: Dict[int, list] = {}
    for i, sd in files.items():
        own = {n.split(".", 1)[1] for n in everything if index(n) == i}
        if own:
            if set(sd) != own:
                raise StateError(f"{ckpt_dir}: layer {i}'s file holds {sorted(sd)[:4]}, its stage lists "
                                 f"{sorted(own)[:4]}; the checkpoint is damaged")
            layers[i] = ["module"]
            continue
        keys = [k for k, names in tied_state.items() if names == set(sd)]
        if len(keys) != 1:
            raise StateError(f"{ckpt_dir}: layer {i}'s file holds {sorted(sd)[:4]}, which is "
                             f"{'no' if not keys else 'more than one'} tied module's state; it cannot be rebuilt")
        layers[i] = ["tied", keys[0], True, tied_weights(keys[0])]
    for k in known:
        for i in k:
            layers.setdefault(i, ["module"])
    parts = [0] + [k[0] for k in known[1:]]
    end = max([*layers, *[k[-1] for k in known]]) + 1
    for s in range(pp):      # every stage holds an occurrence of each tied module it lists
        stop = parts[s + 1] if s + 1 < pp else end
        for key in sorted({tied_key(n) for n in stage_names[s] if tied_key(n) is not None}):
            if any(layers.get(i, [None, None])[:2] == ["tied", key] for i in range(parts[s], stop)):
                continue
            free = [i for i in range(parts[s], stop) if i not in layers]
            if not free and s + 1 < pp:
                raise StateError(f"{ckpt_dir}: stage {s} lists the tied module {key!r} but no layer of it, and "
                                 "no free layer index is left for it; it cannot be rebuilt")
            at = free[0] if free else end
            end = max(end, at + 1)
            stop = end if s + 1 == pp else stop
            layers[at] = ["tied", key, False, tied_weights(key)]
    pipeline = {"parts": parts + [end], "layers": [layers.get(i, ["function"]) for i in range(end)]}
    # the parameters in module order: the tied modules (PipelineModule registers them first), then
    # the layers by index, each in its state dict's order
    def entry(name, t):
        return (name, tuple(frozen.get(name, t.shape)), str(t.dtype).replace("torch.", ""),
                name not in frozen and any(name in g for g in groups))
    params, buffers, seen = [], [], set()
    for i in sorted(files):
        rec = layers[i]
        prefix = f"tied_modules.{rec[1]}." if rec[0] == "tied" else f"{i}."
        if rec[0] == "tied" and prefix in seen:
            continue
        seen.add(prefix)
        for k, t in files[i].items():
            (buffers.append((prefix + k, tuple(t.shape), str(t.dtype).replace("torch.", "")))
             if prefix + k in buffer_names else params.append(entry(prefix + k, t)))
    missing = sorted(everything - {p[0] for p in params} - {b[0] for b in buffers})
    if missing:
        raise StateError(f"{ckpt_dir}: {missing[:4]} are listed by a stage but held by no layer file; the "
                         "checkpoint is incomplete")
    params.sort(key=lambda p: (index(p[0]) is not None, index(p[0]) or 0))    # (stable: tied first)
    buffers.sort(key=lambda b: (index(b[0]) is not None, index(b[0]) or 0))
    return params, buffers, groups, pipeline


_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


def native_experts(ckpt_dir: str, module: dict, sd: dict):
    """A native DeepSpeed-MoE checkpoint's model: ``module`` (the model-states file's, which
    leaves the experts out) with every expert's weights from its per-expert file, under its
    global id, put after its layer's gate (where MOELayer holds them); the MoE layers as
    :func:`adacheck_ds.state.moe_layers` describes them (``ep_size``: the number of experts over
    the number a rank holds, which its optimizer groups list); and ``sd`` with its optimizer
    groups naming every rank's experts by global id.  Returns (module, moe layers, sd)."""
    gate = ".deepspeed_moe.gate.wg.weight"
    paths = [n[:-len(gate)] for n in module if n.endswith(gate)]
    counts = sd.get("num_experts")
    counts = counts if isinstance(counts, list) else [counts]
    if len(counts) != len(paths) or not paths:
        raise StateError(f"{ckpt_dir}: the model states list {len(counts)} MoE layers' expert counts and "
                         f"{len(paths)} gates; the checkpoint is damaged")
    residual = [p for p in paths if any(n.startswith((f"{p}.mlp.", f"{p}.coefficient.")) for n in module)]
    if residual:
        raise StateError(f"{ckpt_dir}: the MoE layers {residual[:3]} have a residual MLP, which this conversion "
                         "does not rebuild; load it with AdaCheck enabled in the training job and save once")
    if not sd.get("param_shapes"):
        raise StateError(f"{ckpt_dir} is a native DeepSpeed-MoE checkpoint without ZeRO, whose optimizer state does "
                         "not name the experts it steps; this conversion reads MoE checkpoints of ZeRO 1-2. Load it "
                         "with AdaCheck enabled in the training job (DeepSpeed loads its own files) and save once")
    experts: Dict[int, Dict[int, dict]] = {}
    for f in glob.glob(os.path.join(ckpt_dir, "layer_*_expert_*_model_states.pt")):
        m = _EXPERT_FILE.search(os.path.basename(f))
        if m is None or int(m.group(3)) != 0:
            raise StateError(f"{f}: not a per-expert file of a model without tensor parallelism; this conversion "
                             "reads those only")
        layer, gid = int(m.group(1)), int(m.group(2))
        if layer >= len(paths):
            raise StateError(f"{f} names MoE layer {layer}, the model has {len(paths)}; the checkpoint is damaged")
        state = _load_plain(f)
        want = f"{paths[layer]}{_EXPERTS}{gid}."
        if not state or any(not k.startswith(want) for k in state):
            raise StateError(f"{f} holds {sorted(state)[:3]}, not expert {gid} of {paths[layer]}; the checkpoint is "
                             "damaged")
        experts.setdefault(layer, {})[gid] = state
    moe, local = [], {}
    groups = [list(g) for g in sd.get("param_shapes") or []]
    for layer, (path, count) in enumerate(zip(paths, counts)):
        have = sorted(experts.get(layer, {}))
        if have != list(range(count)):
            raise StateError(f"{ckpt_dir} holds the files of experts {have} of MoE layer {layer} ({path}), of "
                             f"{count}; the checkpoint is incomplete")
        ids = {int(n[len(path) + len(_EXPERTS):].split(".", 1)[0]) for g in groups for n in g
               if n.startswith(path + _EXPERTS)}
        if not ids or count % len(ids):
            raise StateError(f"{ckpt_dir}: the optimizer groups list {len(ids)} local experts of {path}, which does "
                             f"not divide its {count} experts; the checkpoint is damaged")
        local[path] = len(ids)
        moe.append({"path": path, "hidden": int(module[path + gate].shape[1]), "experts": int(count),
                    "ep_size": count // len(ids), "residual": False})
    out = {}
    for n, t in module.items():
        out[n] = t
        for layer, path in enumerate(paths):
            if n == path + gate:    # (MOELayer holds its gate, then its experts)
                for gid in range(counts[layer]):
                    out.update(experts[layer][gid])

    def global_names(name):     # a rank-local expert's name -> that expert index's name on every rank
        path = next((p for p in paths if name.startswith(p + _EXPERTS)), None)
        if path is None:
            return [name]
        i, rest = name[len(path) + len(_EXPERTS):].split(".", 1)
        return [f"{path}{_EXPERTS}{g}.{rest}" for g in range(int(i), counts[paths.index(path)], local[path])]
    shapes = []
    for g in groups:
        names = [m for n in g for m in global_names(n)]
        shapes.append({n: tuple(out[n].shape) for n in names})
    return out, moe, dict(sd, param_shapes=shapes)


def _need_optimizer(ckpt_dir: str, cfg: dict, optimizer: Optional[str]) -> None:
    if "optimizer" not in cfg and optimizer is None:
        raise ConfigError(f"{ckpt_dir} was trained with an optimizer built outside the DeepSpeed config; "
                          "name its class with --optimizer (e.g. torch.optim.AdamW)")


def spec_from_native(ckpt_dir: str, ds_config: Optional[dict] = None,
                     optimizer: Optional[str] = None) -> ModelSpec:
    """The shell of a native DeepSpeed checkpoint, from DeepSpeed's own model-states file."""
    # the engine's model-states files (mp_rank_XX_..., or ZeRO-3's zero_pp_rank_N_mp_rank_XX_...), not
    # a pipeline's per-layer or a MoE layer's per-expert ones
    files = sorted((f for f in glob.glob(os.path.join(ckpt_dir, "*model_states.pt"))
                    if not os.path.basename(f).startswith("layer_")),
                   key=lambda f: (not os.path.basename(f).startswith("mp_rank_"), f))
    if not files:
        raise StateError(f"{ckpt_dir} holds no mp_rank_XX_model_states.pt; the native checkpoint is incomplete")
    sd = _load_plain(files[0])
    cfg = ds_config if ds_config is not None else sd.get("ds_config")
    if isinstance(cfg, str) and os.path.isfile(cfg):
        cfg = _read_json(cfg)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{files[0]} does not hold the run's DeepSpeed config as a dict; pass it with --ds-config FILE")
    stage = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    module = sd.get("module")
    moe = None
    if glob.glob(os.path.join(ckpt_dir, "layer_*_expert_*_model_states.pt")):
        if module is None or int((sd.get("checkpoint_parallel_dimensions") or {}).get("tp_degree", 1)) != 1:
            raise StateError(f"{ckpt_dir} is a native checkpoint of DeepSpeed-MoE experts in a pipeline or with "
                             "tensor parallelism, which this conversion does not read; load it with AdaCheck enabled "
                             "in the training job (AdaCheck has DeepSpeed load its own checkpoint) and save once")
        module, moe, sd = native_experts(ckpt_dir, module, sd)
    if module is None and glob.glob(os.path.join(ckpt_dir, "layer_*-model_states.pt")):
        dims = sd.get("checkpoint_parallel_dimensions") or {}
        pp, tp = int(dims.get("pp_degree", 0)), int(dims.get("tp_degree", 1))
        stage_files = sorted(f for f in files if os.path.basename(f).startswith("mp_rank_"))
        if pp < 1 or tp != 1 or len(stage_files) != pp:
            raise StateError(f"{ckpt_dir} is a native PipelineEngine checkpoint of {pp or '?'} stages x {tp} "
                             f"tensor-parallel ranks with {len(stage_files)} mp_rank files; this conversion reads "
                             "pipelines without tensor parallelism (load it with AdaCheck enabled in the training "
                             "job's PipelineEngine and save once)")
        _need_optimizer(ckpt_dir, cfg, optimizer)
        params, buffers, groups, pipeline = native_pipeline(ckpt_dir, stage_files, pp)
        return ModelSpec(params, buffers, groups, optimizer, cfg,
                         lr_scheduler=sd.get("lr_scheduler") if "scheduler" not in cfg else None,
                         stage=stage, world=int(sd.get("dp_world_size", 1)) * pp, pipeline=pipeline)
    buffer_names = set(sd.get("buffer_names") or [])
    shapes = sd.get("param_shapes")
    frozen = set(sd.get("frozen_param_shapes") or {})
    lp = torch.bfloat16 if (cfg.get("bf16") or {}).get("enabled") else (
        torch.float16 if (cfg.get("fp16") or {}).get("enabled") else torch.float32)
    # every parameter's whole shape (a ZeRO-3 module holds empty placeholders), frozen ones too
    full_shape = {n: tuple(s) for g in [*(shapes or []), sd.get("frozen_param_shapes") or {}] for n, s in g.items()}
    # (a tied weight is stored under each of its names; the optimizer knows it by the first)
    shared = native_aliases(module, sd.get("shared_params"), buffer_names)
    param_names = [n for n in module if n not in buffer_names and n not in shared]
    tp = int(sd.get("mp_world_size") or 1)
    split = split_from_patterns(param_names, sd.get("universal_checkpoint_info"), files[0]) if tp > 1 else {}
    mp_files = [f for f in files if os.path.basename(f).startswith("mp_rank_")]
    if tp > 1 and len(mp_files) != tp:
        raise StateError(f"{ckpt_dir} was saved by {tp} tensor-parallel ranks but holds {len(mp_files)} "
                         "mp_rank_XX_model_states.pt files; the checkpoint is incomplete")
    if shapes is not None:
        groups = [list(g) for g in shapes]
    else:   # no ZeRO: the optimizer's groups number its parameters in order
        osd = sd.get("optimizer") or {}
        osd = osd.get("optimizer_state_dict", osd)
        counts = [len(g["params"]) for g in osd.get("param_groups", [])]
        if sum(counts) != len(param_names):
            raise StateError(f"{files[0]}: the optimizer holds {sum(counts)} parameters and the module "
                             f"{len(param_names)}; which ones are frozen is not recorded without ZeRO, so "
                             "this checkpoint cannot be rebuilt offline")
        it = iter(param_names)
        groups = [[next(it) for _ in range(c)] for c in counts]
    trained = {n for g in groups for n in g}
    params = []
    for n in param_names:
        t = module[n]
        shape = list(full_shape.get(n, tuple(t.shape)))
        if n in split:   # the logical tensor: the tensor-parallel slices side by side
            shape[split[n]] *= tp
        shape = tuple(shape)
        dtype = t.dtype if t.is_floating_point() else lp
        params.append((n, shape, str(dtype).replace("torch.", ""), n in trained and n not in frozen))
    buffers = [(n, tuple(module[n].shape), str(module[n].dtype).replace("torch.", ""))
               for n in module if n in buffer_names]
    _need_optimizer(ckpt_dir, cfg, optimizer)
    return ModelSpec(params, buffers, groups, optimizer, cfg,
                     lr_scheduler=sd.get("lr_scheduler") if "scheduler" not in cfg else None,
                     stage=stage, world=int(sd.get("dp_world_size", 1)) * tp, tp=tp, split=split,
                     shared=shared, moe=moe)


# ------------------------------------------------------------------ the shell engine
class SavedScheduler:
    """Stands in for a client LR scheduler the converter cannot rebuild: carries its state
    from one checkpoint to the other unchanged (the conversion never steps)."""

    def __init__(self, state: Optional[dict]):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state

    def step(self, *args, **kwargs):
        raise StateError("a conversion engine does not train")

    def get_last_lr(self):
        return list((self.state or {}).get("_last_lr", []))


def shell_module(spec: ModelSpec, tp: int = 1, root: Optional[torch.nn.Module] = None,
                 inserts: Optional[Dict[str, Callable[[], torch.nn.Module]]] = None):
    """An nn.Module with the checkpoint's parameters and buffers under their dotted names, in
    module order (so DeepSpeed groups, flattens and partitions them as in the training job);
    a tied weight is the same nn.Parameter under each of its names (so DeepSpeed's save writes
    every name and its ``shared_params``, and its load fills every name); with ``tp`` > 1
    each split parameter is this rank's slice, marked as Megatron marks it.  ``inserts``: module
    path -> a function making the module that holds every parameter and buffer under that path
    (a MoE layer), put there in the recorded order where its first parameter is."""
    root = torch.nn.Module() if root is None else root
    inserts = dict(inserts or {})
    inside = lambda name: next((p for p in inserts if name.startswith(p + ".")), None)   # noqa: E731
    if tp > 1:
        check_tp(spec, tp)
        # DeepSpeed's universal-checkpoint patterns, so the native files say how they are split
        root.universal_checkpoint_info = {
            "tp_replicated_parameter_patterns": [re.escape(n) + "$" for n, *_ in spec.params if n not in spec.split],
            "parameter_with_row_parallelism_patterns": [re.escape(n) + "$" for n, d in spec.split.items() if d == 1]}

    def owner(name):
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        return m, leaf

    for name, shape, dtype, trainable in spec.params:
        at = inside(name)
        if at is not None:
            if at not in [n for n, _ in root.named_modules()]:
                m, leaf = owner(at)
                m.add_module(leaf, inserts[at]())
            continue
        m, leaf = owner(name)
        dim = spec.split.get(name) if tp > 1 else None
        if dim is not None:
            shape = tuple(n // tp if d == dim else n for d, n in enumerate(shape))
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch_dtype(dtype)), requires_grad=trainable)
        if dim is not None:
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
        m.register_parameter(leaf, p)
    named = dict(root.named_parameters())
    for alias, source in spec.shared.items():
        m, leaf = owner(alias)
        if source not in named or leaf in m._parameters:
            raise StateError(f"the tied weight {alias} -> {source} does not name another name "
                             "of a parameter; this model cannot be rebuilt offline")
        m.register_parameter(leaf, named[source])
    for name, shape, dtype in spec.buffers:
        if inside(name) is None:
            m, leaf = owner(name)
            m.register_buffer(leaf, torch.zeros(shape, dtype=torch_dtype(dtype)))
    order = [n for n, _ in root.named_parameters() if inside(n) is None]
    if order != [p[0] for p in spec.params if inside(p[0]) is None]:
        raise StateError("the parameter names do not form a module tree in their recorded order; "
                         "this model cannot be rebuilt offline")
    return root


class _ShellLayer(torch.nn.Module):
    """One layer of a shell PipelineModule: its recorded parameters and buffers (``part``: a
    ModelSpec of them, named within the layer); it passes its input through."""

    def __init__(self, part: ModelSpec):
        super().__init__()
        shell_module(part, root=self)

    def forward(self, x):
        return x


def _through(*args):
    """A layer with no state (a function in the PipelineModule's layer list), or a tied layer
    used as a function of the tied module: passes its input through."""
    return args[-1]


def _layer_part(spec: ModelSpec, prefix: str) -> ModelSpec:
    """The parameters and buffers under ``prefix`` (a pipeline layer's), named within it."""
    n = len(prefix)
    return dataclasses.replace(spec, params=[(p[0][n:], *p[1:]) for p in spec.params if p[0].startswith(prefix)],
                               buffers=[(b[0][n:], *b[1:]) for b in spec.buffers if b[0].startswith(prefix)],
                               shared={}, split={}, pipeline=None)


def moe_shell(spec: ModelSpec):
    """The shell of a model with DeepSpeed-MoE layers: each is a real ``MoE`` of the recorded size
    whose experts are :class:`_ShellLayer` s of the recorded expert parameters, this rank's local
    experts (DeepSpeed's expert-parallel groups are consecutive ranks), so DeepSpeed's own save
    writes its per-expert files."""
    from deepspeed.moe.layer import MoE
    rank = torch.distributed.get_rank()

    def make(layer):
        first = (rank % layer["ep_size"]) * (layer["experts"] // layer["ep_size"])
        expert = _ShellLayer(_layer_part(spec, f"{layer['path']}.deepspeed_moe.experts.deepspeed_experts.{first}."))
        return lambda: MoE(layer["hidden"], expert, num_experts=layer["experts"], ep_size=layer["ep_size"])
    if any(not layer["path"] for layer in spec.moe):
        raise StateError("the model itself is a MoE layer; this conversion rebuilds MoE layers inside a model only")
    return shell_module(spec, inserts={layer["path"]: make(layer) for layer in spec.moe})


def pipeline_shell(spec: ModelSpec, topology):
    """A PipelineModule with the recorded layers (each a :class:`_ShellLayer` of the recorded
    parameters, a TiedLayerSpec where the training job had one) cut into the recorded stages, so
    DeepSpeed's own native save writes the training job's per-layer files."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    class ShellPipe(PipelineModule):
        def _partition_layers(self, method="uniform"):
            self.parts = list(spec.pipeline["parts"])
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    layers = []
    for i, rec in enumerate(spec.pipeline["layers"]):
        if rec[0] == "module":
            layers.append(LayerSpec(_ShellLayer, _layer_part(spec, f"{i}.")))
        elif rec[0] == "tied":
            _, key, holds, attrs = rec
            layers.append(TiedLayerSpec(key, _ShellLayer, _layer_part(spec, f"tied_modules.{key}."),
                                        forward_fn=None if holds else _through, tied_weight_attr=attrs))
        else:
            layers.append(_through)
    if len(spec.pipeline["parts"]) != topology.get_dim("pipe") + 1 or spec.pipeline["parts"][-1] != len(layers):
        raise StateError("the recorded pipeline stages do not match its layers; the model description is damaged")
    module = ShellPipe(layers=layers, topology=topology)
    named = {n for n, _ in module.named_parameters()}
    wanted = {p[0] for p in spec.params}
    if not named <= wanted:
        raise StateError(f"the rebuilt pipeline stage holds parameters the checkpoint does not record "
                         f"({sorted(named - wanted)[:3]}); the model description is damaged")
    return module


def _logical_names(module, spec: ModelSpec):
    """The shell's parameters by the names the checkpoint records (a rank's local expert i of a
    MoE layer: the global expert it is, as adacheck_ds.state names it)."""
    if not spec.moe:
        return list(module.named_parameters())
    rank, out = torch.distributed.get_rank(), []
    at = {f"{layer['path']}.deepspeed_moe.experts.deepspeed_experts.": layer for layer in spec.moe}
    for n, p in module.named_parameters():
        prefix = next((a for a in at if n.startswith(a)), None)
        if prefix is not None:
            layer = at[prefix]
            local, _, rest = n[len(prefix):].partition(".")
            first = (rank % layer["ep_size"]) * (layer["experts"] // layer["ep_size"])
            n = f"{prefix}{first + int(local)}.{rest}"
        out.append((n, p))
    return out


def check_tp(spec: ModelSpec, tp: int) -> None:
    bad = [f"{n} {list(shape)}" for n, shape, _, _ in spec.params if n in spec.split and shape[spec.split[n]] % tp]
    if bad:
        raise ConfigError(f"tensor-parallel size {tp} does not divide the split dimension of "
                          f"{', '.join(bad[:3])}; choose a --tp that divides them")


def _import(path: str):
    mod, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"cannot import the optimizer class {path!r} ({e}); pass another with "
                          "--optimizer or a DeepSpeed config with an \"optimizer\" block via --ds-config") from None


def build_engine(spec: ModelSpec, stage: int, tp: int = 1):
    mpu = None
    world = deepspeed.comm.get_world_size()
    if spec.pipeline:   # a PipelineEngine in the recorded stages (its own grid)
        module = pipeline_shell(spec, PipeModelDataParallelTopology(num_pp=spec.pp, num_mp=1,
                                                                    num_dp=world // spec.pp))
    elif spec.moe:
        if tp > 1:
            raise ConfigError("--tp: a checkpoint with MoE layers converts without tensor parallelism")
        module = moe_shell(spec)
    else:
        if tp > 1:   # DeepSpeed's own mpu: TP ranks consecutive, data-parallel groups strided by TP (Megatron's order)
            mpu = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=world // tp))
        module = shell_module(spec, tp)
    named = dict(_logical_names(module, spec))
    cfg = copy.deepcopy(spec.ds_config)
    cfg.pop("adacheck", None)
    zero = dict(cfg.get("zero_optimization") or {})
    zero["stage"] = stage
    cfg["zero_optimization"] = zero
    # the batch size is not part of a checkpoint; keep the per-rank numbers valid for any DP size
    micro = cfg.get("train_micro_batch_size_per_gpu") or 1
    cfg.pop("train_batch_size", None)
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = cfg.get("gradient_accumulation_steps") or 1
    # (a pipeline stage steps its own layers' parameters, a rank its own experts: DeepSpeed's MoE
    # param groups, as split_params_into_different_moe_groups_for_optimizer makes them)
    groups = []
    for i, g in enumerate(spec.groups):
        params = [named[n] for n in g if n in named]
        if params:
            moe = {getattr(p, "group_name", None) for p in params if getattr(p, "allreduce", True) is False}
            groups.append({"params": params, "name": moe.pop(), "moe": True} if moe and len(moe) == 1 and
                          all(getattr(p, "allreduce", True) is False for p in params) else
                          {"params": params, "name": f"group{i}"} if spec.moe else {"params": params})
    kw = {}
    if "optimizer" not in cfg:
        if not spec.optimizer:
            raise ConfigError("the checkpoint names no optimizer; pass --optimizer or --ds-config")
        kw["optimizer"] = _import(spec.optimizer)(groups)
    if "scheduler" not in cfg and spec.lr_scheduler is not None:
        kw["lr_scheduler"] = SavedScheduler(spec.lr_scheduler)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=groups, config=cfg, mpu=mpu, **kw)
    return engine


# ------------------------------------------------------------------ one rank
def run_rank(a) -> None:
    """One rank of a conversion (under torchrun, or started by ``convert``)."""
    logging.getLogger("adacheck").setLevel(logging.INFO)
    deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu" else None)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def done(k: int, what: str) -> None:      # (rank 0 reports 4 phases: built, loaded, saved, published)
        if rank == 0:
            local_ranks.phase(k, 4, what)
    ds_config = _read_json(a.ds_config) if a.ds_config else None
    tmp = a.tmp
    try:
        if a.direction == "from-native":
            src = _native_dir(a.src, a.tag)
            spec = spec_from_native(src, ds_config, a.optimizer)
            if world != spec.world:
                raise ConfigError(f"{src} was saved by {spec.dp} data-parallel x {spec.tp} tensor-parallel ranks; "
                                  f"DeepSpeed loads it only into as many, not {world} (run {spec.world} ranks)")
            refuse_existing(os.path.join(a.out, os.path.basename(src)), barrier=torch.distributed.barrier)
            engine = build_engine(spec, spec.stage, spec.tp)
            done(1, "engine built")
            _, client_state = adacheck_ds.load_native(engine, os.path.dirname(src), tag=os.path.basename(src))
            done(2, "native checkpoint loaded")
            # DeepSpeed returns some of its own metadata among the client state; it is not the user's
            client_state = {k: v for k, v in (client_state or {}).items() if k not in _DS_METADATA}
            ac = adacheck_ds.attach(engine, {"enabled": True, "fsync": True})
            ac.save_checkpoint(a.out, tag=os.path.basename(src), client_state=client_state)
            done(4, "AdaCheck checkpoint saved")
            return
        src = resolve(a.src, a.tag)
        spec, m = spec_from_adacheck(src, ds_config)
        stage = spec.stage if a.zero_stage is None else a.zero_stage
        tp = spec.tp if a.tp is None else a.tp
        if world % tp:
            raise ConfigError(f"tensor-parallel size {tp} does not divide the {world} ranks")
        saving = f"ZeRO-{spec.stage} on {spec.world} ranks, TP={spec.tp}"
        if a.direction == "materialise" and (world, stage, tp) != (spec.world, spec.stage, spec.tp):
            raise ConfigError(f"materialising replays the deltas in the saving layout: {saving} (this is "
                              f"ZeRO-{stage} on {world} ranks, TP={tp})")
        pending, last, out_tag = reach(src, m, spec.world, a.step)
        if pending and (world, stage, tp) != (spec.world, spec.stage, spec.tp):
            raise ConfigError(f"{src} has {pending} committed online steps, which replay only in the saving "
                              f"layout ({saving}): run 'materialise' there first "
                              "(adacheck convert --to deepspeed does both)")
        out_tag = a.out_tag or out_tag
        refuse_existing(os.path.join(a.out, out_tag), barrier=torch.distributed.barrier)
        engine = build_engine(spec, stage, tp)
        done(1, "engine built")
        ac = adacheck_ds.attach(engine, {"enabled": True, "verify_on_load": not a.no_verify})
        ac.replay_until = last
        # AdaCheck's load: resharded to this layout, committed deltas replayed
        _, client_state = ac.load_checkpoint(os.path.dirname(src), tag=os.path.basename(src))
        if engine.global_steps != last:
            raise StateError(f"loading {src} reached step {engine.global_steps}, not step {last}")
        done(2, "AdaCheck checkpoint loaded" + (f", {pending} online steps replayed" if pending else ""))
        if a.direction == "materialise":
            ac.save_checkpoint(a.out, tag=out_tag, client_state=client_state or {})
            done(4, "AdaCheck checkpoint saved")
            return
        adacheck_ds.save_native(engine, tmp, tag=out_tag, client_state=client_state or {})
        done(3, "native checkpoint written")
        torch.distributed.barrier()
        if rank == 0:
            publish(os.path.join(tmp, out_tag), os.path.join(a.out, out_tag), os.path.join(a.out, "latest"), out_tag)
            done(4, "published")
    finally:        # (the native files' temporary directory: emptied by the publish, or failed)
        if rank == 0 and tmp and a.direction == "to-native":
            shutil.rmtree(tmp, ignore_errors=True)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the DeepSpeed config {path}: {e}") from None


def spawn(world: int, argv: List[str], progress=None) -> None:
    """Run ``python -m adacheck_ds.native ARGV`` on ``world`` local ranks; raise if any fails.
    ``progress(done, total)``: rank 0's phases (see run_rank), as they happen."""
    env = {}
    if "DS_ACCELERATOR" not in os.environ:
        if not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"
    local_ranks.run("adacheck_ds.native", world, argv, env=env, progress=progress)


def convert(direction: str, src: str, out: str, options, progress=None) -> str:
    """Convert on this machine (ranks started here); returns the written checkpoint directory.
    ``options``: the command line's (add_arguments', with ``tag`` and ``no_verify``);
    ``progress(done, total)``: the phases of each run of ranks, as rank 0 reports them."""
    if direction not in DIRECTIONS:
        raise ConfigError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
    tag, ds_config, step, tp, dp = options.tag, options.ds_config, options.step, options.tp, options.dp
    if (options.zero_stage is not None or dp is not None or tp is not None) and direction != "to-native":
        raise ConfigError("--zero-stage / --dp / --tp choose the layout of native files: use them with "
                          "--to deepspeed")
    for flag, value in (("dp", dp), ("tp", tp)):
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} must be at least 1, got {value}")
    if step is not None and direction == "from-native":
        raise ConfigError("--step chooses a step of an AdaCheck checkpoint's online deltas; not with "
                          "--from deepspeed")
    opts = ["--ds-config", ds_config] if ds_config else []
    opts += ["--optimizer", options.optimizer] if options.optimizer else []
    opts += ["--no-verify"] if options.no_verify else []
    base = opts + (["--tag", tag] if tag else [])
    if direction == "from-native":
        src_dir = _native_dir(src, tag)
        spec = spec_from_native(src_dir, _read_json(ds_config) if ds_config else None, options.optimizer)
        final = os.path.join(out, os.path.basename(src_dir))
        refuse_existing(final)
        spawn(spec.world, ["from-native", src, out, *base], progress)
        return final
    if step is not None and tag is None and not os.path.isfile(os.path.join(src, commit.MANIFEST_NAME)):
        tag = deltas.base_for_step(src, step)
    src_dir = resolve(src, tag)
    base = list(opts)   # the ranks get the checkpoint directory itself
    spec, m = spec_from_adacheck(src_dir, _read_json(ds_config) if ds_config else None)
    tp = tp or spec.tp
    dp = dp or spec.dp
    if spec.pipeline and tp != 1:
        raise ConfigError(f"{src_dir} is a pipeline checkpoint" + (" with tensor parallelism" if spec.tp > 1 else "") +
                          ", which converts to native pipeline files without tensor parallelism only; use "
                          "--to deepspeed-universal (stock load_universal reads it into any stages and TP size), "
                          "or load it in the training job with AdaCheck")
    check_tp(spec, tp)
    stage = spec.stage if options.zero_stage is None else options.zero_stage
    pending, _, out_tag = reach(src_dir, m, spec.world, step)
    if step is not None:
        base += ["--step", str(step)]
    final = os.path.join(out, out_tag)
    refuse_existing(final)
    if direction == "materialise":
        spawn(spec.world, ["materialise", src_dir, out, *base], progress)
        return final
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".adacheck-convert-", dir=out)
    try:
        if pending and (dp, stage, tp) != (spec.dp, spec.stage, spec.tp):
            # the deltas replay only in the saving layout: materialise there first
            spawn(spec.world, ["materialise", src_dir, os.path.join(work, "base"), *base], progress)
            src_dir = os.path.join(work, "base", out_tag)
            base = list(opts)
        spawn(dp * tp * spec.pp, ["to-native", src_dir, out, "--zero-stage", str(stage), "--tp", str(tp),
                        "--tmp", os.path.join(work, "native"), "--out-tag", out_tag, *base], progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def add_arguments(parser) -> None:
    """The options that choose the layout and the inputs of a conversion (``adacheck convert``'s
    and this module's)."""
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                        help="--to deepspeed (to-native): the ZeRO stage of the native files "
                             "(default: the saving one)")
    parser.add_argument("--dp", type=int, default=None,
                        help="--to deepspeed (to-native): the data-parallel size of the native files "
                             "(default: the saving one)")
    parser.add_argument("--tp", type=int, default=None,
                        help="--to deepspeed (to-native): the tensor-parallel size (mp_rank_XX files, "
                             "Megatron-DeepSpeed style) of the native files (default: the saving one); under "
                             "torchrun the world is DP x TP")
    parser.add_argument("--step", type=int, default=None,
                        help="--to deepspeed / adacheck (to-native, materialise): the step to materialise: a "
                             "base's step or one of its committed online steps (default: the newest; the base is "
                             "found in SRC)")
    parser.add_argument("--ds-config", default=None, metavar="JSON",
                        help="DeepSpeed config to build the conversion engines with (default: the recorded one)")
    parser.add_argument("--optimizer", default=None, metavar="CLASS",
                        help="--from deepspeed (from-native): the client optimizer class (e.g. torch.optim.AdamW) "
                             "when the DeepSpeed config has no optimizer block")

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m adacheck_ds.native", description=__doc__.split("\n\n")[0])
    p.add_argument("direction", choices=DIRECTIONS)
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--tag", default=None, help="source tag (default: the one 'latest' names)")
    p.add_argument("--no-verify", action="store_true", help="do not check hashes while reading")
    add_arguments(p)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-tag", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # one rank (torchrun or spawn)
        if a.direction == "to-native" and a.tmp is None:
            a.tmp = os.path.join(a.out, f".adacheck-convert-{os.environ.get('MASTER_PORT', 'x')}")

        def work():
            run_rank(a)
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        local_ranks.exit_rank(work)
    print(convert(a.direction, a.src, a.out, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
