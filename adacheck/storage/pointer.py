"""A checkpoint saved into the job's own directory while the caller named another: the pointer.

A job with a fixed checkpoint directory (``save_dir`` in the config) may be asked to save into
another directory: a Hugging Face Trainer saves into ``output/checkpoint-N`` and later resumes
from there.  The checkpoint goes to the job's directory (its online deltas, retention and
references live there), and ``<given>/<tag>/adacheck.json`` names it, so the caller finds the tag
directory it expects and a load of ``given`` loads exactly that checkpoint, at the step it was
saved at.  Both directories may be local paths or URLs; every read and write goes through the
:class:`~adacheck.storage.backends.Storage` each lives on.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from . import commit
from ..online import deltas
from ..errors import FormatError
from .backends import Storage

POINTER_NAME = "adacheck.json"
log = logging.getLogger("adacheck")
Where = Callable[[str], Tuple[Storage, str]]    # a directory -> the storage it is on, and its path there


@dataclass(frozen=True)
class Pointer:
    """Where the checkpoint a caller's directory names went: the job's ``save_dir`` (its
    canonical spelling: an absolute path or a URL), its ``tag``, and the ``step`` it holds."""
    save_dir: str
    tag: str
    step: int


def write(store: Storage, given: str, tag: str, save_dir: str, step: int) -> None:
    """Leave ``<given>/<tag>/adacheck.json`` naming checkpoint ``tag`` of ``save_dir`` (canonical)."""
    d = store.join(given, tag)
    store.make_dirs(d)
    commit.atomic_write_text(store.join(d, POINTER_NAME),
                             json.dumps({"adacheck_save_dir": save_dir, "tag": tag, "step": int(step)}) + "\n",
                             store=store)


def find(store: Storage, load_dir: str, tag: Optional[str] = None) -> Optional[Pointer]:
    """The pointer a save left in ``load_dir`` (``tag``'s, or the one of the highest step), or None."""
    if not store.is_dir(load_dir):
        return None
    found = []
    for name in store.list(load_dir):
        path = store.join(load_dir, name, POINTER_NAME)
        if tag is not None and name != str(tag):
            continue
        try:
            data = store.read_bytes(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        try:
            said = json.loads(data)
            found.append(Pointer(str(said["adacheck_save_dir"]), str(said["tag"]), int(said["step"])))
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{path}: not an AdaCheck pointer ({e}); it names the checkpoint of this directory "
                              "in the job's save_dir: restore it, or load that directory") from None
    return max(found, key=lambda p: p.step) if found else None


def newer_state(store: Storage, save_dir: str, pointer: Pointer) -> Optional[str]:
    """What ``save_dir`` (the pointer's, on ``store``) holds past the pointer's step, in words (a
    newer ``latest``, or online deltas after it), or None."""
    latest = commit.latest_or_none(save_dir, store) if store.is_dir(save_dir) else None
    if latest is not None and latest != pointer.tag:
        return f"its latest is {latest}"
    try:
        steps = [s for s in deltas.step_dirs(store.join(save_dir, pointer.tag), store) if s > pointer.step]
    except OSError:
        steps = []
    return f"online deltas up to step {steps[-1]}" if steps else None


def leave(where: Where, given: str, save_dir: str, tag: str, step: int) -> None:
    """After a save of ``tag`` into ``save_dir`` that the caller asked for in ``given``: the pointer
    in ``given``, when that is another directory (rank 0 only)."""
    (here, at), (store, path) = where(given), where(save_dir)
    if here.canonical(at) != store.canonical(path):
        write(here, at, tag, store.canonical(path), step)


def follow(where: Where, load_dir: str, tag: Optional[str], rank: int) -> Optional[Pointer]:
    """The pointer a load of ``load_dir`` (``tag``) follows, or None.  Rank 0 warns when the job's
    directory holds newer state than the pointer's step, which that load does not take."""
    found = find(*where(load_dir), tag)
    if found is None:
        return None
    log.info("AdaCheck: %s names %s of %s: loading step %s, the step it was saved at", load_dir,
             found.tag, found.save_dir, found.step)
    newer = newer_state(*where(found.save_dir), found) if rank == 0 else None
    if newer:
        log.warning("AdaCheck: %s holds state newer than step %s (%s), which this load does not take: load %s "
                    "itself for the newest state (a Hugging Face Trainer resumes at the step of its checkpoint-N, "
                    "so there the older step is the right one)", found.save_dir, found.step, newer, found.save_dir)
    return found
