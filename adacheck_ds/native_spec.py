"""What a DeepSpeed checkpoint holds, as a :class:`ModelSpec` (parameters, buffers, shapes, tied
names, tensor-parallel split dimensions, pipeline layers, experts): read from an AdaCheck
checkpoint's record of the training job (:func:`spec_from_adacheck`) or rebuilt from DeepSpeed's
own files (:func:`spec_from_native`: ZeRO 0-3, pipeline per-layer files, MoE per-expert files).
The conversions that build engines around it are in :mod:`adacheck_ds.native`."""
from __future__ import annotations

import glob
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from adacheck.storage import commit
from adacheck.checkpoint import CheckpointReader
from adacheck.errors import ConfigError, StateError
from .saved import Objects
from .state import refuse_topology


# keys DeepSpeed writes into its model-states dict; some versions hand some of them back as
# client state (load_checkpoint's second result), where they are not the user's
DS_METADATA = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
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


def native_dir(src: str, tag: Optional[str]) -> str:
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
        if m is None:       # a MoE layer's per-expert file: layer_<l>_expert_...
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

    def tied_weights(key):   # the tied module's parameters: what DeepSpeed keeps equal across stages
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
    params.sort(key=lambda p: (index(p[0]) is not None, index(p[0]) or 0))    # stable: tied first
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
            if n == path + gate:    # MOELayer holds its gate, then its experts
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
        cfg = read_json(cfg)
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
    # a tied weight is stored under each of its names; the optimizer knows it by the first
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


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the DeepSpeed config {path}: {e}") from None
