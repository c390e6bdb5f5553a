"""Conversions: the interface an integration registers a checkpoint format through, and the one
conversion that needs no framework, consolidated weights.

A format (DeepSpeed's native files, megatron-core's torch_dist, ...) is a :class:`Converter`
registered under the entry-point group ``adacheck.converters`` by the package that knows it
(``pyproject.toml``: ``deepspeed = "adacheck_ds.converters:NativeDeepSpeed"``); the ``adacheck
convert`` command finds it by name and imports only the one it is asked for, so the core imports
no integration.  This project's own formats are found also from a source tree on PYTHONPATH,
which has no entry points (``OWN``).

``export_weights`` writes the model's full (unpartitioned) parameters and buffers as
standard safetensors, the way inference and Hugging Face tooling expect them: one
``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards plus
``model.safetensors.index.json`` when ``max_shard_bytes`` is set.  Tensors are produced one
at a time from the checkpoint (peak memory: about one tensor plus the reader's bounded
cache).  Files appear under temporary names and are renamed only when all are complete;
existing files are never overwritten unless ``overwrite``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Callable, Dict, List, Optional

import torch

from ..storage import commit
from ..checkpoint.reader import CheckpointReader
from ..errors import ConfigError, NotFoundError
from ..types import torch_dtype
from ..storage.backends import LOCAL, Storage
from ..format.writer import write_safetensors_to
from ..integration import Converter

CONVERTERS = "adacheck.converters"     # the entry-point group
# The formats this project's own integrations provide, as pyproject.toml registers them: found
# also where the packages are importable but not installed (a source tree on PYTHONPATH, as on a
# cluster that shares one checkout), where no entry point exists for them.
OWN = {"deepspeed": "adacheck_ds.converters:NativeDeepSpeed",
       "deepspeed-universal": "adacheck_ds.converters:DeepSpeedUniversal",
       "torch-dist": "adacheck_megatron.converters:TorchDist"}


def registered() -> Dict[str, object]:
    """name -> entry point of every converter installed, and of this project's own where their
    package is importable without an entry point (nothing is imported)."""
    import importlib.util
    from importlib.metadata import EntryPoint, entry_points
    found = {ep.name: ep for ep in entry_points(group=CONVERTERS)}
    for name, value in OWN.items():
        if name not in found and importlib.util.find_spec(value.split(".")[0]) is not None:
            found[name] = EntryPoint(name, value, CONVERTERS)
    return found


def converter(name: str) -> Converter:
    """The converter registered as ``name`` (imported now); a ConfigError naming those there are."""
    eps = registered()
    if name not in eps:
        raise ConfigError(f"no converter for {name!r} is installed (installed: {', '.join(sorted(eps)) or 'none'}); "
                          "DeepSpeed's formats come with adacheck_ds, torch_dist with adacheck_megatron (install "
                          "AdaCheck with the matching extra)")
    made = eps[name].load()
    conv = made() if isinstance(made, type) else made
    if not isinstance(conv, Converter):
        raise ConfigError(f"the converter registered as {name!r} ({eps[name].value}) is not an adacheck Converter")
    return conv


# ------------------------------------------------------------------ a format's output directory
def refuse_existing(path: str, barrier: Optional[Callable[[], None]] = None) -> None:
    """A conversion never writes over a checkpoint: a ConfigError if ``path`` exists.  With
    ``barrier`` (the ranks of a collective conversion), every rank looks before any rank writes
    and all of them raise alike."""
    exists = os.path.exists(path)
    if barrier is not None:
        barrier()
    if exists:
        raise ConfigError(f"{path} already exists; nothing was written (choose another output directory)")


@contextlib.contextmanager
def output_dir(final: str, tracker: Optional[str] = None, tag: str = ""):
    """The checkpoint directory ``final`` that a framework's own code writes (local files):
    refused if it exists; the block fills ``<final>.tmp`` (yielded), which is renamed to
    ``final`` when the block succeeds and removed when it fails; then the format's ``tracker``
    file (its 'latest', if any) names ``tag``."""
    refuse_existing(final)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        publish(tmp, final, tracker, tag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(built: str, final: str, tracker: Optional[str] = None, tag: str = "") -> None:
    """Move the finished checkpoint directory ``built`` to ``final`` (never over an existing one),
    then have the format's ``tracker`` file (its 'latest', if any) name ``tag``."""
    refuse_existing(final)
    os.replace(built, final)
    if tracker is not None:
        commit.atomic_write_text(tracker, tag)


WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def weight_sources(r: CheckpointReader, dtype: str) -> Dict[str, tuple]:
    """output key -> (logical tensor, torch dtype): ``dtype`` "model" keeps the training
    dtype of the module weights; "fp32", "bf16" or "fp16" casts the fp32 master where there is
    one (else the module weight) to that dtype.  Buffers keep their dtype."""
    if dtype not in ("model", *WEIGHT_DTYPES):
        raise ConfigError(f"dtype must be one of 'model', {', '.join(map(repr, WEIGHT_DTYPES))}; got {dtype!r}")
    # how the integration names module weights and their fp32 masters (DeepSpeed's naming
    # for manifests that do not say)
    names = r.manifest.framework.get("names") or {"model": "model/", "master": "master/"}
    mp, sp = names.get("model", ""), names.get("master", "")
    out = {}
    for name, e in sorted(r.manifest.tensors.items()):
        if e.kind == "model" and name.startswith(mp):
            key = name[len(mp):]
            if dtype != "model":
                src = sp + key if r.has(sp + key) else name
                out[key] = (src, WEIGHT_DTYPES[dtype])
            else:
                out[key] = (name, torch_dtype(e.dtype))
        elif e.kind == "buffer" and name.startswith("buffer/"):
            out[name[len("buffer/"):]] = (name, torch_dtype(e.dtype))
    if not any(e.kind == "model" for e in r.manifest.tensors.values()):
        raise NotFoundError(f"{r.dir} holds no model weights (no tensors of kind 'model')")
    return out


def export_weights(ckpt_dir: str, out_dir: str, dtype: str = "model", max_shard_bytes: Optional[int] = None,
                   overwrite: bool = False, verify: bool = True,
                   progress: Optional[Callable[[int, int], None]] = None, source: Storage = LOCAL,
                   extra_files: Optional[Dict[str, bytes]] = None) -> dict:
    """Full model weights of checkpoint ``ckpt_dir`` (on ``source``) as safetensors files in the local
    ``out_dir``, with ``extra_files`` (name -> bytes, e.g. the model's config.json) beside them;
    every file is committed only once all are written, and none replaces an existing one unless
    ``overwrite``."""
    extra_files = dict(extra_files or {})
    r = CheckpointReader(ckpt_dir, verify=verify, cache_bytes=256 << 20, store=source)
    sources = weight_sources(r, dtype)
    sizes = {k: r.entry(src).numel * torch.empty((), dtype=dt).element_size() for k, (src, dt) in sources.items()}
    shards: List[List[str]] = [[]]
    for key in sorted(sources):
        if max_shard_bytes and shards[-1] and sum(sizes[k] for k in shards[-1]) + sizes[key] > max_shard_bytes:
            shards.append([])
        shards[-1].append(key)
    n = len(shards)
    names = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    targets = names + ([INDEX_NAME] if n > 1 else []) + sorted(extra_files)
    store = LOCAL
    store.make_dirs(out_dir)
    clash = [t for t in targets if store.exists(store.join(out_dir, t))]
    if clash and not overwrite:
        raise ConfigError(f"{out_dir} already has {clash}; choose another output directory or pass "
                          "overwrite=True (--overwrite)")
    done, total = 0, sum(sizes.values())

    def produce(key):
        nonlocal done
        src, dt = sources[key]
        t = r.read(src, dtype=dt)
        done += sizes[key]
        if progress is not None:
            progress(done, total)
        return t

    writers = []      # every file is written first, then all are committed: none appears alone
    try:
        for fname, keys in zip(names, shards):
            writers.append(store.open_writer(store.join(out_dir, fname)))
            specs = [(k, sources[k][1], tuple(r.entry(sources[k][0]).shape)) for k in keys]
            write_safetensors_to(writers[-1], specs, produce, {"format": "pt", "adacheck_source": r.manifest.tag})
        if n > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: fname for fname, keys in zip(names, shards) for k in keys}}
            writers.append(store.open_writer(store.join(out_dir, INDEX_NAME)))
            writers[-1].write(json.dumps(index, indent=1, sort_keys=True).encode("utf-8"))
        for fname in sorted(extra_files):
            writers.append(store.open_writer(store.join(out_dir, fname)))
            writers[-1].write(extra_files[fname])
        for w in writers:
            w.commit()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return {"files": targets, "tensors": len(sources), "bytes": total, "dtype": dtype}
