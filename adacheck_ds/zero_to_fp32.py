#!/usr/bin/env python
"""DeepSpeed's fp32 export (``deepspeed.utils.zero_to_fp32``) for AdaCheck checkpoints.

This module needs only AdaCheck's core and torch: every DeepSpeed save through AdaCheck copies it
into the save directory as ``zero_to_fp32.py``, as DeepSpeed copies its own script there, and it
runs there with the same arguments::

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [--max_shard_size 5GB]
                           [-t TAG] [--exclude_frozen_parameters]

With ``import adacheck_ds``, DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``,
``convert_zero_checkpoint_to_fp32_state_dict`` and ``load_state_dict_from_zero_checkpoint`` read
AdaCheck checkpoints through :func:`fp32_state_dict` (native ones as before).

Contract: the state dict DeepSpeed returns for a native checkpoint of the same state: the
module's buffers (floating ones in fp32), its trainable parameters in fp32 (the fp32 master
weights; a model trained in fp32 has no other), its frozen parameters in their training dtype
(left out with ``exclude_frozen_parameters``), and each tied name (DeepSpeed's ``shared_params``) as the same
tensor as the name it is tied to.  Every tensor read is verified against its hash.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from adacheck.checkpoint import CheckpointReader
from adacheck.storage.commit import MANIFEST_NAME, read_latest
from adacheck.errors import NotFoundError

MODEL, MASTER, BUFFER = "model/", "master/", "buffer/"


def adacheck_dir(checkpoint_dir: str, tag: Optional[str] = None) -> Optional[str]:
    """The AdaCheck checkpoint ``checkpoint_dir`` (a save directory; ``tag`` or its ``latest``)
    names, or None when that is not one (a native DeepSpeed checkpoint, or nothing)."""
    if tag is None:
        if os.path.isfile(os.path.join(checkpoint_dir, MANIFEST_NAME)):
            return checkpoint_dir
        tag = read_latest(checkpoint_dir)
        if tag is None:
            return None
    d = os.path.join(checkpoint_dir, str(tag))
    return d if os.path.isfile(os.path.join(d, MANIFEST_NAME)) else None


def fp32_state_dict(ckpt_dir: str, exclude_frozen_parameters: bool = False,
                    verify: bool = True) -> "OrderedDict[str, torch.Tensor]":
    """The module's fp32 state dict from the AdaCheck checkpoint ``ckpt_dir`` (see the module's
    contract)."""
    r = CheckpointReader(ckpt_dir, verify=verify)
    spec = (r.manifest.objects or {}).get("model_spec") or {}
    names = [n[len(MODEL):] for n in sorted(r.manifest.tensors) if n.startswith(MODEL)]
    if not names:
        raise NotFoundError(f"{ckpt_dir} holds no module weights (no tensors named {MODEL}...)")
    order = [p[0] for p in spec.get("parameters") or []]
    trainable = {p[0]: bool(p[1]) for p in spec.get("parameters") or []}
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    def fp32(name: str) -> torch.Tensor:
        t = r.read(name)
        return t.float() if t.is_floating_point() else t

    for n in spec.get("buffers") or sorted(t[len(BUFFER):] for t in r.manifest.tensors if t.startswith(BUFFER)):
        if r.has(BUFFER + n):
            out[n] = fp32(BUFFER + n)
    for n in [x for x in order if x in names] + [x for x in names if x not in trainable]:
        if not trainable.get(n, True):
            if not exclude_frozen_parameters:
                out[n] = r.read(MODEL + n)       # as DeepSpeed keeps it: in the training dtype
        elif r.has(MASTER + n):
            out[n] = r.read(MASTER + n, dtype=torch.float32)
        else:
            out[n] = r.read(MODEL + n, dtype=torch.float32)
    for alias, source in (spec.get("shared") or {}).items():
        if source in out:
            out[alias] = out[source]
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """DeepSpeed's function of this name for the AdaCheck checkpoint in ``checkpoint_dir``
    (``lazy_mode`` is accepted: every tensor is read at once, on the CPU)."""
    d = adacheck_dir(checkpoint_dir, tag)
    if d is None:
        raise NotFoundError(f"{checkpoint_dir} holds no AdaCheck checkpoint{f' {tag!r}' if tag else ''} "
                            "(no manifest.json there or where its 'latest' points)")
    return fp32_state_dict(d, exclude_frozen_parameters)


def _shards(state: Dict[str, torch.Tensor], max_bytes: Optional[int]) -> List[List[str]]:
    shards: List[List[str]] = [[]]
    size = 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        if max_bytes and shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    return shards


def _size(text) -> Optional[int]:
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {text!r} is not a size such as 5GB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> List[str]:
    """DeepSpeed's function of this name: every floating tensor in fp32, in ``pytorch_model.bin``
    (torch.save) or, with ``safe_serialization``, ``model.safetensors``; split into numbered
    shards with an index file past ``max_shard_size``.  Returns the files written."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    cast: Dict[int, torch.Tensor] = {}     # tied names stay one tensor
    for k, t in state.items():
        state[k] = cast.setdefault(id(t), t.float() if t.is_floating_point() else t)
    shards = _shards(state, _size(max_shard_size))
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    files = ([f"{stem}.{ext}"] if len(shards) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))])
    os.makedirs(output_dir, exist_ok=True)
    for fname, keys in zip(files, shards):
        part = {k: state[k] for k in keys}
        if safe_serialization:
            from safetensors.torch import save_file
            seen = set()          # tied names are one tensor; safetensors stores each name's own bytes
            for k, t in part.items():
                if id(t) in seen:
                    part[k] = t.clone()
                seen.add(id(t))
            save_file({k: t.contiguous() for k, t in part.items()}, os.path.join(output_dir, fname),
                      metadata={"format": "pt"})
        else:
            torch.save(part, os.path.join(output_dir, fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: f for f, keys in zip(files, shards) for k in keys}}
        fname = f"{stem}.{ext}.index.json"
        with open(os.path.join(output_dir, fname), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        files.append(fname)
    return files


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """DeepSpeed's function of this name: the model, moved to the CPU, with the fp32 weights."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="fp32 weights from an AdaCheck checkpoint of a DeepSpeed "
                                            "model, as DeepSpeed's zero_to_fp32.py writes them")
    p.add_argument("checkpoint_dir", help="the save directory (its 'latest', or -t TAG), e.g. out/checkpoint-12")
    p.add_argument("output_dir", help="directory for pytorch_model.bin / model.safetensors (and shards)")
    p.add_argument("--max_shard_size", default="5GB", help="split into shards of at most this size")
    p.add_argument("--safe_serialization", action="store_true", help="write safetensors, not torch.save")
    p.add_argument("-t", "--tag", default=None, help="the checkpoint's tag (default: 'latest')")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    p.add_argument("-d", "--debug", action="store_true", help="accepted, as DeepSpeed's script accepts it")
    a = p.parse_args(argv)
    files = convert_zero_checkpoint_to_fp32_state_dict(a.checkpoint_dir, a.output_dir, a.max_shard_size,
                                                       a.safe_serialization, a.tag, a.exclude_frozen_parameters)
    print(f"wrote {', '.join(files)} to {a.output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
