"""A job's checkpointer: the one an integration makes (:func:`checkpointer`) or keeps on an object
that lives as long as the job (:func:`kept_on`).

With ``options.tiers`` it is a :class:`~adacheck.tiers.tiered.TieredCheckpointer` (the memory tier
in front of the checkpoint directory), else a plain :class:`~adacheck.checkpoint.Checkpointer`."""
from __future__ import annotations

from typing import Optional

from .checkpoint.checkpointer import Checkpointer
from .checkpoint.options import DEFAULT_CACHES, Caches, Options
from .storage.backends import LOCAL, Storage
from .tiers.tiered import TieredCheckpointer

KEPT = "adacheck_checkpointer"      # the attribute of the object a job's checkpointer is kept on


class _Process:
    """What the process's own checkpointer is kept on (:func:`kept_on` without an owner)."""


_PROCESS = _Process()


def checkpointer(options: Optional[Options] = None, store: Storage = LOCAL,
                 caches: Optional[Caches] = None) -> Checkpointer:
    """A new checkpointer for a job.

    Args:
        options: how it saves and loads (default ``Options()``); ``options.tiers`` chooses the class.
        store: the storage of plain paths (default: the local filesystem).
        caches: what it keeps between checkpoints (default: its own).

    Returns:
        A :class:`~adacheck.tiers.tiered.TieredCheckpointer` with ``options.tiers``, else a
        :class:`~adacheck.checkpoint.Checkpointer`.
    """
    options = options if options is not None else Options()
    cls = TieredCheckpointer if options.tiers is not None else Checkpointer
    return cls(store, options, caches)


def kept_on(owner, options: Options) -> Checkpointer:
    """The checkpointer kept on ``owner`` (an object that lives as long as the job), made the first
    time and given ``options`` after; without an owner, the process's own (its caches
    DEFAULT_CACHES): one job, so that a memory tier's saves count towards one persist_interval and
    its newest is the one persisted at exit.  Options that turn the memory tier on or off replace
    the kept checkpointer (the old one closed first: its saves committed, its newest memory
    checkpoint persisted) by one of the other class, with the same caches and ``on_saved``."""
    owner = owner if owner is not None else _PROCESS
    job = kept(owner)
    if job is not None and job.has_tiers != (options.tiers is not None):
        job.close()
        old, job = job, checkpointer(options, job.store, job.caches)
        job.on_saved = old.on_saved       # whoever follows the job's saves goes on following them
        setattr(owner, KEPT, job)
    elif job is None:
        job = checkpointer(options, caches=DEFAULT_CACHES if owner is _PROCESS else None)
        setattr(owner, KEPT, job)
    job.configure(options)
    return job


def kept(owner) -> Optional[Checkpointer]:
    """The checkpointer :func:`kept_on` keeps on ``owner`` (None: none yet)."""
    return getattr(owner, KEPT, None)
