"""A collective load (:class:`Loader`): open the checkpoint (from the memory tier where it has
it), let every rank stage its part, and only then apply it; a damaged checkpoint is named with
the newest intact one and how to load it, or (``on_corrupt: fallback``) that one is loaded.
The result is a :class:`LoadResult`."""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Optional, Tuple

from ..storage import commit
from ..storage import manifest_files
from . import lifecycle
from ..errors import ConfigError, CorruptCheckpointWarning, FormatError, NotFoundError
from ..plan.exchange import Comm, agree
from ..format.manifest_read import PartedTensors
from ..integration import Restore
from ..types import Manifest
from ..storage.backends import Storage
from .options import Caches, Options
from .reader import CheckpointReader, find_intact, resolve

log = logging.getLogger("adacheck")


@dataclass(frozen=True)
class Source:
    """Where a load reads a checkpoint: ``load_dir`` on ``store``, the ``tier`` it is in ("memory",
    "durable", or None without tiers) and its ``tag`` (None: the one ``latest`` names)."""
    store: Storage
    load_dir: str
    tier: Optional[str]
    tag: Optional[str]


@dataclass(frozen=True)
class Opened:
    """A checkpoint opened and staged on this rank: its ``ckpt_dir`` and ``manifest``, what
    ``Restore.read`` returned (``staged``), the ``reader`` it read with, and its ``source``."""
    ckpt_dir: str
    manifest: Manifest
    staged: object
    reader: CheckpointReader
    source: Source
    seconds: Dict[str, float] = field(default_factory=dict)    # "open", "read"


def stage_checkpoint(comm: Comm, source: Source, restore: Restore, verify: bool,
                     prefer_present: bool = False) -> Opened:
    """Collectively open the checkpoint ``source`` names and let every rank stage its part
    (``restore.read``; ``restore.undo`` on every rank when any failed).  ``prefer_present``: read
    the copies in this node's directory first (a memory-tier checkpoint across nodes)."""
    load_dir, tag, store = source.load_dir, source.tag, source.store

    def open_():
        d = resolve(load_dir, tag, store)
        return d, manifest_files.read_manifest(d, store)

    t0 = time.perf_counter()
    ckpt_dir, manifest = agree(comm, f"AdaCheck load from {load_dir} (open)", open_)
    t_open = time.perf_counter()
    if not comm.same(manifest.tag):
        tags = comm.all_gather_object(manifest.tag)
        raise ConfigError(f"ranks resolved different checkpoints to load: {tags}; is {load_dir} "
                          "the same shared directory on every rank?")
    reader = CheckpointReader(ckpt_dir, manifest, verify=verify, prefer_rank=comm.rank, store=store,
                              prefer_present=prefer_present)
    staged = agree(comm, f"AdaCheck load of {ckpt_dir} (read)", lambda: reader.stage(restore.read), on_failure=restore.undo)
    return Opened(ckpt_dir, manifest, staged, reader, source,
                  {"open": t_open - t0, "read": time.perf_counter() - t_open})


def _advice(load_dir: str, failed: Optional[str], intact, how_to_load, explicit: bool) -> str:
    what = f"Checkpoint {failed!r} in {load_dir}" if failed else f"The checkpoint that {load_dir}/latest should name"
    if intact is None:
        return (f"Nothing was loaded. {what} cannot be loaded, and no other checkpoint there verifies "
                "either: restore the damaged files from a copy.")
    tag, manifest = intact
    return (f"Nothing was loaded. {what} cannot be loaded; the newest intact checkpoint there "
            f"is {tag!r} (step {manifest.step}, every stored box verified). To load it: {how_to_load(tag, manifest)}"
            + ("" if explicit else "; or set on_corrupt \"fallback\" (Megatron: --adacheck-on-corrupt fallback) "
               "to load the newest intact checkpoint when the latest is damaged") + ".")


@dataclass(frozen=True)
class LoadResult:
    """What a load did: ``ckpt_dir`` and ``manifest`` of the checkpoint it loaded, ``result`` (what
    the integration's ``apply`` returned), where it read it (``store`` and ``load_dir``: with the
    memory tier, its copy there), ``tier`` ("memory", "durable", or None without tiers) and
    ``read``: the bytes this rank read of the manifest's parts ("parts", "meta"), of rank files
    ("rank_files") and of tensor data ("data"); ``seconds``: this rank's time to "choose" the tier
    (with tiers: which one holds the newest checkpoint), open the checkpoint ("open": resolve and
    parse the manifest), stage it ("read": read and verify what ``Restore.read`` asked for) and
    "apply" it."""
    ckpt_dir: str
    manifest: Manifest
    result: object
    store: Storage
    load_dir: str
    tier: Optional[str]
    read: Dict[str, int]
    seconds: Dict[str, float] = field(default_factory=dict)


class Loader:
    """Collective loads for a job: its ``options``, ``caches`` (the checkpoint a load verified is
    trusted for the next save's references) and ``locate`` (a path or URL to its storage and the
    path there).  :meth:`choose` and :meth:`stage` are where a tier puts itself in front of the
    checkpoint directory (:class:`adacheck.tiers.tiered.TieredLoader`)."""

    def __init__(self, options: Options, caches: Caches, locate: Callable[[str], Tuple[Storage, str]]):
        self.options, self.caches, self.locate = options, caches, locate

    def choose(self, comm: Comm, asked: Source, restore: Restore) -> Source:
        """Where to load from: here, the checkpoint directory as ``asked``."""
        return asked

    def stage(self, comm: Comm, source: Source, restore: Restore) -> Opened:
        """Open the checkpoint ``source`` names and let every rank stage its part."""
        return stage_checkpoint(comm, source, restore, self.options.verify)

    def load(self, comm: Comm, load_dir: str, tag: Optional[str], restore: Restore) -> LoadResult:
        """Collectively open a checkpoint, let every rank stage its part (``restore.read``), then
        ``restore.apply`` it (see :class:`~adacheck.integration.Restore`).

        Only once every rank has staged its part without error does any rank apply; when staging
        fails on any rank, ``restore.undo`` runs on every rank.  When the checkpoint turns out
        damaged while it is opened or staged (a FormatError or IntegrityError on any rank, a
        ``latest`` that names nothing), nothing has been applied: the error names the newest
        intact checkpoint (every box verified, the ranks sharing the work) and how to load it
        (``restore.how_to_load``); with ``on_corrupt="fallback"`` and no explicit ``tag``, that
        checkpoint is loaded instead, with a warning on every rank.
        """
        lifecycle.register()
        lifecycle.finish_saves(block=True)     # asynchronous saves in flight (any job's here) commit first
        opts = self.options
        store, load_dir = self.locate(load_dir)
        t0 = time.perf_counter()
        source = self.choose(comm, Source(store, load_dir, None, tag), restore)
        chosen = time.perf_counter()
        store, load_dir = source.store, source.load_dir
        try:
            opened = self.stage(comm, source, restore)
        except (FormatError, NotFoundError) as e:
            if isinstance(e, NotFoundError) and (tag is not None or not commit.has_latest(load_dir, store)):
                raise      # nothing there to load (a tag that does not exist, an empty directory): not damage
            failed = tag if tag is not None else commit.latest_or_none(load_dir, store)
            intact = find_intact(comm, load_dir, exclude=(failed,), store=store)
            if opts.on_corrupt != "fallback" or tag is not None or intact is None:
                e.args = (f"{e}\n{_advice(load_dir, failed, intact, restore.how_to_load, explicit=tag is not None)}",)
                raise
            warnings.warn(f"AdaCheck: the checkpoint {failed or 'that latest names'} in {load_dir} is damaged "
                          f"({str(e).splitlines()[-1].strip()}); loading {intact[0]} (step {intact[1].step}), the "
                          "newest intact checkpoint, instead (on_corrupt: fallback)", CorruptCheckpointWarning,
                          stacklevel=4)
            opened = stage_checkpoint(comm, replace(source, tag=intact[0]), restore, opts.verify)
        ckpt_dir, manifest, reader, source = opened.ckpt_dir, opened.manifest, opened.reader, opened.source
        t_apply = time.perf_counter()
        result = agree(comm, f"AdaCheck load of {ckpt_dir} (apply)", lambda: restore.apply(opened.staged))
        seconds = dict(opened.seconds, choose=chosen - t0, apply=time.perf_counter() - t_apply)
        # what this rank read of the manifest besides manifest.json (a manifest in parts)
        parted = isinstance(manifest.tensors, PartedTensors)
        read_bytes = {"parts": manifest.tensors.bytes_read if parted else 0,
                      "meta": manifest.tensors.meta_bytes_read if parted else 0,
                      "rank_files": manifest.ranks.bytes_read if manifest.ranks is not None else 0,
                      "data": reader.bytes_read}       # tensor bytes read from shard files
        if opts.verify:
            self.caches.trust(ckpt_dir, source.store)
        if source.tier is not None:
            log.info("AdaCheck: rank %d loaded %s (step %s) from the %s tier in %.2fs", comm.rank, manifest.tag,
                     manifest.step, source.tier, time.perf_counter() - t0)
        return LoadResult(ckpt_dir, manifest, result, source.store, source.load_dir, source.tier, read_bytes, seconds)
