"""A save directory's catalog and its commit protocol, on any
:class:`~adacheck.storage.backends.Storage` shared by all ranks: ``latest``, the checkpoints there
and their file generations, retention and garbage collection (the metadata files of one
checkpoint are :mod:`adacheck.storage.manifest_files`'s).  Write-then-commit:

- shard files are written through the storage's writer (POSIX: ``<name>.tmp``, fsynced,
  renamed, the directory fsynced; an object store: the object appears whole when uploaded);
- ``manifest.json`` is written whole (atomically) after every rank's files are durable, so a
  checkpoint directory is either its old committed state or the new one;
- ``latest`` is written whole only after the manifest is durable;
- a loader only ever opens a directory through its manifest, so torn saves are invisible.

Every function takes ``store`` (default: the local filesystem).
"""
from __future__ import annotations

import re
import time
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Tuple

from ..errors import AdaCheckError, FormatError, NotFoundError
from ..format.hashing import hash_buffer
from ..format.manifest import MANIFEST_NAME, PART_PATTERN, SHARD_PATTERN, TAG_RE, part_names, referenced_files
from .backends import LOCAL, Storage
from ..format.manifest_read import parse
from .manifest_files import PartFiles, has_manifest, manifest_text, read_manifest
from ..types import Manifest

LATEST = "latest"
TMP_SUFFIX = Storage.TMP_SUFFIX


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_RE.match(tag) or tag in (LATEST,):
        raise FormatError(f"checkpoint tag {tag!r} must be 1-200 characters of letters, digits, "
                          "'.', '_', '+', '-', start with a letter or digit, and not be 'latest'")
    return tag


def atomic_write_text(path: str, text: str, fsync: bool = True, store: Storage = LOCAL) -> None:
    store.write_atomic(path, text.encode("utf-8"), fsync=fsync)


def read_latest(save_dir: str, store: Storage = LOCAL) -> Optional[str]:
    """The tag ``<save_dir>/latest`` names; None when there is no such file; a FormatError when
    it names no possible checkpoint (empty, garbage, a path leading out of ``save_dir``)."""
    path = store.join(save_dir, LATEST)
    try:
        raw = store.read_bytes(path, 1024)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise FormatError(f"{path}: cannot read it: {e}") from e
    try:
        tag = raw.decode("utf-8").strip()
        return check_tag(tag)
    except (UnicodeDecodeError, FormatError):
        raise FormatError(f"{path} is damaged: it holds {raw[:60]!r}, which names no checkpoint (a tag of letters, "
                          "digits, '.', '_', '+', '-'). Write the tag of the checkpoint to load into it, or load "
                          "one by its tag") from None


def latest_or_none(save_dir: str, store: Storage = LOCAL) -> Optional[str]:
    """:func:`read_latest`, with None for a damaged ``latest`` too (for decisions, not for loads)."""
    try:
        return read_latest(save_dir, store)
    except FormatError:
        return None


def has_latest(save_dir: str, store: Storage = LOCAL) -> bool:
    """Whether ``<save_dir>/latest`` exists (intact or not)."""
    return store.exists(store.join(save_dir, LATEST))


def has_checkpoint(load_dir: str, store: Storage = LOCAL) -> bool:
    """Whether ``load_dir`` holds anything a load could mean: a ``latest`` file (intact or not),
    a checkpoint directory with a manifest, or is one."""
    if has_latest(load_dir, store) or has_manifest(load_dir, store):
        return True
    return any(summary is not None for _, summary in summaries(load_dir, store))


def write_latest(save_dir: str, tag: str, store: Storage = LOCAL) -> None:
    atomic_write_text(store.join(save_dir, LATEST), check_tag(tag) + "\n", store=store)


README = "README"
README_TEXT = """This directory holds AdaCheck checkpoints: each <tag>/ holds one, as manifest.json
(written last) and safetensors files; 'latest' names the newest that was committed.

DeepSpeed and Megatron do not read this format on their own. DeepSpeed's load_checkpoint
fails here with a bare AssertionError (in state_dict_factory: assert len(self.ckpt_list) > 0)
when the script does not import adacheck_ds. To load it:
  DeepSpeed: import adacheck_ds before deepspeed.initialize, with
             "adacheck": {"enabled": true} in the DeepSpeed config; then
             engine.load_checkpoint(<this directory>) as before.
  Megatron:  --adacheck --load <this directory> (or --adacheck-dir).
To get native files instead:
  adacheck convert <this directory> OUT --to deepspeed            (or --to deepspeed-universal)
  adacheck convert <this directory> OUT --to torch-dist           (megatron-core)
  adacheck convert <this directory> OUT                           (model.safetensors weights)
See what is here: adacheck ls <this directory>; adacheck inspect <this directory>.
Delete checkpoints with keep_last or adacheck prune, not by hand: later ones may read
files of earlier ones.
"""


def leave_file(save_dir: str, name: str, data: bytes, store: Storage = LOCAL) -> None:
    """A file ``name`` beside the checkpoints of ``save_dir``, written once (an existing one stays)."""
    path = store.join(save_dir, name)
    if not store.exists(path):
        store.make_dirs(save_dir)
        store.write_atomic(path, data, fsync=False)


def leave_readme(save_dir: str, store: Storage = LOCAL) -> None:
    """A README in ``save_dir`` (once) that tells a person or a stock loader's user what the
    directory holds and how to load or convert it."""
    leave_file(save_dir, README, README_TEXT.encode("utf-8"), store)


def _is_shard_or_manifest(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors" + TMP_SUFFIX, MANIFEST_NAME))


class Listing:
    """What garbage collection and retention ask of a save directory: its sub-directories, the
    files in each and their size, time and content tag.  On a storage that lists a whole tree at
    once (:meth:`Storage.files_under`: an object store, where each question is a request) the
    answers come from one listing, taken when this is made: a file written later is not seen
    (so never taken for garbage), and what this process removes is :meth:`drop`-ped from it.
    Elsewhere (POSIX) each question asks the storage as it is asked."""

    def __init__(self, save_dir: str, store: Storage = LOCAL):
        self.save_dir, self.store = save_dir, store
        files = store.files_under(save_dir)
        self.snapshot: Optional[Dict[str, Dict[str, tuple]]] = None    # tag -> {name: (size, mtime, content tag)}
        if files is not None:
            self.snapshot = {}
            for rel, info in files.items():
                parts = rel.split("/")
                if len(parts) >= 2:
                    self.snapshot.setdefault(parts[0], {})["/".join(parts[1:])] = info

    def path(self, tag: str, name: str = "") -> str:
        return self.store.join(self.save_dir, tag, name) if name else self.store.join(self.save_dir, tag)

    def tags(self) -> List[str]:
        """The sub-directories (sorted)."""
        if self.snapshot is not None:
            return sorted(self.snapshot)
        return [t for t in self.store.list(self.save_dir) if self.store.is_dir(self.path(t))]

    def names(self, tag: str) -> List[str]:
        """The entries directly in ``tag`` (sorted; a snapshot's sub-directories as ``deltas``)."""
        if self.snapshot is not None:
            return sorted({n.split("/")[0] for n in self.snapshot.get(tag, {})})
        return self.store.list(self.path(tag))

    def checkpoint_dirs(self):
        """(tag, path) of each sub-directory with AdaCheck files in it."""
        for tag in self.tags():
            if any(_is_shard_or_manifest(f) for f in self.names(tag)):
                yield tag, self.path(tag)

    def has(self, tag: str, name: str) -> bool:
        """Whether ``tag`` holds the file ``name``."""
        if self.snapshot is not None:
            return name in self.snapshot.get(tag, {})
        return self.store.is_file(self.path(tag, name))

    def has_deltas(self, tag: str) -> bool:
        if self.snapshot is not None:
            return any(n.startswith("deltas/") for n in self.snapshot.get(tag, {}))
        return self.store.is_dir(self.path(tag, "deltas"))

    def _info(self, tag: str, name: str) -> tuple:
        if self.snapshot is None or name not in self.snapshot.get(tag, {}):
            raise FileNotFoundError(self.path(tag, name))
        return self.snapshot[tag][name]

    def size(self, tag: str, name: str) -> int:
        return self._info(tag, name)[0] if self.snapshot is not None else self.store.size(self.path(tag, name))

    def mtime(self, tag: str, name: str) -> float:
        """As listed; a file the listing lacks or lists without a time: as the storage says now."""
        if self.snapshot is not None and name in self.snapshot.get(tag, {}):
            t = self.snapshot[tag][name][1]
            if t is not None:
                return t
        return self.store.mtime(self.path(tag, name))

    def content_tag(self, tag: str, name: str) -> Optional[str]:
        """The storage's tag of the file's content as listed (an object store's ETag), or None."""
        if self.snapshot is None or name not in self.snapshot.get(tag, {}):
            return None
        return self.snapshot[tag][name][2]

    def drop(self, tag: str, name: Optional[str] = None) -> None:
        """This process removed ``tag``'s file ``name`` (None: its deltas tree)."""
        if self.snapshot is not None and tag in self.snapshot:
            files = self.snapshot[tag]
            for n in [n for n in files if (n == name if name is not None else n.startswith("deltas/"))]:
                del files[n]


def _checkpoint_dirs(save_dir: str, store: Storage):
    """(name, path) of each sub-directory of ``save_dir`` with AdaCheck files in it."""
    yield from Listing(save_dir, store).checkpoint_dirs()


def list_checkpoints(save_dir: str, store: Storage = LOCAL) -> List[Tuple[str, Optional[Manifest], Optional[AdaCheckError]]]:
    """(tag, manifest or None, problem or None) for every sub-directory with AdaCheck files; the
    problem is a NotFoundError (no manifest: an interrupted save) or a FormatError (a manifest
    that cannot be read)."""
    out = []
    for name, d in _checkpoint_dirs(save_dir, store):
        try:
            out.append((name, read_manifest(d, store), None))
        except (NotFoundError, FormatError) as e:
            out.append((name, None, e))
    return out


def generation_of(ckpt_dir: str, store: Storage = LOCAL) -> int:
    """Generation for a new save into ``ckpt_dir``: past every generation whose files are
    there (committed, torn, or kept because a later checkpoint references them), so a new
    save never writes over an existing shard file.  0 for a fresh directory."""
    names = store.list(ckpt_dir)
    gens = [int(x) for x in re.findall(r"-g(\d+)\.safetensors", " ".join(names))]
    if MANIFEST_NAME in names:      # a new tag's directory: one listing, no more requests
        try:
            gens.append(int(read_manifest(ckpt_dir, store).framework.get("generation", 0)))
        except (NotFoundError, FormatError):
            pass
    return 1 + max(gens) if gens else 0


# what a save uploads into a save directory, relative to it: a tag's shard files, manifest and
# manifest parts, and its online delta files (the uploads a killed save may leave unfinished)
SAVED_FILE = re.compile(r"^" + TAG_RE.pattern.strip("^$") + r"/(?:" + SHARD_PATTERN + "|" + PART_PATTERN + "|"
                        + re.escape(MANIFEST_NAME) + r"|deltas/\d+/rank\d+\.(?:safetensors|json))$")
_SHARD_FILE = re.compile(r"^(" + SHARD_PATTERN + "|" + PART_PATTERN + ")("
                         + re.escape(TMP_SUFFIX) + ")?$")     # a shard file, a manifest's part


class Summary(NamedTuple):
    """What retention, garbage collection and listings ask of a committed checkpoint: the files
    its manifest references, as (tag or None for its own directory, name), its part files, and
    its step."""
    references: frozenset
    parts: tuple
    step: Optional[int]


# manifest.json's digest -> its Summary, parsed once per process: every save collects garbage
# (and applies retention) over every checkpoint of its directory, and a job may keep hundreds
_SUMMARIES: "OrderedDict[str, Summary]" = OrderedDict()
# (manifest path, size, the storage's content tag) -> that digest, where the storage lists one
_SUMMARIES_BY_STATE: "OrderedDict[tuple, str]" = OrderedDict()
_SUMMARIES_KEPT = 4096


def summaries(save_dir: str, store: Storage = LOCAL, listing: Optional[Listing] = None):
    """(tag, :class:`Summary`) of each committed checkpoint in ``save_dir``; (tag, None) for one
    whose manifest cannot be read.  A summary is a function of the manifest's bytes alone (no part
    is read): kept by their digest, so a checkpoint already seen costs a read and a hash, not a
    parse; where the ``listing`` gives the manifest's content tag (an object store's ETag), by
    that tag too, so it costs nothing more."""
    listing = listing if listing is not None else Listing(save_dir, store)
    for tag, d in listing.checkpoint_dirs():
        if listing.snapshot is not None and not listing.has(tag, MANIFEST_NAME):
            continue            # not committed (an interrupted save)
        content = listing.content_tag(tag, MANIFEST_NAME)
        by_state = (store.canonical(listing.path(tag, MANIFEST_NAME)), listing.size(tag, MANIFEST_NAME),
                    content) if content is not None else None
        key = _SUMMARIES_BY_STATE.get(by_state) if by_state is not None else None
        summary = _SUMMARIES.get(key) if key is not None else None
        if summary is None:
            try:
                path, text = manifest_text(d, store)
            except NotFoundError:
                continue            # not committed (an interrupted save)
            except FormatError:
                yield tag, None
                continue
            key = hash_buffer(text.encode("utf-8"))
            summary = _SUMMARIES.get(key)
        if summary is None:
            try:
                m = parse(text, where=path, open_part=PartFiles(store, d))
            except FormatError:
                yield tag, None
                continue
            summary = _SUMMARIES[key] = Summary(frozenset(referenced_files(m)), tuple(part_names(m)), m.step)
            while len(_SUMMARIES) > _SUMMARIES_KEPT:
                _SUMMARIES.popitem(last=False)
        else:
            _SUMMARIES.move_to_end(key)
        if by_state is not None:
            _SUMMARIES_BY_STATE[by_state] = key
            while len(_SUMMARIES_BY_STATE) > _SUMMARIES_KEPT:
                _SUMMARIES_BY_STATE.popitem(last=False)
        yield tag, summary


def _tree_size(store: Storage, path: str) -> int:
    total = 0
    for name in store.list(path):
        p = store.join(path, name)
        total += _tree_size(store, p) if store.is_dir(p) else store.size(p)
    return total


def collect_garbage(save_dir: str, dry_run: bool = False, retired: Tuple[str, ...] = (),
                    store: Storage = LOCAL, only: Optional[Tuple[str, ...]] = None,
                    keep_after: Optional[float] = None, listing: Optional[Listing] = None) -> List[Tuple[str, int]]:
    """Delete shard files (and temporaries) that no committed checkpoint reads.

    That covers earlier generations of a re-saved tag, saves a killed job never committed,
    and files of retired checkpoints once nothing references them.  A directory whose
    manifest cannot be parsed is left alone (for a person to look at); only files named
    like AdaCheck shards are removed, and a directory without manifest that this call
    emptied is removed too.  Call it only when no save into ``save_dir`` is in flight.
    ``dry_run``: delete nothing, as if the checkpoints in ``retired`` had no manifest.
    ``only``: look into these tags' directories alone (others may hold a save in flight).
    ``keep_after``: a file no committed checkpoint reads is removed only if it was last modified
    before this time (the storage's clock: pass the newest manifest's ``mtime``), so that the files of
    a save in flight (another job's, whose lease has not yet been seen; a save that has not
    committed yet) are never taken for leftovers; None: every such file (no save can be in flight).
    The online-delta log of a checkpoint goes with its manifest (``<tag>/deltas/``).
    ``listing``: the directory's :class:`Listing` (default: a new one).
    Returns the files removed (or that would be), as (``<tag>/<file>``, bytes).
    """
    listing = listing if listing is not None else Listing(save_dir, store)
    need: Dict[str, set] = {}
    unreadable = set()
    for tag, summary in summaries(save_dir, store, listing):
        if summary is None:
            unreadable.add(tag)
            continue
        if tag in retired:
            continue
        for ref_tag, name in summary.references:
            need.setdefault(ref_tag or tag, set()).add(name)
        need.setdefault(tag, set()).update(summary.parts)
    removed = []
    for tag in listing.tags():
        d = store.join(save_dir, tag)
        if tag in unreadable or (only is not None and tag not in only):
            continue
        before = len(removed)
        committed = listing.has(tag, MANIFEST_NAME) and tag not in retired
        if not committed and listing.has_deltas(tag):
            # the online deltas of a retired (or never committed) base: nothing replays them
            deltas = store.join(d, "deltas")
            size = _tree_size(store, deltas)
            if not dry_run:
                store.remove_tree(deltas)
                listing.drop(tag)
            removed.append((f"{tag}/deltas/", size))
        for f in listing.names(tag):
            if _SHARD_FILE.match(f) and f not in need.get(tag, ()):
                try:
                    if keep_after is not None and listing.mtime(tag, f) >= keep_after:
                        continue        # newer than the newest commit: a save in flight, perhaps another job's
                    size = listing.size(tag, f)
                    if not dry_run:
                        store.remove(store.join(d, f))
                        listing.drop(tag, f)
                    removed.append((f"{tag}/{f}", size))
                except FileNotFoundError:
                    pass
        if not dry_run and len(removed) > before and not listing.has(tag, MANIFEST_NAME):
            store.remove_dir(d)      # referenced files or something else may live there: then kept
    return removed


def newest_commit_time(save_dir: str, store: Storage = LOCAL, listing: Optional[Listing] = None) -> Optional[float]:
    """The modification time of the newest committed manifest in ``save_dir`` (the storage's clock;
    None: none is committed): garbage collection's ``keep_after`` beside a live job."""
    listing = listing if listing is not None else Listing(save_dir, store)
    times = [listing.mtime(tag, MANIFEST_NAME) for tag, summary in summaries(save_dir, store, listing)
             if summary is not None]
    return max(times) if times else None


def choose_retired(save_dir: str, keep_last: Optional[int] = None, older_than_s: Optional[float] = None,
                   protect: Tuple[str, ...] = (), now: Optional[float] = None, store: Storage = LOCAL,
                   listing: Optional[Listing] = None) -> List[str]:
    """Committed checkpoints a retention policy removes: those beyond the newest
    ``keep_last`` (by step, then manifest time) and/or older than ``older_than_s`` seconds;
    never one in ``protect``, never the newest."""
    listing = listing if listing is not None else Listing(save_dir, store)
    committed = []
    for tag, summary in summaries(save_dir, store, listing):
        if summary is None:
            continue
        mtime = listing.mtime(tag, MANIFEST_NAME)
        committed.append(((summary.step if summary.step is not None else -1), mtime, tag))
    committed.sort(reverse=True)
    now = time.time() if now is None else now
    out = []
    for i, (_, mtime, tag) in enumerate(committed):
        if i == 0 or tag in protect:
            continue
        if (keep_last is not None and i >= keep_last) or (older_than_s is not None and now - mtime > older_than_s):
            out.append(tag)
    return out


def retire(save_dir: str, tags, store: Storage = LOCAL, listing: Optional[Listing] = None) -> None:
    """Remove the manifests of ``tags`` (they stop being checkpoints); collect_garbage then
    deletes whatever of their files no kept checkpoint references."""
    for tag in tags:
        store.remove(store.join(save_dir, tag, MANIFEST_NAME))
        if listing is not None:
            listing.drop(tag, MANIFEST_NAME)
        store.remove_dir(store.join(save_dir, tag))   # a checkpoint that only referenced others


def tidy_after(save_dir: str, tag: str, keep_last: Optional[int], store: Storage = LOCAL,
               only_touched: bool = False) -> List[str]:
    """Once ``tag`` is committed in ``save_dir`` (and ``latest`` written): retention (the newest
    ``keep_last``, 0: all; never ``tag`` or the one ``latest`` names), then garbage collection,
    from one :class:`Listing`; a file modified since ``tag``'s manifest may be another save's in
    flight: kept.  ``only_touched``: collect in ``tag``'s directory and the retired ones alone
    (another writer may be filling a directory that has no manifest yet).  Returns the retired tags."""
    listing = Listing(save_dir, store)
    retired: List[str] = []
    if keep_last:
        latest = read_latest(save_dir, store)
        retired = apply_retention(save_dir, keep_last, protect=(tag,) + ((latest,) if latest else ()), store=store,
                                  listing=listing)
    collect_garbage(save_dir, store=store, only=(tag, *retired) if only_touched else None,
                    keep_after=listing.mtime(tag, MANIFEST_NAME), listing=listing)
    return retired


def apply_retention(save_dir: str, keep_last: int, protect: Tuple[str, ...], store: Storage = LOCAL,
                    listing: Optional[Listing] = None) -> List[str]:
    """Retire committed checkpoints beyond the newest ``keep_last``; never one in ``protect``.
    Returns the retired tags (their unreferenced files go with the next collect_garbage, which
    may be given the same ``listing``)."""
    doomed = choose_retired(save_dir, keep_last=keep_last, protect=protect, store=store, listing=listing)
    retire(save_dir, doomed, store, listing)
    return doomed
