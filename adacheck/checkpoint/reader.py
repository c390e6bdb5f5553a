"""Reading a committed checkpoint: :class:`CheckpointReader` (the boxes a rank asks for, each
verified against its hash; derived tensors rebuilt from their sources), finding the checkpoint
to load (:func:`resolve`) or the newest intact one (:func:`find_intact`, verified by all ranks
together), and confirming a new checkpoint's files before its manifest names them
(:func:`confirm_files`)."""
from __future__ import annotations

import math
import warnings
from collections import OrderedDict, deque
from functools import partial
from collections.abc import Mapping
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from ..storage import commit
from ..storage import manifest_files
from ..format import jsontree
from ..format.boxes import copy_intersection, flat_range_to_boxes
from ..errors import AdaCheckError, FormatError, IntegrityError, NotFoundError, StateError
from ..plan.exchange import Comm, agree
from ..format.hashing import bound_digest, box_identity, hash_buffer, hash_threads, in_background, tensor_bytes
from ..format.compression import ENCODING_KEY, decode
from ..format.manifest import BOUND_SINCE, RANK_OBJECT, meta_entry, split_file
from ..format.manifest_read import PartedTensors
from ..format.safetensors_file import SafetensorsFile
from ..types import Box, Manifest, TensorEntry, dtype_name, torch_dtype
from ..storage.backends import LOCAL, Storage


class LegacyFormatWarning(UserWarning):
    """A checkpoint of an older format was opened: it loads, with less protection."""


def confirm_files(store: Storage, ckpt_dir: str, files: Dict[str, dict]) -> None:
    """Before the manifest names them: every file of the new checkpoint is on the storage with the
    size its writer committed (an object store's upload completed, a shared filesystem's rename
    visible here) and, where the storage tags content (an object store's ETag), the tag its writer
    saw once its upload completed: the object is the one that rank wrote, not one written again
    under its name since.  Their contents are checked by hash whenever they are read."""
    for fname, info in sorted(files.items()):
        path = store.join(ckpt_dir, fname)
        state = store.file_state(path)
        if state is None:
            raise IntegrityError(f"{path} was committed by rank {info['writer']} but is not on the storage; "
                                 "the checkpoint is not published")
        size, tag = state
        if size != info["nbytes"]:
            raise IntegrityError(f"{path} holds {size} bytes on the storage, but rank {info['writer']} wrote "
                                 f"{info['nbytes']}; the checkpoint is not published")
        if info.get("tag") is not None and tag != info["tag"]:
            raise IntegrityError(
                f"{path} on the storage is not the object rank {info['writer']} wrote: its content tag was "
                f"{info['tag']} when that rank's upload completed and is {tag} now, so something wrote it again "
                "since (another job saving the same tag into this directory?); the checkpoint is not published")


def resolve(load_dir: str, tag: Optional[str] = None, store: Storage = LOCAL) -> str:
    """The checkpoint directory to load: ``tag`` if given, else the one ``latest`` names."""
    if tag is None:
        if manifest_files.has_manifest(load_dir, store):
            return load_dir   # pointed straight at a checkpoint directory
        if not store.is_dir(load_dir):
            raise NotFoundError(f"no AdaCheck checkpoint to load in {load_dir}: there is no such directory")
        tag = commit.read_latest(load_dir, store)
        if tag is None:
            present = _committed_tags(load_dir, store)
            raise NotFoundError(
                f"no AdaCheck checkpoint to load in {load_dir}: there is no 'latest' file"
                + (f"; complete checkpoints present: {present} (pass one as tag)" if present else ""))
        return store.join(load_dir, commit.check_tag(tag))
    d = store.join(load_dir, commit.check_tag(str(tag)))
    if not store.is_dir(d):
        present = _committed_tags(load_dir, store)
        raise NotFoundError(f"there is no checkpoint {tag!r} in {load_dir}"
                            + (f"; complete checkpoints present: {present}" if present else
                               " (and no complete checkpoint at all)"))
    return d


def _committed_tags(load_dir: str, store: Storage = LOCAL) -> List[str]:
    """Tags of the complete checkpoints in ``load_dir``, newest first (by step, then manifest time)."""
    found = []
    for t, m, _ in commit.list_checkpoints(load_dir, store):
        if m is not None:
            mtime = store.mtime(store.join(load_dir, t, commit.MANIFEST_NAME))
            found.append((m.step if m.step is not None else -1, mtime, t))
    return [t for _, _, t in sorted(found, reverse=True)]


def verify_part(reader: "CheckpointReader", part: int = 0, parts: int = 1,
                progress: Optional[Callable[[int], None]] = None) -> int:
    """Read and verify every stored box of the checkpoint's files that fall to ``part`` of
    ``parts`` (files in sorted order, every ``parts``-th), so ``parts`` ranks check a whole
    checkpoint once between them.  Raises on the first damage; returns the bytes checked.
    ``progress(bytes)``: the bytes checked so far, after each box."""
    by_file: Dict[str, list] = {}
    for name, e in reader.manifest.tensors.items():
        for sb in e.boxes:
            by_file.setdefault(sb.file, []).append((name, sb))
    checked = 0
    for i, fname in enumerate(sorted(by_file)):
        if i % parts != part:
            continue
        for name, sb in by_file[fname]:
            t = reader.stored(name, sb)
            checked += t.numel() * t.element_size()
            if progress is not None:
                progress(checked)
        reader.drop_cache()
    if reader.verify:     # derived tensors: each recorded box derived and checked (spread likewise)
        derived = [(name, e, b, h) for name, e in sorted(reader.manifest.tensors.items()) if e.derived is not None
                   for b, h in e.derived.boxes]
        for i, (name, e, b, h) in enumerate(derived):
            if i % parts == part:
                checked += reader.derived_box(name, e, b, h).numel() * torch.empty((), dtype=torch_dtype(e.dtype)).element_size()
                reader.drop_cache()
    return checked


def find_intact(comm: Comm, load_dir: str, exclude=(), store: Storage = LOCAL) -> Optional[Tuple[str, Manifest]]:
    """The newest complete checkpoint of ``load_dir`` (not one in ``exclude``) whose every stored
    box verifies, checked by all ranks together (collective; every rank gets the same answer)."""
    candidates = comm.broadcast_object([t for t in _committed_tags(load_dir, store) if t not in exclude]
                                       if comm.rank == 0 else None)
    for t in candidates:
        d = store.join(load_dir, t)

        def check(d=d):
            manifest = manifest_files.read_manifest(d, store)
            verify_part(CheckpointReader(d, manifest, verify=True, cache_bytes=0, store=store), comm.rank,
                        comm.world_size)
            return manifest
        try:
            return t, agree(comm, f"AdaCheck: verifying {d}", check)
        except AdaCheckError:
            continue
    return None


class RankObjectLookup(Mapping):
    """Values the saving ranks kept in their own objects, by key, read when first asked for
    (``pick(rank objects, where) -> {key: value}``, decoded by the reader): a key is looked for in
    the objects of the saving ranks ``candidates``, in order, and only then in every saving rank's."""

    def __init__(self, reader: "CheckpointReader", candidates: Tuple[int, ...],
                 pick: Callable[[dict, str], dict]):
        self.reader, self.pick, self.found, self.added = reader, pick, {}, set()
        self.ranks = len(reader.manifest.rank_objects)
        self.candidates = [r for r in dict.fromkeys(candidates) if 0 <= r < self.ranks]

    def _add(self, rank: int) -> None:
        if rank not in self.added:
            saved = self.pick(self.reader.manifest.rank_objects[rank], f"rank {rank}'s objects of {self.reader.dir}")
            self.found.update(self.reader.decode(saved))
            self.added.add(rank)

    def _look(self, key) -> bool:
        for rank in [*self.candidates, *range(self.ranks)]:
            if key in self.found:
                return True
            self._add(rank)
        return key in self.found

    def __getitem__(self, key: str):
        if not self._look(key):
            raise KeyError(key)
        return self.found[key]

    def __contains__(self, key) -> bool:
        return self._look(key)

    def __iter__(self):
        for rank in range(self.ranks):
            self._add(rank)
        return iter(self.found)

    def __len__(self) -> int:
        return len(list(iter(self)))


class BoxCache:
    """Verified boxes kept for reuse, at most ``limit`` bytes of them (the least recently used go
    first, but never the newest).  A key names the identity its bytes were verified for."""

    def __init__(self, limit: int):
        self.items: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self.bytes, self.limit = 0, limit

    def __contains__(self, key: tuple) -> bool:
        return key in self.items

    def get(self, key: tuple) -> Optional[torch.Tensor]:
        t = self.items.get(key)
        if t is not None:
            self.items.move_to_end(key)
        return t

    def put(self, key: tuple, t: torch.Tensor) -> None:
        self.items[key] = t
        self.bytes += t.numel() * t.element_size()
        while self.bytes > self.limit and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self.items.clear()
        self.bytes = 0


def file_path(store: Storage, ckpt_dir: str, fname: str) -> str:
    """Where the manifest file entry ``fname`` of checkpoint ``ckpt_dir`` lives on ``store``: there,
    or in an earlier sibling checkpoint."""
    tag, name = split_file(fname)
    if tag is None:
        return store.join(ckpt_dir, name)
    return store.join(store.parent(ckpt_dir), tag, name)


class CopyOrder:
    """Per stored region, the copies to try in order: all of one variant (the one ``prefer_rank``
    held, else the lowest holder's), its own file first; with ``prefer_present`` (a memory-tier
    checkpoint across nodes, where a node's directory holds some copies of each region), copies
    whose file is here before the others (the checkpoint ``ckpt_dir`` on ``store``)."""

    def __init__(self, store: Storage, ckpt_dir: str, prefer_rank: Optional[int], prefer_present: bool):
        self.store, self.dir, self.prefer_rank = store, ckpt_dir, prefer_rank
        self.present: Optional[Dict[str, bool]] = {} if prefer_present else None

    def __call__(self, boxes) -> List[list]:
        by_region: Dict[Box, list] = {}
        for sb in boxes:
            by_region.setdefault(sb.box, []).append(sb)
        out = []
        for region, cands in by_region.items():
            if self.present is not None:
                cands = sorted(cands, key=lambda c: not self.here(c.file))
            pick = cands[0]
            if self.prefer_rank is not None:
                pick = next((c for c in cands if self.prefer_rank in c.holders), pick)
            same = [c for c in cands if c.hash == pick.hash]
            out.append(sorted(same, key=lambda c: (c.file != pick.file, c.file)))
        return out

    def here(self, fname: str) -> bool:
        if fname not in self.present:
            self.present[fname] = self.store.size_if_file(file_path(self.store, self.dir, fname)) is not None
        return self.present[fname]


def first_verified(stored: Callable[..., torch.Tensor], name: str, copies, out: Optional[torch.Tensor] = None,
                   ) -> torch.Tensor:
    """The first of ``copies`` (stored copies of one region of ``name``) that ``stored`` reads and
    verifies, with a warning naming the damaged ones before it; an error naming each otherwise."""
    errors = []
    for sb in copies:
        try:
            t = stored(name, sb, out=out)
        except (IntegrityError, FormatError, OSError) as e:
            errors.append(e)
            continue
        if errors:
            warnings.warn(f"AdaCheck: read {name} box {sb.box.key()} from its copy in {sb.file}; "
                          f"the first copy is damaged: {errors[0]}", stacklevel=3)
        return t
    if len(errors) == 1:
        raise errors[0]
    raise IntegrityError(f"{name} box {copies[0].box.key()}: all {len(copies)} stored copies "
                         "are unreadable: " + "; ".join(str(e) for e in errors))


class Pieces:
    """A flat tensor of ``numel`` elements of ``dtype`` still in pieces: each a box of it (at flat
    position ``pos``, of shape ``lengths``) or a region of one (``index``: slices of the box),
    and its verified source (:meth:`CheckpointReader.pieces`).  Elements no piece covers are
    zero (alignment padding).  The sources may be views of mapped files: keep only what
    :meth:`copy_into` or :meth:`tensor` gives, never a source."""

    def __init__(self, numel: int, dtype: torch.dtype, shape: Optional[tuple] = None):
        self.numel, self.dtype = numel, dtype
        self.shape = tuple(shape) if shape is not None else (numel,)      # what tensor() gives
        self.parts: List[Tuple[int, tuple, tuple, torch.Tensor]] = []

    def add(self, pos: int, lengths, index: tuple, src: torch.Tensor) -> None:
        self.parts.append((pos, tuple(lengths), index, src))

    def place(self, offset: int, other: "Pieces") -> None:
        """``other``'s pieces, at element ``offset`` of this one."""
        for pos, lengths, index, src in other.parts:
            self.parts.append((offset + pos, lengths, index, src))

    def copy_into(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``numel`` elements, any dtype and device) filled: the pieces copied (cast as
        needed), the rest zero."""
        if out.numel() != self.numel:
            raise ValueError(f"a tensor of {self.numel} elements is needed, got {list(out.shape)}")
        if not out.is_contiguous():
            return out.copy_(self.tensor().view(out.shape))
        flat = out.view(-1)
        covered = sorted({(pos, pos + math.prod(lengths)) for pos, lengths, _, _ in self.parts})
        at = 0
        for a, b in covered + [(self.numel, self.numel)]:
            if a > at:
                flat.narrow(0, at, a - at).zero_()
            at = max(at, b)
        for pos, lengths, index, src in self.parts:
            flat.narrow(0, pos, math.prod(lengths)).view(lengths)[index].copy_(src)
        return out

    def tensor(self, dtype: Optional[torch.dtype] = None, device=None) -> torch.Tensor:
        """A new tensor of these elements, of ``shape`` (of ``dtype``, on ``device``: default
        this one's, the CPU)."""
        return self.copy_into(torch.empty(self.numel, dtype=dtype or self.dtype, device=device)).view(self.shape)


T = TypeVar("T")


class HashesBehind:
    """The hashes of the boxes read inside :meth:`CheckpointReader.stage`, computed on the hashing
    threads.  At most ``LIMIT`` bytes of boxes wait for theirs (a box waiting is kept in memory,
    also one the reader's cache has dropped): past it, the oldest are awaited."""
    LIMIT = 512 << 20

    def __init__(self):
        self.waiting: deque = deque()
        self.bytes = 0
        self.ok = True

    def add(self, digest, want: str, nbytes: int) -> None:
        self.waiting.append((digest, want, nbytes))
        self.bytes += nbytes
        while self.bytes > self.LIMIT and len(self.waiting) > 1:
            self._settle_one()

    def _settle_one(self) -> None:
        digest, want, nbytes = self.waiting.popleft()
        self.bytes -= nbytes
        try:
            self.ok = digest.result() == want and self.ok
        except Exception:        # a hash that could not be computed proves nothing: read again
            self.ok = False

    def all_match(self) -> bool:
        """Whether every box's bytes had the hash recorded for it (waits for every hash)."""
        while self.waiting:
            self._settle_one()
        return self.ok

    @classmethod
    def stage(cls, reader: "CheckpointReader", fn: Callable[["CheckpointReader"], "T"]) -> "T":
        """``fn(reader)`` with each box's hash computed on the hashing threads while the next box
        is read, every one compared before this returns.  Where one does not match (or ``fn``
        failed while some were unchecked), ``fn`` runs again, each box verified as it is read: the
        damaged copy is then named, or another copy read, as by a plain read.  ``fn`` must change
        nothing but what it returns (``Restore.read``: staging)."""
        reader._behind, failure, staged = cls(), None, None
        try:
            staged = fn(reader)
        except Exception as e:         # perhaps a consequence of bytes not yet found damaged
            failure = e
        finally:
            behind, reader._behind = reader._behind, None
        if behind.all_match():
            if failure is not None:
                raise failure
            return staged
        reader.drop_cache()
        return fn(reader)


class CheckpointReader:
    """Reads boxes of logical tensors from a committed checkpoint, verifying hashes.

    ``read(name, box)`` assembles the box from whatever stored boxes intersect it, so
    the reader serves any target layout.  Derived tensors are rebuilt from their source.
    Stored boxes are read whole, verified once, and kept in a bounded LRU cache.  With
    ``prefer_rank`` and a manifest with rank files (a partitioned save), a box that rank held
    is found in its rank file, without reading the part of the manifest that lists its tensor.
    """

    def __init__(self, ckpt_dir: str, manifest: Optional[Manifest] = None, verify: bool = True,
                 prefer_rank: Optional[int] = None, cache_bytes: int = 1 << 30, store: Storage = LOCAL,
                 prefer_present: bool = False):
        self.dir, self.store = ckpt_dir, store
        self.manifest = manifest if manifest is not None else manifest_files.read_manifest(ckpt_dir, store)
        self.verify = verify
        self.bound = self.manifest.format_version >= BOUND_SINCE
        if not self.bound:
            warnings.warn(f"AdaCheck: {ckpt_dir} was written in format {self.manifest.format_version}, whose "
                          "hashes cover each box's bytes but not what the box claims to be (tensor, offsets, "
                          "dtype) and whose manifest has no checksum: an edited manifest could load wrong "
                          "data unnoticed. Save it again with this version to bind them.",
                          LegacyFormatWarning, stacklevel=2)
        self.prefer_rank = prefer_rank
        # (no bound method of the reader kept by what it holds: a reference cycle would keep its
        # mapped files until the garbage collector runs, and a load pauses it)
        self._copies = CopyOrder(store, ckpt_dir, prefer_rank, prefer_present)
        self._files: Dict[str, SafetensorsFile] = {}
        # (file, key, tensor, box) -> verified bytes: one entry serves only the identity it was verified for
        self._cache = BoxCache(cache_bytes)
        self._views: Dict[tuple, torch.Tensor] = {}      # the same, for boxes read as views of mapped files
        self.bytes_read = 0
        self._scratch_buf = torch.empty(0, dtype=torch.uint8)
        self._held: Optional[Dict[str, TensorEntry]] = None
        self._behind: Optional[HashesBehind] = None      # inside stage()

    def stage(self, fn: Callable[["CheckpointReader"], "T"]) -> "T":
        """``fn(self)`` (a load's staging), its reads verified behind them where this rank hashes
        on threads of its own (:class:`HashesBehind`), else each as it is read: what it returns
        comes from verified bytes only."""
        behind = self.verify and self._behind is None and hash_threads() > 1
        return HashesBehind.stage(self, fn) if behind else fn(self)

    def framework(self, name: str, label: str, hint: str) -> dict:
        """The manifest's framework record, when ``name`` saved the checkpoint (a StateError that
        names the saving one, ``label`` and ``hint`` else)."""
        saved_by = self.manifest.framework.get("name")
        if saved_by != name:
            raise StateError(f"{self.dir} was saved by {saved_by!r}, not {label}; {hint}")
        return self.manifest.framework

    def held(self) -> Dict[str, TensorEntry]:
        """The entries of the boxes ``prefer_rank`` held when the checkpoint was saved, cut down
        to them (its rank file, read once); empty without one."""
        if self._held is None:
            ranks, rank = self.manifest.ranks, self.prefer_rank
            self._held = ranks.get(rank).tensors if ranks is not None and rank is not None and rank < ranks.count else {}
        return self._held

    def _entry_for(self, name: str, box: Optional[Box]):
        """The entry to read ``box`` (default: all) of ``name`` from: the held one when its boxes
        cover ``box``, else the whole tensor's, or (a manifest in parts) its boxes that meet ``box``
        (format 6 reads only the pages of its part that list them)."""
        e = self.held().get(name)
        if e is not None:
            want = box if box is not None else Box.full(e.shape)
            regions = {b for b, _ in e.derived.boxes} if e.derived is not None else {sb.box for sb in e.boxes}
            if want.fits(e.shape) and sum(x.numel for x in (want.intersect(b) for b in regions)
                                          if x is not None) == want.numel:
                return e
        if box is not None and isinstance(self.manifest.tensors, PartedTensors):
            try:
                return self.manifest.tensors.region(name, box)
            except KeyError:
                pass        # its part does not list it: reported as the whole read reports it
        return self.entry(name, whole=True)

    def has(self, name: str) -> bool:
        if name in self.held():
            return True
        meta = self._meta()
        if meta is not None and not RANK_OBJECT.match(name):    # format 5: every other tensor is listed there
            return name in meta
        return name in self.manifest.tensors

    def is_cast_of(self, name: str, source: str, dtype: torch.dtype) -> bool:
        """``name`` is stored as the proven cast of ``source`` to ``dtype`` (a derivation): a framework
        that casts ``source`` once it is loaded gives back every saved bit of ``name``, so a load
        that leaves it to the framework need not read it."""
        if not self.has(name):
            return False
        e = self.entry(name)
        return e.derived is not None and e.derived.source == source and e.dtype == dtype_name(dtype)

    def names(self) -> List[str]:
        """The names of the checkpoint's tensors, each rank's own objects left out (format 5: from its
        index, no part read)."""
        meta = self._meta()
        if meta is not None:
            return sorted(meta)
        return sorted(n for n in self.manifest.tensors if not RANK_OBJECT.match(n))

    def _meta(self) -> Optional[Dict[str, list]]:
        """Format 5: what the meta file says of each tensor (kind, dtype, shape, derivation)."""
        tensors = self.manifest.tensors
        return tensors.meta() if isinstance(tensors, PartedTensors) else None

    def drop_cache(self) -> None:
        """Forget the verified boxes kept so far (their memory goes)."""
        self._cache.clear()
        self._views.clear()

    def entry(self, name: str, whole: bool = False):
        """Tensor ``name``'s entry: its kind, dtype, shape and derivation; its boxes are the whole
        tensor's with ``whole``, else perhaps only those ``prefer_rank`` held."""
        if not whole and name in self.held():
            return self._held[name]
        meta = self._meta() if not whole else None
        if meta is not None and name in meta:
            return meta_entry(name, meta[name])
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise StateError(f"{self.dir}: the checkpoint has no tensor {name!r}; is it a checkpoint of "
                             "this model?") from None

    def path_of(self, fname: str) -> str:
        """Where a manifest file entry lives: here, or in an earlier sibling checkpoint."""
        return file_path(self.store, self.dir, fname)

    def _file(self, fname: str) -> SafetensorsFile:
        if fname not in self._files:
            self._files[fname] = SafetensorsFile(self.path_of(fname), self.store)
        return self._files[fname]

    def stored(self, name: str, sb, out: Optional[torch.Tensor] = None, behind: bool = True,
               mapped: bool = False) -> torch.Tensor:
        """Stored box ``sb`` of ``name``, verified (inside :meth:`stage` and with ``behind``: on a
        helper thread, its bytes left untouched until stage() returns); read straight into ``out``
        when given (contiguous, the stored dtype and shape), else kept in the cache; ``mapped``
        (and no ``out``): a view of its file mapped into memory where the storage maps it."""
        ck = (sb.file, sb.key, name, sb.box)
        kept = self._views.get(ck) if mapped and out is None else None
        if kept is None:
            kept = self._cache.get(ck)
        if kept is not None:
            return kept if out is None else out.copy_(kept)
        e = self.entry(name)
        f = self._file(sb.file)
        mapped_now = False
        if sb.key not in f.entries:
            raise FormatError(f"{f.path}: lacks tensor {sb.key!r} that the manifest places there")
        dname, shape, _, _ = f.entries[sb.key]
        encoding = f.metadata.get(ENCODING_KEY)
        if encoding is not None:      # compressed: the file holds the box's encoded bytes
            if dname != "uint8" or len(shape) != 1:
                raise FormatError(f"{f.path}: {sb.key!r} is {dname}{list(shape)} in a file of encoded boxes")
            raw = f.read(sb.key)
            self.bytes_read += raw.numel()
            t = decode(encoding, raw, torch_dtype(e.dtype), tuple(sb.box.lengths), f"{f.path}: {sb.key!r}")
            if out is not None:
                t = out.copy_(t)
        else:
            if dname != e.dtype or shape != tuple(sb.box.lengths):
                raise FormatError(f"{f.path}: {sb.key!r} is {dname}{list(shape)} in the file but the "
                                  f"manifest says {e.dtype}{list(sb.box.lengths)}")
            t = f.view(sb.key) if mapped and out is None else None
            if t is None:
                t = f.read(sb.key, out)
            else:
                mapped_now = True
            self.bytes_read += t.numel() * t.element_size()
        if self.verify:
            # bound_digest / hash_tensor of t (a contiguous CPU tensor); behind: only the hash
            # itself on the thread, which holds the GIL for no Python of its own
            ident = box_identity(name, e.dtype, e.shape, sb.box.offsets, sb.box.lengths) if self.bound else b""
            if behind and self._behind is not None:       # (compared when stage() ends)
                self._behind.add(in_background(hash_buffer, tensor_bytes(t), ident), sb.hash, t.numel() * t.element_size())
            elif (got := hash_buffer(tensor_bytes(t), ident)) != sb.hash:
                raise IntegrityError(f"{name} (box {sb.box.key()}) in {f.path}: stored bytes hash to "
                                     f"{got} but the manifest recorded {sb.hash}"
                                     + (" for this tensor, box and dtype" if self.bound else "")
                                     + "; the file is corrupt (bit flip or partial write)"
                                     + (" or the manifest was edited" if self.bound else "")
                                     + ". Restore it or load an older checkpoint.")
        if mapped_now:
            self._views[ck] = t             # (no memory of its own: the file's pages)
        elif out is None:
            self._cache.put(ck, t)
        return t

    def derived_box(self, name: str, e, dbox: Box, digest: str) -> torch.Tensor:
        """Box ``dbox`` of the derived tensor ``name``: its source's elements cast as saved, checked
        against the digest its holders recorded (kept in the cache)."""
        ck = ("derived", name, dbox)
        kept = self._cache.get(ck)
        if kept is not None:
            return kept
        t = self.read(e.derived.source, dbox).to(torch_dtype(e.dtype))
        got = bound_digest(box_identity(name, e.dtype, e.shape, dbox.offsets, dbox.lengths), t)
        if got != digest:
            raise IntegrityError(f"{name} (box {dbox.key()}), derived from {e.derived.source}: the derived bytes hash "
                                 f"to {got} but its holders recorded {digest} when they saved it; the manifest was "
                                 "edited (its derivation or source) or the source is not what was saved")
        self._cache.put(ck, t)
        return t

    def _scratch(self, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer for ``box`` of ``dtype`` (fresh memory costs page faults per read)."""
        nbytes = box.numel * torch.empty((), dtype=dtype).element_size()
        if self._scratch_buf.numel() < nbytes:
            self._scratch_buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch_buf[:nbytes].view(dtype).view(box.lengths)

    def read(self, name: str, box: Optional[Box] = None, dtype: Optional[torch.dtype] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The elements of ``box`` (default: all) of logical tensor ``name``, each stored box they
        come from verified against its hash (``verify``), a derived tensor rebuilt from its source.

        Args:
            name: the logical tensor's name, as saved.
            box: the region to read (default: the whole tensor); it must fit the saved shape.
            dtype: the dtype of a new tensor (default: the saved one); ignored with ``out``.
            out: a tensor of the box's shape to write into, cast to its dtype, without an
                intermediate copy.

        Returns:
            ``out``, or a new tensor of the box's shape.

        Raises:
            FormatError: an unknown name, or a box outside the shape.
            IntegrityError: stored bytes that do not match their hash.
        """
        e = self._entry_for(name, box)
        box = box if box is not None else Box.full(e.shape)
        if not box.fits(e.shape):
            raise FormatError(f"{name}: asked for box {box} outside its shape {list(e.shape)}")
        if out is None:
            out = torch.empty(box.lengths, dtype=dtype or torch_dtype(e.dtype))
        elif tuple(out.shape) != tuple(box.lengths):
            raise ValueError(f"{name}: out has shape {list(out.shape)}, box {box} needs {list(box.lengths)}")
        if e.derived is not None:
            if self.verify and e.derived.boxes:
                # derived box by derived box, each verified against its holders' digest
                filled = sum(copy_intersection(out, box, self.derived_box(name, e, dbox, digest), dbox)
                             for dbox, digest in e.derived.boxes if box.intersect(dbox) is not None)
                if filled != box.numel:
                    raise FormatError(f"{name}: derived boxes cover {filled} of the {box.numel} elements asked for")
            elif out.dtype == torch_dtype(e.dtype):
                self.read(e.derived.source, box, out=out)
            else:   # derive exactly as saved (cast to the stored dtype), then cast to out's
                out.copy_(self.read(e.derived.source, box).to(torch_dtype(e.dtype)))
            return out
        filled = 0
        direct = out.is_contiguous() and out.dtype == torch_dtype(e.dtype)
        for copies in self._copies(e.boxes):
            sb = copies[0]
            if sb.box == box and not any((c.file, c.key, name, c.box) in self._cache for c in copies):
                # the whole request is one stored box: read it straight into out, or into a
                # reused scratch buffer when out has another dtype (a cast) or layout (verified
                # before the next read reuses it)
                if direct:
                    first_verified(self.stored, name, copies, out=out)
                else:
                    scratch = self._scratch(box, torch_dtype(e.dtype))
                    first_verified(partial(self.stored, behind=False), name, copies, out=scratch)
                    out.copy_(scratch)
                filled += box.numel
            elif box.intersect(sb.box) is not None:
                filled += copy_intersection(out, box, first_verified(self.stored, name, copies), sb.box)
        if filled != box.numel:
            raise FormatError(f"{name}: stored boxes cover {filled} of the {box.numel} elements "
                              f"asked for (box {box})")
        return out

    def read_flat(self, name: str, start: int, stop: int, dtype: Optional[torch.dtype] = None,
                  out: Optional[torch.Tensor] = None, within: Optional[Box] = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the row-major flattened tensor, or of its box ``within``
        (e.g. one tensor-parallel rank's slice) flattened on its own: a ZeRO partition's range.

        Args:
            name: the logical tensor's name.
            start, stop: the range of flat element indices.
            dtype: the dtype of a new tensor (default: the saved one).
            out: a 1-D tensor of ``stop - start`` elements to write into.
            within: the box whose own flattening the range indexes (default: the whole tensor).

        Returns:
            ``out``, or a new 1-D tensor.
        """
        e = self.entry(name)
        if out is None:
            out = torch.empty(stop - start, dtype=dtype or torch_dtype(e.dtype))
        elif out.numel() != stop - start or out.dim() != 1:
            raise ValueError(f"{name}: out must be 1-D with {stop - start} elements")
        region = within if within is not None else Box.full(e.shape)
        pos = 0
        for b in flat_range_to_boxes(region.lengths, start, stop):
            self.read(name, b.shifted(region.offsets), out=out.narrow(0, pos, b.numel).view(b.lengths))
            pos += b.numel
        return out

    def pieces(self, name: str, start: int, stop: int, dtype: Optional[torch.dtype] = None,
               within: Optional[Box] = None) -> "Pieces":
        """What :meth:`read_flat` would return, not yet copied anywhere: each stored box it meets
        verified and held as a view of its file mapped into memory (where the storage maps it and
        the box is stored as it is: not derived, not compressed; else read as by :meth:`read`).
        Copying them into the tensor that keeps them (:meth:`Pieces.copy_into`) is the only copy:
        a load that stages this way writes nothing into fresh memory."""
        e = self.entry(name)
        region = within if within is not None else Box.full(e.shape)
        out = Pieces(stop - start, dtype or torch_dtype(e.dtype))
        pos = 0
        for b in flat_range_to_boxes(region.lengths, start, stop):
            box = b.shifted(region.offsets)
            for index, src in self._box_views(name, box):
                out.add(pos, b.lengths, index, src)
            pos += b.numel
        return out

    def _box_views(self, name: str, box: Box) -> List[Tuple[tuple, torch.Tensor]]:
        """(the region of ``box`` as slices of it, the verified source of that region) covering ``box``."""
        e = self._entry_for(name, box)
        if not box.fits(e.shape):
            raise FormatError(f"{name}: asked for box {box} outside its shape {list(e.shape)}")
        if e.derived is not None:
            return [(tuple(slice(None) for _ in box.lengths), self.read(name, box))]
        views, filled = [], 0
        for copies in self._copies(e.boxes):
            inter = box.intersect(copies[0].box)
            if inter is not None:
                src = first_verified(partial(self.stored, mapped=True), name, copies)
                views.append((inter.slices(box), src[inter.slices(copies[0].box)]))
                filled += inter.numel
        if filled != box.numel:
            raise FormatError(f"{name}: stored boxes cover {filled} of the {box.numel} elements "
                              f"asked for (box {box})")
        return views

    def objects(self, rank: Optional[int] = None):
        """The job's saved objects, or saving rank ``rank``'s, with their tensors read."""
        return self.decode(self.manifest.objects if rank is None else self.manifest.rank_objects[rank])

    def decode(self, tree):
        """A saved object tree (or part of one) with its tensors read."""
        for ref in jsontree.tensor_refs(tree):
            if not isinstance(ref, str) or not self.has(ref):
                raise FormatError(f"{self.dir}: its saved objects refer to tensor {ref!r}, which it does not store")
        return jsontree.decode(tree, lambda n: self.read(n))
