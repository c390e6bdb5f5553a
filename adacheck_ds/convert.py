"""AdaCheck checkpoint -> DeepSpeed's universal checkpoint: every parameter's fp32 weights and
optimizer state as whole tensors, one folder per parameter (docs/cli.md lists the files), which
stock ``engine.load_checkpoint`` reads into any ZeRO stage 1-3 and data-parallel size with
``"checkpoint": {"load_universal": true}``.  Tensors are produced one at a time (peak memory:
about one parameter's state); the files are DeepSpeed's own torch.save files, written, never
read; the output is renamed into place when complete and never replaces an existing one.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import deepspeed
import torch

from adacheck.checkpoint import CheckpointReader, resolve
from adacheck.cli.convert import output_dir, weight_sources
from adacheck.errors import StateError

from .saved import Objects
from .state import refuse_topology, state_keys


def _params(r: CheckpointReader):
    names = sorted(n[len("model/"):] for n in r.manifest.tensors if n.startswith("model/"))
    if not names:
        raise StateError(f"{r.dir} holds no model weights; is it an AdaCheck DeepSpeed checkpoint?")
    return names


def to_universal(src: str, out_dir: str, tag: Optional[str] = None, verify: bool = True,
                 progress: Optional[Callable[[int, int], None]] = None, out_name: Optional[str] = None) -> str:
    """Convert the AdaCheck checkpoint ``src`` (save dir or checkpoint dir) to a DeepSpeed
    universal checkpoint in ``out_dir``, in a folder named ``out_name`` (default: the checkpoint's
    tag), which ``out_dir``'s ``latest_universal`` then names; returns that folder."""
    ckpt = resolve(src, tag)
    r = CheckpointReader(ckpt, verify=verify, cache_bytes=32 << 20)
    m = r.manifest
    r.framework("deepspeed", "DeepSpeed", "universal conversion needs a DeepSpeed checkpoint")
    if any(".deepspeed_experts." in n for n in m.tensors):
        raise StateError(f"{ckpt} holds DeepSpeed-MoE experts, which DeepSpeed's universal format cannot hold: "
                         "its loader looks each expert up under its rank-local name (deepspeed_experts.0 on every "
                         "expert-parallel rank), and DeepSpeed converts only AutoEP experts; use --to deepspeed "
                         "for native per-expert files, or load the AdaCheck checkpoint into any ep_size directly")
    # (a pipeline's universal checkpoint is the same: DeepSpeed's universal load takes every
    # weight from zero/, by the PipelineModule's names, global layer indices, on any stage count)
    refuse_topology(ckpt, m, "the conversion to DeepSpeed's universal format", pipeline_ok=True)
    objects = Objects.of(r.objects(), f"the objects of {ckpt}")
    model = objects.model(ckpt)
    out_name = m.tag if out_name is None else out_name
    final = os.path.join(out_dir, out_name)
    names = _params(r)
    keys = state_keys(r)
    # tensor-parallel parameters: a TP engine's load_universal cuts its slice along cat_dim
    split = model.partition_dims if model is not None else {}
    done, total = 0, len(names)
    with output_dir(final, os.path.join(out_dir, "latest_universal"), out_name) as tmp:
        os.makedirs(os.path.join(tmp, "zero"))
        steps = set()
        for name in names:
            folder = os.path.join(tmp, "zero", name)
            # without ZeRO (fp32), the module weights are the master weights
            master = f"master/{name}" if r.has(f"master/{name}") else f"model/{name}"
            if not r.has(f"master/{name}") and not any(r.has(f"optim/{k}/{name}") for k in keys):
                done += 1
                continue   # frozen: no optimizer state; the module weights carry it
            os.makedirs(folder)
            tp = {"cat_dim": int(split[name])} if name in split else {}
            torch.save({"param": r.read(master, dtype=torch.float32), **tp}, os.path.join(folder, "fp32.pt"))
            for key in keys:
                t = f"optim/{key}/{name}"
                if not r.has(t):
                    continue
                v = r.read(t)
                if key == "step":   # DeepSpeed's Adam counts in Python ints, torch's in tensors
                    steps.add(float(v))
                    torch.save(v.item() if v.dtype == torch.int64 else v, os.path.join(folder, "step.pt"))
                elif v.dim() and tuple(v.shape) != tuple(m.tensors[f"model/{name}"].shape):
                    raise StateError(f"optimizer state {key!r} of {name} is one {list(v.shape)} tensor for the "
                                     "whole tensor the optimizer stepped, not a value per element; DeepSpeed's "
                                     "universal format holds per-element state and 'step' only")
                else:
                    torch.save({"param": v, **tp}, os.path.join(folder, f"{key}.pt"))
            done += 1
            if progress is not None:
                progress(done, total)
        if len(steps) > 1:
            raise StateError(f"parameters have different optimizer steps {sorted(steps)}; DeepSpeed's "
                             "universal format keeps one step per parameter group")
        groups = objects.param_groups or []
        step = next((r.read(f"optim/step/{n}") for n in names if r.has(f"optim/step/{n}")), None)
        torch.save({"param_groups": [dict(g) for g in groups], "ds_version": deepspeed.__version__,
                    "optimizer_state_dict": {"state": {0: {"step": step}},
                                             "param_groups": [dict(g) for g in groups]}},
                   os.path.join(tmp, "zero", "optimizer_state.pt"))
        # the module's weights in their training dtype, and its buffers
        module = {key: r.read(name, dtype=dtype) for key, (name, dtype) in weight_sources(r, "model").items()}
        counters = objects.counters
        dp = m.framework.get("dp_world_size", m.topology.get("world_size", 1))
        states = dict(objects.client_state)
        states.update({"module": module, "lr_scheduler": objects.lr_scheduler,
                       "global_steps": counters.get("global_steps", m.step or 0),
                       "global_samples": counters.get("global_samples", 0),
                       "skipped_steps": counters.get("skipped_steps", 0),
                       "dp_world_size": dp, "mp_world_size": 1, "ds_version": deepspeed.__version__,
                       "param_shapes": [{n: torch.Size(m.tensors[f"model/{n}"].shape) for n in names}],
                       "optimizer": None})
        for fname in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            torch.save(states, os.path.join(tmp, fname))
    return final
