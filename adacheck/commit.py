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
import shutil
from typing import List, Optional, Tuple

from .errors import FormatError, NotFoundError
from .manifest import MANIFEST_NAME, dumps, parse
from .types import Manifest
from .writer import fsync_dir

LATEST = "latest"
TMP_SUFFIX = ".tmp"
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag in (LATEST,):
        raise FormatError(f"checkpoint tag {tag!r} must be 1-200 characters of letters, digits, "
                          "'.', '_', '+', '-', start with a letter or digit, and not be 'latest'")
    return tag


def atomic_write_text(path: str, text: str) -> None:
    tmp = path + TMP_SUFFIX
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
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
    path = os.path.join(save_dir, LATEST)
    try:
        with open(path, "r", encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        return None
    return check_tag(tag)


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
    """Generation for a new save into ``ckpt_dir``: one past the committed one (0 if none)."""
    try:
        m = read_manifest(ckpt_dir)
    except NotFoundError:
        return 0
    except FormatError:
        return 1 + max([int(x) for x in re.findall(r"-g(\d+)\.safetensors", " ".join(os.listdir(ckpt_dir)))] or [0])
    return 1 + int(m.framework.get("generation", 0))


def remove_unreferenced(ckpt_dir: str, manifest: Manifest) -> None:
    """Delete shard files (and stale temporaries) the committed manifest does not use."""
    keep = set(manifest.files)
    for f in os.listdir(ckpt_dir):
        if (f.endswith(".safetensors") and f not in keep) or f.endswith(".safetensors" + TMP_SUFFIX):
            try:
                os.remove(os.path.join(ckpt_dir, f))
            except FileNotFoundError:
                pass


_SHARD_FILE = re.compile(r"^rank\d{5}-g\d+\.safetensors(" + re.escape(TMP_SUFFIX) + ")?$")


def remove_torn(save_dir: str, protect: Tuple[str, ...] = ()) -> List[str]:
    """Delete the shard files of saves that never committed (a killed job leaves them).

    Only directories with no manifest at all are touched (a damaged manifest is left for a
    person to look at), only files named like AdaCheck shards are removed, and the directory
    itself only when nothing else is left in it.  Call it only when no save of this job is
    in flight.  Returns the tags cleaned.
    """
    cleaned = []
    for tag in sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else ():
        d = os.path.join(save_dir, tag)
        if tag in protect or not os.path.isdir(d) or os.path.exists(os.path.join(d, MANIFEST_NAME)):
            continue
        shards = [f for f in os.listdir(d) if _SHARD_FILE.match(f)]
        if not shards:
            continue
        for f in shards:
            try:
                os.remove(os.path.join(d, f))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(d)
        except OSError:
            pass   # something else lives there; leave it
        cleaned.append(tag)
    return cleaned


def apply_retention(save_dir: str, keep_last: int, protect: Tuple[str, ...]) -> List[str]:
    """Delete committed checkpoints beyond the newest ``keep_last``; never one in ``protect``.

    Order is by step, then manifest time.  Only directories holding an AdaCheck manifest
    are ever removed.  Returns the removed tags.
    """
    committed = []
    for tag, m, problem in list_checkpoints(save_dir):
        if m is None:
            continue
        mtime = os.path.getmtime(os.path.join(save_dir, tag, MANIFEST_NAME))
        committed.append(((m.step if m.step is not None else -1), mtime, tag))
    committed.sort(reverse=True)
    removed = []
    for _, _, tag in committed[keep_last:]:
        if tag in protect:
            continue
        shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
        removed.append(tag)
    return removed
