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
import importlib
import logging
import os
import re
import shutil
import sys
import tempfile
from typing import Callable, Dict, List, Optional

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

import adacheck_ds
from adacheck.storage import commit
from adacheck.online import deltas
from adacheck.cli import local_ranks
from adacheck.checkpoint import resolve
from adacheck.cli.convert import publish, refuse_existing
from adacheck.errors import ConfigError, StateError
from adacheck.types import torch_dtype
from .native_spec import DS_METADATA, ModelSpec, native_dir, read_json, spec_from_adacheck, spec_from_native

DIRECTIONS = ("to-native", "from-native", "materialise")










def reach(ckpt_dir: str, m, world: int, step: Optional[int] = None):
    """(online steps to replay, the step a load ends at, the DeepSpeed tag for that state)."""
    pending, last = deltas.reach(ckpt_dir, m.step, world, step, generation=m.framework.get("generation"))
    return pending, last, (f"global_step{last}" if pending else m.tag)




















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

    def done(k: int, what: str) -> None:      # rank 0 reports 4 phases: built, loaded, saved, published
        if rank == 0:
            local_ranks.phase(k, 4, what)
    ds_config = read_json(a.ds_config) if a.ds_config else None
    tmp = a.tmp
    try:
        if a.direction == "from-native":
            src = native_dir(a.src, a.tag)
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
            client_state = {k: v for k, v in (client_state or {}).items() if k not in DS_METADATA}
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
    finally:        # the native files' temporary directory: emptied by the publish, or failed
        if rank == 0 and tmp and a.direction == "to-native":
            shutil.rmtree(tmp, ignore_errors=True)




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
        src_dir = native_dir(src, tag)
        spec = spec_from_native(src_dir, read_json(ds_config) if ds_config else None, options.optimizer)
        final = os.path.join(out, os.path.basename(src_dir))
        refuse_existing(final)
        spawn(spec.world, ["from-native", src, out, *base], progress)
        return final
    if step is not None and tag is None and not os.path.isfile(os.path.join(src, commit.MANIFEST_NAME)):
        tag = deltas.base_for_step(src, step)
    src_dir = resolve(src, tag)
    base = list(opts)   # the ranks get the checkpoint directory itself
    spec, m = spec_from_adacheck(src_dir, read_json(ds_config) if ds_config else None)
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
