"""The typed results of a save's steps (:class:`~adacheck.checkpoint.saving.SavePipeline`):
:class:`Snapshot` -> :class:`Prepared` -> :class:`Exchanged` -> ``WritePlan`` -> :class:`Written`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..integration import LocalShard
from ..storage.backends import LOCAL, Storage
from ..storage.lease import Holding
from ..types import Box


@dataclass
class Snapshot:
    """Step 0 of a save, on this rank: what the integration's ``collect()`` returned, chunked, its
    objects encoded.  An asynchronous save's tensors are host copies taken at the call; ``ready``
    waits until their device-to-host copies have landed (None: nothing to wait for)."""
    save_dir: str
    tag: str
    ckpt_dir: str
    store: Storage
    shards: Dict[Tuple[str, Box], LocalShard]
    objects: Optional[dict]
    rank_objects: dict
    layout: dict
    framework: dict
    step: Optional[int]
    started: float
    ready: Optional[Callable[[], None]] = None
    given_dir: str = ""     # save_dir as the caller named it (a URL for remote storage)
    min_generation: int = 0     # the save's file generation is at least this (the memory tier: past the
    # generations of the same tag in the checkpoint directory, where its files are copied)
    lease: Optional[Holding] = None     # the save directory's lease this job holds (rank 0; adacheck.storage.lease)
    collected: float = 0.0      # when this rank's snapshot was taken (perf_counter), for the save's profile


def shown_dir(snap: Snapshot) -> str:
    """The checkpoint's directory as the caller would name it (a URL for remote storage)."""
    return f"{snap.given_dir.rstrip('/')}/{snap.tag}" if snap.given_dir else snap.ckpt_dir


@dataclass
class Prepared:
    """Step 1 of a save, on this rank: what it holds, chunked and hashed (``shards``), and what it
    sends the others (``payload``: its (box, hash) list, objects, layout, node; rank 0 adds the
    generation and the checkpoint new boxes may reference)."""
    save_dir: str
    tag: str
    ckpt_dir: str
    shards: Dict[Tuple[str, Box], LocalShard]
    payload: dict
    started: float
    store: Storage = LOCAL     # where save_dir lives (Checkpointer.locate)
    lease: Optional[Holding] = None     # (Snapshot.lease): checked before the manifest and 'latest'
    how: str = "ring"          # the exchange this save runs (plan.exchange.exchange_for), chosen once


@dataclass
class Exchanged:
    """Step 2: every rank's payload on every rank, and what the exchange cost.  With the
    partitioned exchange (:mod:`adacheck.plan.partition`) the (box, hash) lists go to their owners in
    the plan step instead, and no rank gathers the others' payloads: ``gathered`` holds this
    rank's, without ``metas`` (with rank 0's step and framework; rank 0's objects are the job's),
    and each rank keeps its own objects and layout in its rank file; ``nodes``: every rank's node
    where the plan needs it (copies > 1)."""
    gathered: List[dict]
    generation: int
    previous: Optional[str]
    stats: dict
    partitioned: bool = False
    nodes: Optional[List[str]] = None
    index: Optional[dict] = None        # partitioned, on rank 0: the manifest's index (its parts' hashes at the commit)


@dataclass
class Written:
    """Step 4: the size of every rank's file (0: it wrote none) and the storage's tag of its content
    (None: none), both per rank (partitioned: empty; ``total``: the sum of the sizes), and this
    rank's file name, size and tag."""
    sizes: List[int]
    tags: List[Optional[str]]
    my_file: Optional[str]
    my_size: int = 0
    my_tag: Optional[str] = None
    total: int = 0
