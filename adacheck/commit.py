"""Write-then-commit on a POSIX filesystem shared by all ranks.

- shard files are written under ``<name>.tmp``, fsynced, renamed, and the directory fsynced;
- ``manifest.json`` is replaced atomically (tmp + fsync + rename) after every rank's files
  are durable, so a checkpoint directory is either its old committed state or the new one;
- ``latest`` is replaced atomically only after the manifest is durable;
- a loader only ever opens a directory through its manifest, so torn saves are invisible.
"""
from __future__ import annotations

import os
import re
import time
from typing import Dict, List, Optional, Tuple

from .errors import FormatError, NotFoundError
from .manifest import MANIFEST_NAME, TAG_RE, dumps, parse, referenced_files
from .types import Manifest
from .writer import fsync_dir

LATEST = "latest"
TMP_SUFFIX = ".tmp"


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_RE.match(tag) or tag in (LATEST,):
        raise FormatError(f"checkpoint tag {tag!r} must be 1-200 characters of letters, digits, "
                          "'.', '_', '+', '-', start with a letter or digit, and not be 'latest'")
    return tag


def atomic_write_text(path: str, text: str, fsync: bool = True) -> None:
    tmp = path + TMP_SUFFIX
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def publish_file(tmp_path: str, final_path: str) -> None:
    os.replace(tmp_path, final_path)


def read_manifest(ckpt_dir: str) -> Manifest:
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise NotFoundError(f"{ckpt_dir} has no {MANIFEST_NAME}: it is not a complete AdaCheck "
                            "checkpoint (an interrupted save, or another format)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: cannot read manifest: {e}") from e
    return parse(text, where=path)


def write_manifest(ckpt_dir: str, manifest: Manifest) -> None:
    atomic_write_text(os.path.join(ckpt_dir, MANIFEST_NAME), dumps(manifest))


def read_latest(save_dir: str) -> Optional[str]:
    """The tag ``<save_dir>/latest`` names; None when there is no such file; a FormatError when
    it names no possible checkpoint (empty, garbage, a path leading out of ``save_dir``)."""
    path = os.path.join(save_dir, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(1024)
    except FileNotFoundError:
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


def latest_or_none(save_dir: str) -> Optional[str]:
    """:func:`read_latest`, with None for a damaged ``latest`` too (for decisions, not for loads)."""
    try:
        return read_latest(save_dir)
    except FormatError:
        return None


def has_checkpoint(load_dir: str) -> bool:
    """Whether ``load_dir`` holds anything a load could mean: a ``latest`` file (intact or not),
    a checkpoint directory with a manifest, or is one."""
    if os.path.exists(os.path.join(load_dir, LATEST)) or os.path.isfile(os.path.join(load_dir, MANIFEST_NAME)):
        return True
    return any(m is not None for _, m, _ in list_checkpoints(load_dir))


def write_latest(save_dir: str, tag: str) -> None:
    atomic_write_text(os.path.join(save_dir, LATEST), check_tag(tag) + "\n")


def list_checkpoints(save_dir: str) -> List[Tuple[str, Optional[Manifest], Optional[str]]]:
    """(tag, manifest or None, problem or None) for every sub-directory with AdaCheck files."""
    out = []
    if not os.path.isdir(save_dir):
        return out
    for name in sorted(os.listdir(save_dir)):
        d = os.path.join(save_dir, name)
        if not os.path.isdir(d):
            continue
        has_files = any(f.endswith((".safetensors", ".safetensors" + TMP_SUFFIX, MANIFEST_NAME))
                        for f in os.listdir(d))
        if not has_files:
            continue
        try:
            out.append((name, read_manifest(d), None))
        except (NotFoundError, FormatError) as e:
            out.append((name, None, str(e)))
    return out


def generation_of(ckpt_dir: str) -> int:
    """Generation for a new save into ``ckpt_dir``: past every generation whose files are
    there (committed, torn, or kept because a later checkpoint references them), so a new
    save never writes over an existing shard file.  0 for a fresh directory."""
    gens = [int(x) for x in re.findall(r"-g(\d+)\.safetensors", " ".join(os.listdir(ckpt_dir)))]
    try:
        gens.append(int(read_manifest(ckpt_dir).framework.get("generation", 0)))
    except (NotFoundError, FormatError):
        pass
    return 1 + max(gens) if gens else 0


_SHARD_FILE = re.compile(r"^rank\d{5}-g\d+\.safetensors(" + re.escape(TMP_SUFFIX) + ")?$")


def collect_garbage(save_dir: str, dry_run: bool = False, retired: Tuple[str, ...] = ()) -> List[Tuple[str, int]]:
    """Delete shard files (and temporaries) that no committed checkpoint reads.

    That covers earlier generations of a re-saved tag, saves a killed job never committed,
    and files of retired checkpoints once nothing references them.  A directory whose
    manifest cannot be parsed is left alone (for a person to look at); only files named
    like AdaCheck shards are removed, and a directory without manifest that this call
    emptied is removed too.  Call it only when no save into ``save_dir`` is in flight.
    ``dry_run``: delete nothing, as if the checkpoints in ``retired`` had no manifest.
    The online-delta log of a checkpoint goes with its manifest (``<tag>/deltas/``).
    Returns the files removed (or that would be), as (``<tag>/<file>``, bytes).
    """
    need: Dict[str, set] = {}
    unreadable = set()
    for tag, m, _ in list_checkpoints(save_dir):
        if m is None:
            if os.path.exists(os.path.join(save_dir, tag, MANIFEST_NAME)):
                unreadable.add(tag)
            continue
        if tag in retired:
            continue
        for ref_tag, name in referenced_files(m):
            need.setdefault(ref_tag or tag, set()).add(name)
    removed = []
    for tag in sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else ():
        d = os.path.join(save_dir, tag)
        if tag in unreadable or not os.path.isdir(d):
            continue
        before = len(removed)
        committed = os.path.exists(os.path.join(d, MANIFEST_NAME)) and tag not in retired
        deltas = os.path.join(d, "deltas")
        if not committed and os.path.isdir(deltas):
            # the online deltas of a retired (or never committed) base: nothing replays them
            size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(deltas) for f in fs)
            if not dry_run:
                import shutil
                shutil.rmtree(deltas, ignore_errors=True)
            removed.append((f"{tag}/deltas/", size))
        for f in sorted(os.listdir(d)):
            if _SHARD_FILE.match(f) and f not in need.get(tag, ()):
                path = os.path.join(d, f)
                try:
                    size = os.path.getsize(path)
                    if not dry_run:
                        os.remove(path)
                    removed.append((f"{tag}/{f}", size))
                except FileNotFoundError:
                    pass
        if not dry_run and len(removed) > before and not os.path.exists(os.path.join(d, MANIFEST_NAME)):
            try:
                os.rmdir(d)
            except OSError:
                pass   # referenced files or something else live there; leave it
    return removed


def choose_retired(save_dir: str, keep_last: Optional[int] = None, older_than_s: Optional[float] = None,
                   protect: Tuple[str, ...] = (), now: Optional[float] = None) -> List[str]:
    """Committed checkpoints a retention policy removes: those beyond the newest
    ``keep_last`` (by step, then manifest time) and/or older than ``older_than_s`` seconds;
    never one in ``protect``, never the newest."""
    committed = []
    for tag, m, problem in list_checkpoints(save_dir):
        if m is None:
            continue
        mtime = os.path.getmtime(os.path.join(save_dir, tag, MANIFEST_NAME))
        committed.append(((m.step if m.step is not None else -1), mtime, tag))
    committed.sort(reverse=True)
    now = time.time() if now is None else now
    out = []
    for i, (_, mtime, tag) in enumerate(committed):
        if i == 0 or tag in protect:
            continue
        if (keep_last is not None and i >= keep_last) or (older_than_s is not None and now - mtime > older_than_s):
            out.append(tag)
    return out


def retire(save_dir: str, tags) -> None:
    """Remove the manifests of ``tags`` (they stop being checkpoints); collect_garbage then
    deletes whatever of their files no kept checkpoint references."""
    for tag in tags:
        os.remove(os.path.join(save_dir, tag, MANIFEST_NAME))
        try:
            os.rmdir(os.path.join(save_dir, tag))   # a checkpoint that only referenced others
        except OSError:
            pass


def apply_retention(save_dir: str, keep_last: int, protect: Tuple[str, ...]) -> List[str]:
    """Retire committed checkpoints beyond the newest ``keep_last``; never one in ``protect``.
    Returns the retired tags (their unreferenced files go with the next collect_garbage)."""
    doomed = choose_retired(save_dir, keep_last=keep_last, protect=protect)
    retire(save_dir, doomed)
    return doomed
