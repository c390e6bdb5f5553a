"""Online gradient deltas: the per-step log between base checkpoints (framework-free).

Between two base (full) checkpoints, each optimizer step is stored as what the optimizer
consumed: the gradient of every tensor it stepped, plus JSON scalars (hyper-parameters at
the step, counters, scheduler / loss-scaler state, this rank's RNG).  On disk, inside the
base checkpoint's directory::

  deltas/chain.json                      the base: tag, step, generation, bytes, save seconds (rank 0)
  deltas/<step:010d>/rank<r>.safetensors the gradients rank r stored for that step
  deltas/<step:010d>/rank<r>.json        rank r's record of the step, written LAST
                                         (tmp + fsync + rename) after its tensors are durable

A step is **committed** when every rank of the base's world has a valid record for it
carrying the same chain ``nonce`` (a fresh random id per incarnation of the chain, so
records of a crashed run never combine with those of the run that recovered from it).
Recovery replays the committed steps that directly follow the base, in order, and stops
at the first gap.  The chain file and every record name the generation of the base they
follow: a tag saved again (a new generation) starts a chain of its own, and the steps of an
earlier save of that tag are never replayed on it (a chain file of another generation: no step
is committed; a record of another generation: the chain stops there).

Gradients are stored in the narrowest dtype that reproduces them bit-exactly: an fp32
gradient whose values are all exact bf16 values is stored as bf16 (proved per tensor by
reading the low halves of their bits); ``compact`` stores bf16 regardless and records the
largest rounding error, and with each step (``deviation``) how far a recovery to it is from
the recording run's state, measured by the recorder on a shadow of the optimizer state.
The hook only copies gradients into preallocated staging buffers (a GPU's fp32 gradient split
into the halves of its bits, the proof that it is bf16 counted by the device:
:meth:`DeltaLog._add_split`); a background thread proves, casts, hashes and writes them.  At most
``queue_depth`` steps wait for the writer: the next step blocks until one is free.  A copy
from a GPU is asynchronous: each slot records a CUDA event after its copies (per stream), and
the writer waits on those events, never on the whole device, before it reads the buffers.
A log still open when the interpreter exits is flushed and closed then
(:mod:`adacheck.checkpoint.lifecycle`): a script that ends without ``engine.destroy()`` keeps its last step.

Record format 2 binds each stored tensor's hash to what it claims to be (the step, the
gradient's key, stored dtype and shape: :func:`adacheck.format.hashing.bound_digest`); records of
format 1 (hashes of the bytes alone) still replay.  Every record is validated before any of
it is used: a record file that is present but malformed or inconsistent is an error naming
it, not the end of the chain (a step whose record is missing is simply not committed).

Nothing here calls torch.distributed: the integration agrees on the nonce and the plan.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..storage import commit
from ..format import jsontree
from ..format.hashing import identity
from ..errors import ConfigError, FormatError, IntegrityError
from ..format.hashing import bound_digest, check_digest_format, hash_tensor
from ..format.safetensors_file import SafetensorsFile
from ..storage.backends import LOCAL, PosixStorage, Storage, copy_file
from ..types import DTYPES, torch_dtype
from ..storage.direct import SpareFiles

log = logging.getLogger("adacheck")

DELTAS = "deltas"
CHAIN = "chain.json"
RECORD_VERSION = 2
READABLE_RECORDS = (1, 2)
_STEP_DIR = re.compile(r"^\d{10}$")
GRAD = "grad/"      # the key prefix of a stored gradient in a delta file


def tensor_identity(step: int, name: str, dtype: str, shape) -> bytes:
    """What a stored delta tensor claims to be (record format 2): its step, name (``grad/<key>``
    or an extra tensor's), stored dtype and shape."""
    return identity("delta", int(step), name, dtype, list(shape))


def deltas_dir(ckpt_dir: str, store: Storage = LOCAL) -> str:
    return store.join(ckpt_dir, DELTAS)


def step_dir(ckpt_dir: str, step: int, store: Storage = LOCAL) -> str:
    return store.join(ckpt_dir, DELTAS, f"{step:010d}")


# ----------------------------------------------------------------------------- the base rule
def auto_interval(base_bytes: int, base_seconds: float, delta_bytes: int, replay_seconds: float,
                  cap: int = 100000) -> int:
    """Deltas to take before the next base for ``base_interval: "auto"``.

    The rule: a new base is due once the deltas since the last one would cost more bytes
    than a base (``n * delta_bytes > base_bytes``) or more estimated replay time than
    writing a base (``n * replay_seconds > base_seconds``).  Returns the largest ``n`` that
    stays within both (at least 1, at most ``cap``).
    """
    if min(base_bytes, delta_bytes) < 0 or min(base_seconds, replay_seconds) < 0:
        raise ValueError("auto_interval needs non-negative sizes and times")
    n = cap
    if delta_bytes > 0:
        n = min(n, base_bytes // delta_bytes)
    if replay_seconds > 0:
        n = min(n, int(base_seconds / replay_seconds))
    return max(1, int(n))


def write_chain(ckpt_dir: str, info: dict, fsync: bool = True, store: Storage = LOCAL) -> None:
    """Rank 0 notes what the chain's base cost (for the "auto" rule after a restart)."""
    store.make_dirs(deltas_dir(ckpt_dir, store))
    commit.atomic_write_text(store.join(deltas_dir(ckpt_dir, store), CHAIN),
                             json.dumps(info, sort_keys=True, allow_nan=False), fsync=fsync, store=store)


def copy_chain(src_dir: str, src_store: Storage, dst_dir: str, dst_store: Storage, rank: int,
               fsync: bool = True, after: Optional[int] = None) -> Optional[int]:
    """Copy rank ``rank``'s part of the delta chain of checkpoint ``src_dir`` to the same
    checkpoint at ``dst_dir`` (a memory-tier base persisted to durable storage), step by step:
    its gradients file, then its record, which commits the step for this rank (rank 0 copies
    the chain file first).  A step counts at the destination only once every rank's record is
    there, so a copy cut short leaves a shorter chain, never a wrong one.  ``after``: the last
    step copied before (only later ones are copied; None: from the start).  Returns the last
    step copied now or before."""
    if after is None and rank == 0 and read_chain(src_dir, src_store) is not None:
        dst_store.make_dirs(deltas_dir(dst_dir, dst_store))
        copy_file(src_store, src_store.join(deltas_dir(src_dir, src_store), CHAIN), dst_store,
                  dst_store.join(deltas_dir(dst_dir, dst_store), CHAIN), fsync=fsync)
    for s in step_dirs(src_dir, src_store):
        if after is not None and s <= after:
            continue
        src, dst = step_dir(src_dir, s, src_store), step_dir(dst_dir, s, dst_store)
        names = set(src_store.list(src))
        if f"rank{rank}.json" not in names:
            break          # this rank's chain ends here, for now
        dst_store.make_dirs(dst)
        for name in (f"rank{rank}.safetensors", f"rank{rank}.json"):
            if name in names:
                path = src_store.join(src, name)
                # (a local file is read with nobody writing over it: the memory tier gives a retired
                # chain's files away as spares, maybe while this copy falls behind)
                with SpareFiles.held(path) if isinstance(src_store, PosixStorage) else contextlib.nullcontext():
                    copy_file(src_store, path, dst_store, dst_store.join(dst, name), fsync=fsync)
        after = s
    return after


def read_chain(ckpt_dir: str, store: Storage = LOCAL) -> Optional[dict]:
    try:
        return json.loads(store.read_bytes(store.join(deltas_dir(ckpt_dir, store), CHAIN)).decode("utf-8"))
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- reading
@dataclass
class Step:
    """One committed step: every rank's record (rank -> dict)."""

    step: int
    records: Dict[int, dict]
    store: Storage = LOCAL      # where the step's files are

    @property
    def nonce(self) -> str:
        """The chain id of the run that recorded it (every record's: committed_steps checks)."""
        return next(iter(self.records.values()))["nonce"]

    def holder_of(self, key: str, prefer: int) -> int:
        """A rank whose file holds the gradient ``key`` (``prefer`` if it has it)."""
        if prefer in self.records and key in self.records[prefer]["tensors"]:
            return prefer
        for r in sorted(self.records):
            if key in self.records[r]["tensors"]:
                return r
        raise FormatError(f"delta step {self.step}: no rank stored the gradient {key!r}")

    @property
    def lossy(self) -> bool:
        return any(r.get("lossy") for r in self.records.values())

    @property
    def bytes(self) -> int:
        return sum(int(r.get("file_bytes", 0)) for r in self.records.values())

    def max_abs_error(self) -> float:
        return max([float(v.get("max_abs_error", 0.0)) for r in self.records.values() for v in r["tensors"].values()]
                   or [0.0])

    def deviation(self) -> Optional[Dict[str, float]]:
        """compact: how far a recovery to this step is from the recording run's state there
        (largest absolute difference over every rank's weights / optimizer state, measured while
        recording); None when no rank measured it."""
        got = [r["deviation"] for r in self.records.values() if isinstance(r.get("deviation"), dict)]
        if not got:
            return None
        return {k: max(float(d.get(k, "inf")) for d in got) for k in ("weights", "state")}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_tensor_meta(meta, where: str, recorded: bool) -> None:
    """One stored tensor's entry in a record: dtypes known, a shape of sizes, a digest (and for a
    gradient, ``recorded``: the dtype it had and the one it is stored in, bf16 only for fp32)."""
    if not isinstance(meta, dict):
        raise FormatError(f"{where} is not an object")
    if meta.get("dtype") not in DTYPES:
        raise FormatError(f"{where}.dtype {meta.get('dtype')!r} is not one of {sorted(DTYPES)}")
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(_int(n) and n >= 0 for n in shape):
        raise FormatError(f"{where}.shape {shape!r} is not a list of sizes")
    if not check_digest_format(meta.get("hash")):
        raise FormatError(f"{where}.hash {meta.get('hash')!r} is not an xxh3_128 digest")
    if recorded:
        kept = meta.get("stored")
        if kept != meta["dtype"] and not (meta["dtype"] == "float32" and kept == "bfloat16"):
            raise FormatError(f"{where}.stored {kept!r} is not {meta['dtype']!r} (or bfloat16 for float32)")
        err = meta.get("max_abs_error", 0.0)
        if err != "inf" and (isinstance(err, bool) or not isinstance(err, (int, float))):
            raise FormatError(f"{where}.max_abs_error {err!r} is not a number (or \"inf\")")


def check_record(rec, step: int, rank: int, where: str) -> dict:
    """``rec`` (a parsed rank<r>.json) if it is a valid record of ``rank`` at ``step``, else a
    FormatError naming the field: what a later reader relies on is checked here, once."""
    if not isinstance(rec, dict):
        raise FormatError(f"{where}: not a JSON object")
    if rec.get("version") not in READABLE_RECORDS:
        raise FormatError(f"{where}: record version {rec.get('version')!r} is not one this AdaCheck reads "
                          f"({', '.join(map(str, READABLE_RECORDS))})")
    if rec.get("step") != step or not _int(rec.get("step")) or rec.get("rank") != rank or not _int(rec.get("rank")):
        raise FormatError(f"{where}: the record says step {rec.get('step')!r} of rank {rec.get('rank')!r}, but it "
                          f"lies where step {step} of rank {rank} belongs (moved or copied delta files)")
    if not isinstance(rec.get("nonce"), str) or not rec["nonce"]:
        raise FormatError(f"{where}: nonce {rec.get('nonce')!r} is not a chain id")
    if "base_generation" in rec and (not _int(rec["base_generation"]) or rec["base_generation"] < 0):
        raise FormatError(f"{where}: base_generation {rec['base_generation']!r} is not a generation")
    if rec.get("file") not in (None, f"rank{rank}.safetensors"):
        raise FormatError(f"{where}: file {rec.get('file')!r} is not rank{rank}.safetensors in its step directory")
    if not _int(rec.get("file_bytes")) or rec["file_bytes"] < 0:
        raise FormatError(f"{where}: file_bytes {rec.get('file_bytes')!r} is not a size")
    for field_name, recorded in (("tensors", True), ("extra", False)):
        table = rec.get(field_name)
        if not isinstance(table, dict):
            raise FormatError(f"{where}: {field_name} is not an object")
        for key, meta in table.items():
            _check_tensor_meta(meta, f"{where}: {field_name}[{key!r}]", recorded)
    if (rec["tensors"] or rec["extra"]) and rec["file"] is None:
        raise FormatError(f"{where}: lists stored tensors but no file")
    if not isinstance(rec.get("lossy", False), bool):
        raise FormatError(f"{where}: lossy {rec.get('lossy')!r} is not true or false")
    tree = rec.get("record")
    if not isinstance(tree, dict):
        raise FormatError(f"{where}: record is not an object")
    missing = [n for n in jsontree.tensor_refs(tree) if not isinstance(n, str) or n not in rec["extra"]]
    if missing:
        raise FormatError(f"{where}: the record refers to tensors {missing[:4]} it does not store")
    dev = rec.get("deviation", {})
    if not isinstance(dev, dict) or not all(v == "inf" or (isinstance(v, (int, float)) and not isinstance(v, bool))
                                            for v in dev.values()):
        raise FormatError(f"{where}: deviation {dev!r} is not an object of numbers")
    return rec


def received_record(files: Dict[str, bytes], step: int, rank: int, where: str) -> dict:
    """The record of rank ``rank``'s step ``step`` that another node sent (``files``: name ->
    bytes), once the files are what a reader relies on: the names this rank's step has (nothing
    else, nowhere else), a valid record of that step and rank, and the gradients file it names
    (whose header :func:`file_check` checks as it is kept: ``tiers.receive_step``)."""
    json_name, file_name = f"rank{rank}.json", f"rank{rank}.safetensors"
    if not isinstance(files, dict) or set(files) - {json_name, file_name} or json_name not in files:
        raise FormatError(f"{where}: step {step} of rank {rank} came as {sorted(files)!r}, not {json_name} "
                          f"(and {file_name}): refused")
    try:
        rec = json.loads(bytes(files[json_name]).decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{where}: the record of step {step}, rank {rank} is not JSON: {e}") from None
    check_record(rec, step, rank, f"{where}: step {step}, rank {rank}")
    if (rec["file"] is None) != (file_name not in files):
        raise FormatError(f"{where}: step {step} of rank {rank} came {'with' if file_name in files else 'without'} "
                          f"{file_name}, its record says {rec['file']!r}: refused")
    return rec


def file_check(rec: dict, step: int, where: str) -> Callable[[str], None]:
    """A check of a received gradients file (``tiers.receive_file``): its header holds every
    tensor of the record ``rec`` with the record's stored dtype and shape (the hashes are checked
    when they are replayed)."""
    want = {GRAD + k: (m["stored"], m["shape"]) for k, m in rec["tensors"].items()}
    want.update({k: (m["dtype"], m["shape"]) for k, m in rec["extra"].items()})

    def check(path: str) -> None:
        held = SafetensorsFile(path, LOCAL).entries
        for name, (dname, shape) in want.items():
            if name not in held or held[name][0] != dname or list(held[name][1]) != list(shape):
                got = f"{held[name][0]}{list(held[name][1])}" if name in held else "nothing"
                raise FormatError(f"{where}: {rec['file']} of step {step} holds {got} as {name!r}, its record "
                                  f"says {dname}{list(shape)}: refused")
    return check


def _read_record(path: str, step: int, rank: int, store: Storage = LOCAL) -> Optional[dict]:
    """The valid record at ``path``; None when there is none (the step is not committed there);
    a FormatError when a file is there but is not a valid record of that step and rank."""
    try:
        text = store.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: cannot read the delta record: {e}") from e
    try:
        rec = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from e
    return check_record(rec, step, rank, path)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def step_dirs(ckpt_dir: str, store: Storage = LOCAL) -> List[int]:
    return sorted(int(n) for n in store.list(deltas_dir(ckpt_dir, store)) if _STEP_DIR.match(n))


def committed_steps(ckpt_dir: str, base_step: int, world: int, strict: bool = True,
                    store: Storage = LOCAL, ranks: Optional[Sequence[int]] = None,
                    generation: Optional[int] = None) -> Tuple[List[Step], str]:
    """The committed steps directly after ``base_step`` (in order, up to the first gap) and a
    one-line reason why the chain stops where it does.  A step is committed when the records of
    ``ranks`` (default: all ``world``) are there.  A record that is there but invalid is
    damage, not a gap: a FormatError naming it (``strict``), or where the chain stops, saying so.
    ``generation``: the base's (its manifest's); a chain file or a record of another generation
    belongs to an earlier save of the tag, and is not committed (those of versions that did not
    record the generation are not compared)."""
    out: List[Step] = []
    info = read_chain(ckpt_dir, store) if generation is not None else None
    recorded = info.get("base_generation") if isinstance(info, dict) else None
    if recorded is not None and recorded != generation:
        return out, (f"the delta log belongs to an earlier save of this tag (generation {recorded}; the base is "
                     f"generation {generation})")
    want = base_step + 1
    for s in step_dirs(ckpt_dir, store):
        if s < want:
            continue
        if s != want:
            return out, f"step {want} was never written"
        recs = {}
        for r in (range(world) if ranks is None else ranks):
            try:
                rec = _read_record(store.join(step_dir(ckpt_dir, s, store), f"rank{r}.json"), s, r, store)
            except FormatError as e:
                if strict:
                    raise FormatError(f"{e}. The delta log of {ckpt_dir} is damaged at step {s}: to recover "
                                      f"step {s - 1}, remove {step_dir(ckpt_dir, s, store)} and the step directories "
                                      "after it (or load with on_corrupt \"fallback\")") from None
                return out, f"step {s} is damaged: {e}"
            if rec is None:
                return out, f"step {s} is incomplete (rank {r} has no record)"
            if generation is not None and rec.get("base_generation", generation) != generation:
                return out, (f"step {s} was recorded on an earlier save of this tag (generation "
                             f"{rec['base_generation']}; the base is generation {generation})")
            recs[r] = rec
        if len({rec["nonce"] for rec in recs.values()}) != 1:
            return out, f"step {s} mixes records of different runs"
        out.append(Step(s, recs, store))
        want = s + 1
    return out, "end of the log"


def read_grad(ckpt_dir: str, step: Step, key: str, prefer_rank: int, verify: bool = True,
              files: Optional[dict] = None) -> torch.Tensor:
    """The gradient ``key`` of ``step`` in the dtype it was recorded in (hash-checked)."""
    meta, path = grad_meta(ckpt_dir, step, key, prefer_rank)
    rec = step.records[step.holder_of(key, prefer_rank)]
    t = _verified(ckpt_dir, step, rec, path, open_file(path, files, step.store), GRAD + key, meta["stored"], meta,
                  verify)
    return t.to(torch_dtype(meta["dtype"]))


def grad_meta(ckpt_dir: str, step: Step, key: str, prefer_rank: int) -> Tuple[dict, str]:
    """The record entry of gradient ``key`` of ``step`` (from ``prefer_rank``'s record if it stored
    it, else another rank's) and the file that holds it."""
    rec = step.records[step.holder_of(key, prefer_rank)]
    return rec["tensors"][key], step.store.join(step_dir(ckpt_dir, step.step, step.store), str(rec["file"]))


def _verified(ckpt_dir: str, step: Step, rec: dict, path: str, f: SafetensorsFile, name: str, kept: str,
              meta: dict, verify: bool) -> torch.Tensor:
    """Tensor ``name`` of a delta file, checked against its record: stored dtype and shape (always),
    hash (``verify``; format 2: bound to the step, name, dtype and shape)."""
    if name not in f.entries:
        raise FormatError(f"{path}: lacks {name!r}, which its record lists")
    dname, shape, _, _ = f.entries[name]
    if list(shape) != list(meta["shape"]) or dname != kept:
        raise FormatError(f"{path}: {name} is {dname}{list(shape)}, its record says {kept}{meta['shape']}")
    t = f.read(name)
    if verify:
        got = (bound_digest(tensor_identity(step.step, name, kept, shape), t) if rec["version"] >= 2
               else hash_tensor(t))
        if got != meta["hash"]:
            raise _damaged(ckpt_dir, step, path, name)
    return t


def _damaged(ckpt_dir: str, step: Step, path: str, what: str) -> IntegrityError:
    return IntegrityError(f"{path}: {what} of delta step {step.step} does not match its recorded hash "
                          f"(corrupted, or not what the record says it is); to recover step {step.step - 1} instead, remove "
                          f"{step_dir(ckpt_dir, step.step, step.store)} and the step directories after it")


def open_file(path: str, files: Optional[dict], store: Storage = LOCAL) -> SafetensorsFile:
    """The delta file at ``path``, its header validated (kept in ``files`` for the next use)."""
    f = files.get(path) if files is not None else None
    if f is None:
        f = SafetensorsFile(path, store)
        if files is not None:
            files[path] = f
    return f


def read_extra(ckpt_dir: str, step: Step, rank: int, verify: bool = True, files: Optional[dict] = None) -> dict:
    """This rank's record tree with its tensors (e.g. the RNG state) filled in."""
    rec = step.records[rank]
    tensors = {}
    if rec["extra"]:
        path = step.store.join(step_dir(ckpt_dir, step.step, step.store), str(rec["file"]))
        f = open_file(path, files, step.store)
        for name, meta in rec["extra"].items():
            tensors[name] = _verified(ckpt_dir, step, rec, path, f, name, meta["dtype"], meta, verify)
    return jsontree.decode(rec["record"], tensors.__getitem__)


def remove_steps_after(ckpt_dir: str, step: int, store: Storage = LOCAL) -> List[int]:
    """Delete the (uncommitted) step directories after ``step``; returns their steps."""
    gone = []
    for s in step_dirs(ckpt_dir, store):
        if s > step:
            store.remove_tree(step_dir(ckpt_dir, s, store))
            gone.append(s)
    if gone:
        store.sync_dir(deltas_dir(ckpt_dir, store))
    return gone


def summary(ckpt_dir: str, base_step: int, world: int, store: Storage = LOCAL,
            generation: Optional[int] = None) -> dict:
    """What ``adacheck inspect`` shows about a base's delta log (damage is where it stops);
    ``generation``: the base's (:func:`committed_steps`)."""
    steps, why = committed_steps(ckpt_dir, base_step, world, strict=False, store=store, generation=generation)
    devs = {s.step: d for s, d in ((s, s.deviation()) for s in steps) if d is not None}
    elems = stored_elements(steps)
    total = sum(elems.values())
    return {"committed": len(steps), "first": steps[0].step if steps else None,
            "last": steps[-1].step if steps else None, "bytes": sum(s.bytes for s in steps),
            "stops": why, "lossy": any(s.lossy for s in steps),
            "max_abs_error": max([s.max_abs_error() for s in steps] or [0.0]),
            # per committed step, compact only: a recovery to it deviates by this much
            "deviation": devs,
            "max_deviation": {k: max(d[k] for d in devs.values()) for k in ("weights", "state")} if devs else None,
            "on_disk": len(step_dirs(ckpt_dir, store)),
            # gradient elements per stored dtype, and the share stored in bf16 (2 bytes each)
            "stored_elements": elems,
            "bf16_share": elems.get("bfloat16", 0) / total if total else None}


def stored_elements(steps: List[Step]) -> Dict[str, int]:
    """Gradient elements of ``steps`` (every rank's records) per dtype they are stored in."""
    out: Dict[str, int] = {}
    for st in steps:
        for r in st.records.values():
            for m in r["tensors"].values():
                out[m["stored"]] = out.get(m["stored"], 0) + math.prod(m["shape"])
    return out


def reach(ckpt_dir: str, base_step: int, world: int, step: Optional[int] = None,
          store: Storage = LOCAL, generation: Optional[int] = None) -> Tuple[int, int]:
    """(committed online steps to replay, the step a load ends at) for the base checkpoint
    ``ckpt_dir`` at ``base_step`` (of ``generation``) saved by ``world`` ranks: all its committed
    deltas, or those up to ``step`` (which must be the base's step or one of them)."""
    dl = summary(ckpt_dir, base_step, world, store, generation) if step_dirs(ckpt_dir, store) else {"committed": 0}
    pending, last = dl["committed"], (dl["last"] if dl["committed"] else base_step)
    if step is not None and step != last:
        if step == base_step:
            pending, last = 0, base_step
        elif pending and base_step < step < last:
            pending, last = step - base_step, step
        else:
            raise ConfigError(f"{ckpt_dir} holds step {base_step} and committed online steps {dl['first']}..{last}: "
                              f"step {step} is not among them" if pending else
                              f"{ckpt_dir} holds only step {base_step}, not {step}")
    return pending, last


def base_for_step(save_dir: str, step: int, store: Storage = LOCAL) -> str:
    """The tag of the newest complete checkpoint in ``save_dir`` from which ``step`` is reachable
    (it is that step, or its committed online deltas reach it)."""
    found = []
    for t, m, _ in commit.list_checkpoints(save_dir, store):
        if m is None or m.step is None or m.step > step:
            continue
        _, last = reach(store.join(save_dir, t), m.step, int(m.topology.get("world_size", 1)), store=store,
                        generation=m.framework.get("generation"))
        if last >= step:
            found.append((m.step, t))
    if not found:
        raise ConfigError(f"no checkpoint in {save_dir} holds step {step} or reaches it with committed online "
                          "deltas (adacheck inspect shows each base's steps)")
    return max(found)[1]
