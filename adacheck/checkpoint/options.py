"""How a job saves and loads (:class:`Options`, from the config), and what it keeps in this process
from one checkpoint to the next (:class:`Caches`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Tuple

from ..plan import partition
from ..storage import manifest_files
from ..storage.backends import Storage
from ..storage.lease import DEFAULT_TTL_S
from ..plan.planner import PlanCache

if TYPE_CHECKING:
    from ..config import TiersConfig


@dataclass
class Caches:
    """What a job keeps from one checkpoint to the next, in this process:

    - ``exchanged``: the structures every rank sent last time (a rank whose boxes did not change
      then sends a digest and its hashes: see ``_exchange``); ``partitioned``: the same for the
      partitioned exchange (:mod:`adacheck.plan.partition`), per owner;
    - ``plan``: the planner's (the last placement, the structures proven to tile);
    - ``trusted``: per save directory, the checkpoint this job last loaded (every box verified by
      some rank) or committed there.  A new save references boxes of that one only: not of
      whatever 'latest' names, which may be damaged (a reference records the hash of the new
      bytes, not of the bytes on disk) or written by another job since;
    - ``nodes``: every rank's node, per world size (the partitioned exchange's copies)."""
    exchanged: Dict[int, Dict[int, Tuple[str, list]]] = field(default_factory=dict)
    partitioned: Dict[int, partition.PartitionCache] = field(default_factory=dict)   # world size -> its cache
    plan: PlanCache = field(default_factory=PlanCache)
    trusted: Dict[str, str] = field(default_factory=dict)
    nodes: Dict[int, List[str]] = field(default_factory=dict)

    def previous(self, store: Storage, save_dir: str, tag: str) -> Optional[str]:
        """The committed checkpoint a new save ``tag`` into ``save_dir`` may reference, or None."""
        prev = self.trusted.get(store.canonical(save_dir))
        if prev is None or prev == tag or not manifest_files.has_manifest(store.join(save_dir, prev), store):
            return None
        return prev

    def trust(self, ckpt_dir: str, store: Storage) -> None:
        """``ckpt_dir`` was just committed or loaded (verified) by this job."""
        self.trusted[store.canonical(store.parent(ckpt_dir))] = store.basename(ckpt_dir)


class Spread(Protocol):
    """A save across nodes in which each node's directory is its own (the memory tier's
    :class:`~adacheck.tiers.peers.NodeSpread`): what the save's steps ask of it."""

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` writes its node's manifest (its node's lowest rank)."""

    def before(self, rank: int) -> int:
        """The rank of the same node that confirms ``rank``'s files."""

    def move(self, comm, ckpt_dir: str, files: Dict[str, dict]) -> Dict[str, dict]:
        """Collective, once every writer's file is committed on its node: the copies of the
        files for other nodes travel; returns the files this rank's node holds."""

    def move_own(self, comm, ckpt_dir: str, tag: str, own: Callable[[int], List[str]]) -> None:
        """Collective, in a save in parts: each rank's own files (``own(rank)``) travel to the
        node that keeps copies of them."""


# The caches of the module-level save() and load(): one job per process unless an integration
# keeps a Checkpointer (with caches of its own) per job.
DEFAULT_CACHES = Caches()


@dataclass(frozen=True)
class Options:
    """How a job saves and loads (AdaCheckConfig's keys, see adacheck.config): ``keep_last``
    newest checkpoints (None: all), ``fsync``, ``reference_previous`` unchanged boxes, ``copies``
    of each distinct box (on distinct nodes), the ``exchange`` ("auto", "ring", "allgather" or
    "partitioned": :func:`adacheck.plan.exchange.exchange_for`), boxes
    larger than ``chunk_bytes`` stored as row chunks, ``verify`` hashes on load, ``on_corrupt``
    ("raise" or "fallback"), ``storage_options`` for the fsspec filesystem of a URL (see
    :meth:`Checkpointer.locate`), ``on_error``: an asynchronous save that fails in the background
    is a warning ("warn") or raises at the next poll, save, load or exit ("raise"); ``compression``
    None or "zstd" (:mod:`adacheck.format.compression`); ``writer``: where an asynchronous save's persist
    runs, a "thread" of the training process or a "process" of its own
    (:mod:`adacheck.checkpoint.writer_process`)."""
    keep_last: Optional[int] = None
    fsync: bool = True
    reference_previous: bool = True
    copies: int = 1
    exchange: str = "auto"
    chunk_bytes: int = 64 << 20
    verify: bool = True
    on_corrupt: str = "raise"
    storage_options: Optional[dict] = None
    on_error: str = "warn"
    compression: Optional[str] = None
    writer: str = "process"
    tiers: Optional["TiersConfig"] = None   # with memory on (a TieredCheckpointer, adacheck.tiers), or None
    derive: bool = True                 # store a tensor that is a cast of another as that derivation
    spread: Optional[Spread] = None     # a memory-tier save across nodes, or None
    lease_ttl_s: float = DEFAULT_TTL_S  # the save directory's lease expires this long after its last renewal
    takeover: bool = False              # take the save directory's lease from the job that holds it

    @classmethod
    def from_config(cls, config) -> "Options":
        return cls(keep_last=config.keep_last or None, fsync=config.fsync,
                   reference_previous=config.reference_previous, copies=config.redundancy_factor,
                   exchange=config.exchange, chunk_bytes=config.hash_chunk_bytes, verify=config.verify_on_load,
                   on_corrupt=config.on_corrupt, storage_options=dict(config.storage_options) or None,
                   on_error=config.on_error, compression=config.compression, writer=config.async_writer,
                   tiers=config.tiers if config.tiers.memory else None, lease_ttl_s=float(config.lease_ttl_s),
                   takeover=config.takeover)
