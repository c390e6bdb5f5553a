"""A collective load (:class:`Loader`): open the checkpoint (from the memory tier where it has
it), let every rank stage its part, and only then apply it; a damaged checkpoint is named with
the newest intact one and how to load it, or (``on_corrupt: fallback``) that one is loaded.
The result is a :class:`LoadResult`."""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

from ..storage import commit
from . import lifecycle
from ..errors import AdaCheckError, ConfigError, CorruptCheckpointWarning, FormatError, NotFoundError
from ..plan.exchange import Comm, agree
from ..format.manifest_read import PartedTensors
from ..types import Manifest
from ..storage.backends import LOCAL, Storage
from .options import Caches, Options
from .reader import CheckpointReader, find_intact, resolve

log = logging.getLogger("adacheck")


def _stage(comm: Comm, load_dir: str, tag: Optional[str], read, verify: bool, undo=None, store: Storage = LOCAL,
           prefer_present: bool = False):
    def open_():
        d = resolve(load_dir, tag, store)
        return d, commit.read_manifest(d, store)

    ckpt_dir, manifest = agree(comm, f"AdaCheck load from {load_dir} (open)", open_)
    if not comm.same(manifest.tag):
        tags = comm.all_gather_object(manifest.tag)
        raise ConfigError(f"ranks resolved different checkpoints to load: {tags}; is {load_dir} "
                          "the same shared directory on every rank?")
    reader = CheckpointReader(ckpt_dir, manifest, verify=verify, prefer_rank=comm.rank, store=store,
                              prefer_present=prefer_present)
    staged = agree(comm, f"AdaCheck load of {ckpt_dir} (read)", lambda: read(reader), on_failure=undo)
    return ckpt_dir, manifest, staged, reader


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
    ("rank_files") and of tensor data ("data")."""
    ckpt_dir: str
    manifest: Manifest
    result: object
    store: Storage
    load_dir: str
    tier: Optional[str]
    read: Dict[str, int]


class Loader:
    """Collective loads for a job: its ``options``, ``caches`` (the checkpoint a load verified is
    trusted for the next save's references), ``locate`` (a path or URL to its storage and the
    path there) and ``memory_tier`` (the job's memory tier; called only with ``options.tiers``)."""

    def __init__(self, options: Options, caches: Caches, locate: Callable[[str], Tuple[Storage, str]],
                 memory_tier: Callable[[], object]):
        self.options, self.caches, self.locate, self.memory_tier = options, caches, locate, memory_tier

    def load(self, comm: Comm, load_dir: str, tag: Optional[str], read: Callable[["CheckpointReader"], object],
             apply: Callable[[object], object],
             how_to_load: Callable[[str, Manifest], str] = lambda tag, manifest: f"tag={tag!r}",
             undo: Optional[Callable[[], None]] = None, reads_objects_of: Sequence[int] = ()) -> LoadResult:
        """Collectively open a checkpoint, stage this rank's part (``read``), then ``apply`` it.

        ``read`` must not change training state: only once every rank has staged its part
        without error does any rank call ``apply``.  Where staging must touch it (megatron-core
        builds optimizer state to load into), ``undo`` takes that back on every rank when the
        staging fails on any.  When the checkpoint turns out damaged while it is opened or
        staged (a FormatError or IntegrityError on any rank, a ``latest`` that names nothing),
        nothing has been applied: the error names the newest intact checkpoint (every box
        verified, the ranks sharing the work) and how to load it (``how_to_load(tag, manifest)``:
        the integration's call or flag); with ``on_corrupt="fallback"`` and no explicit ``tag``,
        that checkpoint is loaded instead, with a warning on every rank.  ``reads_objects_of``: the
        saving ranks whose objects ``read`` looks up besides this rank's own (megatron-core's
        ShardedObjects whose main replica another rank saved); from the memory tier across nodes
        each node is sent them first.
        """
        lifecycle.register()
        lifecycle.finish_saves(block=True)     # asynchronous saves in flight (any job's here) commit first
        opts = self.options
        store, load_dir = self.locate(load_dir)
        t0, tier, chosen = time.perf_counter(), None, tag
        if opts.tiers is not None:
            given = (store, load_dir)
            store, load_dir, tier, chosen = self.memory_tier().choose(comm, store, load_dir, tag,
                                                                      reads_objects_of=reads_objects_of)
        try:
            if tier != "memory":
                ckpt_dir, manifest, staged, reader = _stage(comm, load_dir, chosen, read, opts.verify, undo, store)
            else:
                try:     # (a node's memory holds a copy of what its ranks held when saved, preferred)
                    ckpt_dir, manifest, staged, reader = _stage(comm, load_dir, chosen, read, opts.verify, undo, store,
                                                        prefer_present=True)
                except AdaCheckError as e:
                    if not self.memory_tier().across:
                        raise
                    # another layout than the holders of the saved regions tell: every node gets a copy of
                    # every region, and the ranks stage again (nothing was applied)
                    log.warning("AdaCheck: staging from the memory tier failed (%s); every node gathers the whole "
                                "checkpoint and tries again", str(e).splitlines()[0])
                    store, load_dir, tier, chosen = self.memory_tier().choose(comm, *given, chosen, everything=True)
                    ckpt_dir, manifest, staged, reader = _stage(comm, load_dir, chosen, read, opts.verify, undo, store,
                                                        prefer_present=True)
        except (FormatError, NotFoundError) as e:
            if isinstance(e, NotFoundError) and (tag is not None or not commit.has_latest(load_dir, store)):
                raise      # nothing there to load (a tag that does not exist, an empty directory): not damage
            failed = tag if tag is not None else commit.latest_or_none(load_dir, store)
            intact = find_intact(comm, load_dir, exclude=(failed,), store=store)
            if opts.on_corrupt != "fallback" or tag is not None or intact is None:
                e.args = (f"{e}\n{_advice(load_dir, failed, intact, how_to_load, explicit=tag is not None)}",)
                raise
            warnings.warn(f"AdaCheck: the checkpoint {failed or 'that latest names'} in {load_dir} is damaged "
                          f"({str(e).splitlines()[-1].strip()}); loading {intact[0]} (step {intact[1].step}), the "
                          "newest intact checkpoint, instead (on_corrupt: fallback)", CorruptCheckpointWarning,
                          stacklevel=4)
            ckpt_dir, manifest, staged, reader = _stage(comm, load_dir, intact[0], read, opts.verify, undo, store)
        result = agree(comm, f"AdaCheck load of {ckpt_dir} (apply)", lambda: apply(staged))
        # what this rank read of the manifest besides manifest.json (a manifest in parts)
        parted = isinstance(manifest.tensors, PartedTensors)
        read_bytes = {"parts": manifest.tensors.bytes_read if parted else 0,
                      "meta": manifest.tensors.meta_bytes_read if parted else 0,
                      "rank_files": manifest.ranks.bytes_read if manifest.ranks is not None else 0,
                      "data": reader.bytes_read}       # (tensor bytes read from shard files)
        if opts.verify:
            self.caches.trust(ckpt_dir, store)
        if tier is not None:
            log.info("AdaCheck: rank %d loaded %s (step %s) from the %s tier in %.2fs", comm.rank, manifest.tag,
                     manifest.step, tier, time.perf_counter() - t0)
        return LoadResult(ckpt_dir, manifest, result, store, load_dir, tier, read_bytes)
