"""The ``adacheck`` command's subcommands (``cmd_<name>``), imported by :mod:`adacheck.cli` only
once the command line is parsed: they need torch, which ``adacheck --help`` does not."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Optional

import torch

from ..storage import commit, lease
from ..storage import manifest_files
from ..online import deltas
from ..checkpoint.reader import CheckpointReader, resolve, verify_part
from ..checkpoint.saving import human
from ..errors import AdaCheckError, ConfigError, NothingToDo, NotFoundError
from ..format.manifest import referenced_files
from ..storage.backends import LOCAL, Storage, open_storage


def table(rows, headers) -> str:
    cols = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cols]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def located(args, path: str):
    """(storage, path) of a checkpoint path given on the command line: a local directory, or an
    fsspec URL opened with ``--storage-options``."""
    options = getattr(args, "storage_options", None)
    if options is not None and "://" not in path:
        raise ConfigError(f"--storage-options apply to URLs (s3://bucket/prefix, ...), not to the local path {path!r}")
    return open_storage(path, options)


def located_dir(args, path: str, what: str = "save or checkpoint directory"):
    """:func:`located`, and an error (exit 2) when ``path`` is no directory: missing, or a file
    (then the directory that holds it is named)."""
    store, where = located(args, path)
    if not store.is_dir(where):
        if store.is_file(where):
            raise NotFoundError(f"{path} is a file, not a {what}: give a directory, such as the one that "
                                f"holds it ({store.parent(where)})")
        raise NotFoundError(f"{path}: no such directory")
    return store, where


def tensor_rows(m) -> list:
    """(name, dtype, shape, bytes, how it is stored) of every logical tensor of manifest ``m``."""
    rows = []
    for name in sorted(m.tensors):
        e = m.tensors[name]
        how = f"= cast({e.derived.source})" if e.derived else f"{len(e.boxes)} box(es)"
        rows.append((name, e.dtype, list(e.shape), e.nbytes, how))
    return rows


def summary(ckpt_dir: str, store: Optional[Storage] = None) -> dict:
    store = store if store is not None else open_storage(ckpt_dir)[0]
    r = CheckpointReader(ckpt_dir, verify=False, store=store)
    m = r.manifest
    per_kind = defaultdict(lambda: {"tensors": 0, "logical": 0, "stored": 0, "referenced": 0, "derived": 0})
    for e in m.tensors.values():
        k = per_kind[e.kind]
        k["tensors"] += 1
        k["logical"] += e.nbytes
        if e.derived is not None:
            k["derived"] += e.nbytes
        else:
            item = e.nbytes // max(e.numel, 1)
            k["stored"] += sum(b.box.numel for b in e.boxes if "/" not in b.file) * item
            k["referenced"] += sum(b.box.numel for b in e.boxes if "/" in b.file) * item
    per_rank = defaultdict(int)
    for f, info in m.files.items():
        per_rank[info["writer"]] += info["nbytes"]
    return {
        "dir": store.canonical(ckpt_dir), "tag": m.tag, "step": m.step,
        "framework": m.framework, "topology": m.topology, "stats": m.stats,
        "tensors": len(m.tensors), "files": len(m.files),
        "file_bytes": sum(i["nbytes"] for i in m.files.values()),
        "per_kind": dict(per_kind), "per_rank_file_bytes": dict(sorted(per_rank.items())),
        "references": sorted({t for t, _ in referenced_files(m) if t is not None}),
        "deltas": (deltas.summary(ckpt_dir, m.step, int(m.topology.get("world_size", 1)), store,
                                  m.framework.get("generation"))
                   if m.step is not None and deltas.step_dirs(ckpt_dir, store) else None),
    }


def in_memory(store: Storage, save_dir: str, memory_dir: Optional[str]) -> list:
    """What the memory tier (tiers.memory) holds for the checkpoint directory ``save_dir``, per job:
    its checkpoints there (with their online deltas), the newest, and the bytes."""
    from ..tiers.location import durable_key, memory_root
    key = durable_key(store, save_dir)
    return [dict(x, job=j["job"], path=j["path"]) for j in memory_jobs(memory_dir or memory_root(None))
            for x in j["checkpoint_dirs"] if x["source"] == key]


def cmd_inspect(args) -> int:
    store, path = located_dir(args, args.path)
    d = resolve(path, args.tag, store)
    s = summary(d, store)
    s["memory_tier"] = [{k: x[k] for k in ("job", "path", "checkpoints", "newest", "bytes")}
                        for x in in_memory(store, store.parent(d), args.memory_dir)]
    if args.json:
        if args.redundancy:
            s["redundancy"] = redundancy(CheckpointReader(d, verify=False, store=store).manifest)
        if args.tensors:
            s["tensor_list"] = [dict(zip(("name", "dtype", "shape", "bytes", "stored_as"), r)) for r in
                                tensor_rows(CheckpointReader(d, verify=False, store=store).manifest)]
        print(json.dumps(s, indent=1, sort_keys=True))
        return 0
    fw = s["framework"]
    print(f"checkpoint  {s['dir']}")
    print(f"tag         {s['tag']}   step {s['step']}")
    print("framework   " + ", ".join(f"{k}={v}" for k, v in sorted(fw.items())))
    print("topology    " + ", ".join(f"{k}={v}" for k, v in sorted(s["topology"].items())))
    st = s["stats"]
    logical, stored = st.get("logical_bytes", 0), s["file_bytes"]
    print(f"tensors     {s['tensors']} logical tensors in {s['files']} files")
    dl = s["deltas"]
    if dl is not None:
        if dl["committed"]:
            print(f"deltas      {dl['committed']} committed online steps ({dl['first']}-{dl['last']}), "
                  f"{human(dl['bytes'])}: a load recovers step {dl['last']}"
                  + ("" if dl["stops"] == "end of the log" else f" ({dl['stops']})"))
            if dl["bf16_share"] is not None:
                print(f"            {human(dl['bytes'] // dl['committed'])} per step; {dl['bf16_share']:.0%} of the "
                      f"gradient values stored in bf16 (2 bytes), the rest in their recorded dtype")
        else:
            print(f"deltas      none committed ({dl['stops']})")
        if dl["lossy"]:
            print(f"            APPROXIMATE: compact (lossy bf16) gradients, largest rounding error "
                  f"{dl['max_abs_error']:.3g}")
            dev, top = dl["deviation"].get(dl["last"]), dl["max_deviation"]
            if dev is None:
                print("            the deviation of a recovery was not measured when these deltas were written")
            else:
                print(f"            measured deviation of a load from the recording run at step {dl['last']}: "
                      f"weights {dev['weights']:.3g}, optimizer state {dev['state']:.3g} (largest at any "
                      f"step of the chain: {top['weights']:.3g}, {top['state']:.3g})")
    for x in s["memory_tier"]:
        print(f"memory tier job {x['job']} holds {x['checkpoints']} checkpoint(s) of this directory, newest "
              f"{x['newest'] or '-'}, {human(x['bytes'])} (online deltas included) in {x['path']}")
    print(f"bytes       held by all ranks {human(st.get('held_bytes', 0))}, logical {human(logical)}, "
          f"derived (not stored) {human(st.get('derived_bytes', 0))}, on disk {human(stored)}")
    if s["references"]:
        print(f"referenced  {human(st.get('referenced_bytes', 0))} unchanged since, and read from, "
              f"earlier checkpoint(s) {', '.join(s['references'])}")
    if stored:
        print(f"ratios      held/on-disk {st.get('held_bytes', 0) / stored:.2f}x, "
              f"logical/on-disk {logical / stored:.2f}x")
    print()
    rows = [(k, v["tensors"], human(v["logical"]), human(v["derived"]), human(v["stored"]),
             human(v["referenced"])) for k, v in sorted(s["per_kind"].items())]
    print(table(rows, ["kind", "tensors", "logical", "derived", "stored (new)", "referenced"]))
    print()
    rows = [(f"rank {r}", human(b)) for r, b in s["per_rank_file_bytes"].items()]
    print(table(rows, ["writer", "bytes written"]))
    if args.redundancy:
        print()
        print_redundancy(CheckpointReader(d, verify=False, store=store).manifest)
    if args.tensors:
        print()
        rows = tensor_rows(CheckpointReader(d, verify=False, store=store).manifest)
        print(table([(n, t, "x".join(map(str, sh)) or "scalar", human(b), how) for n, t, sh, b, how in rows],
                    ["tensor", "dtype", "shape", "bytes", "stored as"]))
    return 0


def _ranks(holders) -> str:
    hs = sorted(holders)
    if not hs:
        return "-"
    if len(hs) > 2 and hs == list(range(hs[0], hs[-1] + 1)):
        return f"ranks {hs[0]}-{hs[-1]}"
    return ("rank " if len(hs) == 1 else "ranks ") + ",".join(map(str, hs))


def redundancy(m) -> dict:
    """Per kind and per holder set: bytes held by all ranks, distinct, written here,
    referenced in earlier checkpoints, derived; and the regions whose holders diverged."""
    kinds = defaultdict(lambda: defaultdict(int))
    groups = defaultdict(lambda: defaultdict(int))
    diverged = []
    for name, e in sorted(m.tensors.items()):
        item = e.nbytes // max(e.numel, 1)
        k = kinds[e.kind]
        if e.derived is not None:
            k["derived"] += e.nbytes
            continue
        regions = defaultdict(dict)   # box -> hash -> holders
        for sb in e.boxes:
            nbytes = sb.box.numel * item
            k["referenced" if "/" in sb.file else "stored"] += nbytes
            regions[sb.box].setdefault(sb.hash, set()).update(sb.holders)
        for box, variants in regions.items():
            nbytes = box.numel * item
            if len(variants) > 1:
                diverged.append(f"{name} box {box.key()}: " + " vs ".join(
                    _ranks(h) for h in variants.values()))
            for hs in variants.values():
                k["held"] += nbytes * max(len(hs), 1)
                k["distinct"] += nbytes
                g = groups[_ranks(hs)]
                g["boxes"] += 1
                g["distinct"] += nbytes
                g["held"] += nbytes * max(len(hs), 1)
    # derived tensors record no holders: the bytes all ranks held of them are what the save counted
    # as held (the manifest's stats) beyond the stored tensors' holders
    derived_kinds = sorted(k for k, v in kinds.items() if v.get("derived"))
    rest = int(m.stats.get("held_bytes", 0)) - sum(v.get("held", 0) for v in kinds.values())
    if rest > 0 and len(derived_kinds) == 1:
        kinds[derived_kinds[0]]["held"] += rest
    return {"kinds": {a: dict(b) for a, b in kinds.items()}, "holders": {a: dict(b) for a, b in groups.items()},
            "diverged": diverged}


def print_redundancy(m) -> None:
    red = redundancy(m)
    rows = []
    for kind, v in sorted(red["kinds"].items()):
        rows.append((kind, human(v.get("held", 0)), human(v.get("distinct", 0)), human(v.get("stored", 0)),
                     human(v.get("referenced", 0)), human(v.get("derived", 0)),
                     f"{v.get('held', 0) / v['stored']:.2f}x" if v.get("stored") else "-"))
    print(table(rows, ["kind", "held by ranks", "distinct", "written here", "referenced", "derived",
                       "held/written"]))
    print()
    rows = [(g, v["boxes"], human(v["distinct"]), human(v["held"]))
            for g, v in sorted(red["holders"].items(), key=lambda kv: -kv[1]["held"])]
    print(table(rows, ["holders (group)", "boxes", "distinct", "held by ranks"]))
    print()
    if red["diverged"]:
        print(f"DIVERGED: {len(red['diverged'])} region(s) whose declared replicas held different bytes "
              "(every variant stored):")
        for d in red["diverged"][:20]:
            print(f"  {d}")
    else:
        print("no diverged replicas")


def cmd_verify(args) -> int:
    store, path = located_dir(args, args.path)
    d = resolve(path, args.tag, store)
    r = CheckpointReader(d, verify=True, cache_bytes=0, store=store)
    manifest_files.check_rank_files(r.manifest)      # format 5: its rank files and meta file agree with its parts
    # stored boxes, then (format 2) each box of a derived tensor: derived from its source and
    # checked against the digest its holders recorded
    work = [(name, sb.box, sb.file, lambda name=name, sb=sb: r.stored(name, sb))
            for name, e in sorted(r.manifest.tensors.items()) for sb in e.boxes]
    work += [(name, box, None, lambda name=name, e=e, box=box, h=h: r.derived_box(name, e, box, h))
             for name, e in sorted(r.manifest.tensors.items()) if e.derived is not None for box, h in e.derived.boxes]
    total = sum(box.numel * r.entry(name).nbytes // max(r.entry(name).numel, 1) for name, box, _, _ in work)
    done, bad = 0, {}       # file (None: derived) -> {tensor: [messages]}
    bar = LineBar("verify", total, show=not args.quiet and not args.json)
    for i, (name, box, fname, check) in enumerate(work):
        try:
            check()
        except AdaCheckError as e:
            bad.setdefault(fname, {}).setdefault(name, []).append(str(e))
        r.drop_cache()
        done += box.numel * r.entry(name).nbytes // max(r.entry(name).numel, 1)
        bar(done)
    bar.close()
    nbad = sum(len(m) for t in bad.values() for m in t.values())
    if args.json:
        print(json.dumps({"dir": d, "ok": not bad, "boxes": len(work), "verified": len(work) - nbad, "bytes": total,
                          "damage": [{"file": f, "tensors": {t: len(m) for t, m in sorted(ts.items())},
                                      "first": next(iter(ts.values()))[0]}
                                     for f, ts in sorted(bad.items(), key=lambda kv: str(kv[0]))]}, indent=1))
        return 1 if bad else 0
    for fname, tensors in sorted(bad.items(), key=lambda kv: str(kv[0])):   # once per file, then per tensor
        boxes = sum(len(m) for m in tensors.values())
        print(f"BAD  {fname or 'derived tensors'}: {boxes} box(es) of {len(tensors)} tensor(s); first: "
              f"{next(iter(tensors.values()))[0].splitlines()[0]}")
        for name, msgs in sorted(tensors.items())[:MAX_LISTED]:
            print(f"       {name}: {len(msgs)} box(es)")
        if len(tensors) > MAX_LISTED:
            print(f"       ... and {len(tensors) - MAX_LISTED} more tensors")
    print(f"{'OK' if not bad else 'FAILED'}: {len(work) - nbad}/{len(work)} stored and derived boxes verified "
          f"({human(total)}) in {d}")
    return 1 if bad else 0


MAX_LISTED = 10


class LineBar:
    """A one-line progress bar of bytes on stderr, drawn on a terminal only (ADACHECK_PROGRESS=1:
    anywhere, 0: nowhere).  Its own, not tqdm's: the core commands run with torch, safetensors,
    xxhash and numpy alone (convert's bars are tqdm's, which DeepSpeed brings)."""

    def __init__(self, what: str, total: int, show: bool = True):
        self.what, self.total = what, total
        wanted = os.environ.get("ADACHECK_PROGRESS", "1" if sys.stderr.isatty() else "0") == "1"
        self.show, self.drawn = show and wanted, False

    def __call__(self, done: int) -> None:
        if self.show:
            frac = min(done / self.total, 1.0) if self.total else 1.0
            sys.stderr.write(f"\r{self.what} [{'#' * int(30 * frac):<30}] {100 * frac:5.1f}% "
                             f"{human(done)}/{human(self.total)}")
            self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")


def files_problem(store: Storage, save_dir: str, tag: str, m) -> Optional[str]:
    """A file checkpoint ``tag`` needs that is missing or not the size its manifest says (cheap:
    sizes only), or None."""
    own = store.join(save_dir, tag)
    for fname, info in sorted(m.files.items()):
        size = store.size_if_file(store.join(own, fname))
        if size is None:
            return f"{fname} is missing"
        if size != info["nbytes"]:
            return f"{fname} has {size} bytes, the manifest says {info['nbytes']}"
    for ref, fname in sorted(referenced_files(m), key=str):
        if ref is not None and not store.is_file(store.join(save_dir, ref, fname)):
            return f"{ref}/{fname} (referenced) is missing"
    return None


def cmd_ls(args) -> int:
    """Every checkpoint of a save directory: its state is "damaged" (a file missing or of the
    wrong size; with --verify also a hash mismatch), "unverified" (its files are all there; only
    --verify reads them), "verified", "retired" (kept for the files later ones read) or
    "INCOMPLETE" (no manifest: an interrupted save); a manifest that cannot be read is "damaged"."""
    store, path = located_dir(args, args.path, "save directory")
    latest = commit.read_latest(path, store)
    found = commit.list_checkpoints(path, store)
    users = defaultdict(set)   # tag -> later checkpoints that read files there
    for tag, m, _ in found:
        for ref, _ in referenced_files(m) if m else ():
            if ref is not None:
                users[ref].add(tag)
    rows = []
    for tag, m, problem in found:
        pinned = None
        if m:
            refs = sorted({t for t, _ in referenced_files(m) if t})
            state, note = "unverified", f"reads from {', '.join(refs)}" if refs else ""
            damage = files_problem(store, path, tag, m)
            if damage is None and args.verify:
                boxed = sum(sb.box.numel * e.nbytes // max(e.numel, 1) for e in m.tensors.values() for sb in e.boxes)
                bar = LineBar(f"verify {tag}", boxed, show=not args.json)
                try:
                    verify_part(CheckpointReader(store.join(path, tag), manifest=m, store=store), progress=bar)
                    state = "verified"
                except AdaCheckError as e:
                    damage = str(e).splitlines()[0]
                finally:
                    bar.close()
            if damage is not None:
                state, note = "damaged", damage
        elif users.get(tag):
            state, note = "retired", f"holds files read by {', '.join(sorted(users[tag]))}"
            d = store.join(path, tag)
            pinned = sum(store.size(store.join(d, f)) for f in store.list(d) if f.endswith(".safetensors"))
        else:   # the note without the save directory's path, never cut inside the message
            where = store.join(path, "")
            note = str(problem)[len(where):] if str(problem).startswith(where) else str(problem)
            state = "INCOMPLETE" if isinstance(problem, NotFoundError) else "damaged"
        rows.append({"tag": tag, "latest": tag == latest, "state": state, "step": m.step if m else None,
                     "bytes": sum(i["nbytes"] for i in m.files.values()) if m else
                     (pinned if state == "retired" else None), "note": note})
    if args.json:
        print(json.dumps(rows, indent=1))
    elif rows:
        print(table([(r["tag"] + (" (latest)" if r["latest"] else ""), r["state"],
                      "-" if r["step"] is None else r["step"], "-" if r["bytes"] is None else human(r["bytes"]),
                      r["note"]) for r in rows], ["tag", "state", "step", "bytes", "note"]))
    else:
        print(f"no AdaCheck checkpoints in {args.path}")
    return 0 if rows and not any(r["state"] == "damaged" for r in rows) else 1


def cmd_prune(args) -> int:
    if args.keep_last is not None and args.keep_last < 1:
        print("adacheck prune: error: --keep-last must be >= 1 (the latest checkpoint is always kept)",
              file=sys.stderr)
        return 2
    if args.keep_last is None and args.older_than is None:
        print("adacheck prune: error: say what to keep: --keep-last K and/or --older-than AGE",
              file=sys.stderr)
        return 2
    store, path = located_dir(args, args.path, "save directory")
    latest = commit.read_latest(path, store)
    doomed = commit.choose_retired(path, keep_last=args.keep_last, older_than_s=args.older_than,
                                   protect=(latest,) if latest else (), store=store)
    # a live job's save in flight is never taken for leftovers: files newer than its last commit stay
    owner = lease.live(store, path)
    keep_after = None if owner is None else commit.newest_commit_time(path, store) or float("-inf")
    files = commit.collect_garbage(path, dry_run=True, retired=tuple(doomed), store=store, keep_after=keep_after)
    freed = sum(n for _, n in files)
    going = {f for f, _ in files}

    def staying(tag):
        """Bytes of ``tag``'s shard files that kept checkpoints still read (0: none stay)."""
        d = store.join(path, tag)
        return sum(store.size(store.join(d, f)) for f in store.list(d)
                   if f.endswith(".safetensors") and f"{tag}/{f}" not in going)

    stays = {t: n for t in doomed if (n := staying(t))}     # retired now
    earlier = {t: n for t, m, _ in commit.list_checkpoints(path, store)     # retired before
               if m is None and t not in doomed and (n := staying(t))}
    if args.json:
        print(json.dumps({"retire": doomed, "delete": [f for f, _ in files], "bytes": freed,
                          "retired_earlier_still_read": earlier, "dry_run": not args.yes}, indent=1))
    else:
        print(f"{'retiring' if args.yes else 'would retire'} {len(doomed)} checkpoint(s): "
              f"{', '.join(doomed) or '-'}")
        print(f"{'deleting' if args.yes else 'would delete'} {len(files)} shard file(s), {human(freed)}")
        if stays:
            print(f"  (files in {', '.join(stays)} that kept checkpoints still read stay: "
                  f"{human(sum(stays.values()))})")
        if owner is not None:
            print(f"  ({owner.owner()} owns this directory: files written since its last commit stay)")
        if earlier:
            print("  (retired earlier, files still read by kept checkpoints: "
                  f"{', '.join(f'{t} {human(n)}' for t, n in sorted(earlier.items()))})")
    if not args.yes:
        if not args.json:
            print("dry run: nothing deleted; run again with --yes to do it")
        return 0
    commit.retire(path, doomed, store)
    done = commit.collect_garbage(path, store=store, keep_after=keep_after)
    if not args.json:
        print(f"done: {human(sum(n for _, n in done))} freed")
    return 0


def memory_jobs(root: str, only=None) -> list:
    """What jobs keep in the memory tier under ``root``: per job (``only``: these), its checkpoint
    directories' memory copies (the directory each stands for, its newest checkpoint, bytes)."""
    from ..tiers.location import SOURCE_NAME
    from ..tiers.persist import held_in, newest_committed
    jobs = []
    for job in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        d = os.path.join(root, job)
        if not os.path.isdir(d) or (only and job not in only):
            continue
        dirs = []
        for key in sorted(os.listdir(d)):
            loc = os.path.join(d, key)
            try:
                source = open(os.path.join(loc, SOURCE_NAME)).read()
            except OSError:
                source = None
            newest = newest_committed(loc, LOCAL)
            count, size = held_in(loc)
            dirs.append({"for": source.split("|", 1)[-1] if source else None, "source": source,
                         "newest": newest[0] if newest else None, "checkpoints": count, "bytes": size})
        jobs.append({"job": job, "path": d, "bytes": sum(x["bytes"] for x in dirs), "checkpoint_dirs": dirs})
    return jobs


def cmd_clean(args) -> int:
    from ..tiers.location import memory_root
    root = args.memory_dir or memory_root(None)      # the flag, else $ADACHECK_MEMORY_DIR, else the default
    if not os.path.isdir(root):
        if args.json:
            print(json.dumps({"memory_dir": root, "jobs": [], "bytes": 0, "dry_run": not args.yes}, indent=1))
        else:
            print(f"{root}: no memory tier here (nothing to clean)")
        return 0
    jobs = memory_jobs(root, args.job)
    for j in jobs:
        for x in j["checkpoint_dirs"]:
            del x["source"], x["checkpoints"]
    total = sum(j["bytes"] for j in jobs)
    if args.json:
        print(json.dumps({"memory_dir": root, "jobs": jobs, "bytes": total, "dry_run": not args.yes}, indent=1))
    else:
        for j in jobs:
            print(f"{j['job']}: {human(j['bytes'])} in {j['path']}")
            for x in j["checkpoint_dirs"]:
                print(f"  for {x['for'] or '?'}: newest {x['newest'] or '-'}, {human(x['bytes'])}")
        print(f"{'removing' if args.yes else 'would remove'} {len(jobs)} job(s), {human(total)}")
    if not args.yes:
        if not args.json:
            print("dry run: nothing deleted; run again with --yes to do it (only for jobs that are over: a "
                  "running job's memory checkpoints are its newest state)")
        return 0
    for j in jobs:
        LOCAL.remove_tree(j["path"])
    return 0


def _diff_entry(ra, rb, name):
    ea, eb = ra.entry(name, whole=True), rb.entry(name, whole=True)     # with their boxes
    if (ea.dtype, ea.shape) != (eb.dtype, eb.shape):
        return f"{ea.dtype}{list(ea.shape)} -> {eb.dtype}{list(eb.shape)}", None
    if ea.derived is None and eb.derived is None and sorted((b.box, b.hash) for b in ea.boxes) == sorted(
            (b.box, b.hash) for b in eb.boxes) and len({b.box for b in ea.boxes}) == len(
            {b.hash for b in ea.boxes}):
        return None, 0.0   # same stored bytes (by hash): equal without reading
    a, b = ra.read(name), rb.read(name)
    d = (a.to(torch.float64) - b.to(torch.float64)).abs().max().item() if a.numel() else 0.0
    if d == 0.0 and not torch.equal(a, b):   # NaNs, or int64 beyond float64 precision
        d = float("nan")
    return (None, d) if d == 0.0 else ("values differ", d)


def cmd_diff(args) -> int:
    (sa, pa), (sb, pb) = located_dir(args, args.a), located_dir(args, args.b)
    da, db = resolve(pa, None, sa), resolve(pb, None, sb)
    ra = CheckpointReader(da, verify=not args.no_verify, store=sa)
    rb = CheckpointReader(db, verify=not args.no_verify, store=sb)
    na, nb = set(ra.manifest.tensors), set(rb.manifest.tensors)
    only_a, only_b, common = sorted(na - nb), sorted(nb - na), sorted(na & nb)
    changed, same = [], 0
    show = sys.stderr.isatty() and not args.json      # a bar of its own, as verify's: a core command
    for i, name in enumerate(common):
        what, d = _diff_entry(ra, rb, name)
        if what is None:
            same += 1
        else:
            changed.append((name, what, d))
        if show:
            sys.stderr.write(f"\rdiff {i + 1}/{len(common)} tensors")
    if show:
        sys.stderr.write("\n")
    if args.json:
        print(json.dumps({"a": da, "b": db, "only_a": only_a, "only_b": only_b, "unchanged": same,
                          "changed": [{"tensor": n, "what": w, "max_abs_diff": d} for n, w, d in changed]},
                         indent=1))
    else:
        print(f"a: {da}\nb: {db}")
        print(f"{same} tensor(s) equal, {len(changed)} differ, {len(only_a)} only in a, {len(only_b)} only in b")
        if changed:
            print()
            print(table([(n, w, "-" if d is None else f"{d:.6g}") for n, w, d in changed],
                        ["tensor", "difference", "max |a-b|"]))
        for label, names in (("only in a", only_a), ("only in b", only_b)):
            if names:
                print(f"\n{label}: " + ", ".join(names[:50]) + (" ..." if len(names) > 50 else ""))
    return 1 if (changed or only_a or only_b) else 0


def cmd_convert(args, rest) -> int:
    """``--to weights`` (the default from AdaCheck) is the core's; every other format is a converter
    an integration registered (:mod:`adacheck.cli.convert`), imported only when it is asked for."""
    from .convert import converter, export_weights
    _check_convert_args(args)
    conv, how = None, None
    if args.from_ != "adacheck":
        conv, how = converter(args.from_), "read"
    elif args.to == "adacheck":
        conv, how = _materialiser(args), "materialise"
    elif args.to != "weights":
        conv, how = converter(args.to), "write"
    own = argparse.ArgumentParser(prog=f"adacheck convert (--to/--from {conv.name})" if conv else "adacheck convert",
                                  add_help=False)
    if conv is not None:
        conv.add_arguments(own)
    if args.help:
        return _convert_help(conv)
    for k, v in vars(own.parse_args(rest)).items():
        setattr(args, k, v)
    progress = _ProgressBars(args)
    if how in ("read", "materialise"):
        try:
            out, what = getattr(conv, how)(args.src, args.out, args, progress)
        except NotImplementedError:
            raise ConfigError(f"the {conv.name} converter cannot {'read its format' if how == 'read' else 'replay deltas'}"
                              " (adacheck convert --help lists what each format does)") from None
        finally:
            progress.close()
        print(json.dumps({"source": args.src, "out": out}) if args.json else f"wrote {what} to {out}")
        return 0
    store, src = located(args, args.src)
    if how == "write" and store is not LOCAL:
        raise ConfigError(f"--to {args.to} reads a local checkpoint; --to weights reads {args.src} directly (or "
                          "copy the checkpoint directory to local disk first)")
    d = resolve(src, args.tag, store)
    _note_base_only(d, store, conv if how == "write" else None)
    if how == "write":
        try:
            out, what = conv.write(d, args.out, args, progress)
        finally:
            progress.close()
        print(json.dumps({"source": d, "out": out}) if args.json else f"wrote {what} to {out}")
        return 0
    if rest:
        raise ConfigError(f"options {rest} are not options of --to weights (see adacheck convert --help)")
    extra = model_config(args, store, d)
    try:
        res = export_weights(d, args.out, dtype=args.dtype or "model", max_shard_bytes=args.max_shard_size,
                             overwrite=args.overwrite, verify=not args.no_verify, progress=progress, source=store,
                             extra_files=extra)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(dict(res, source=d, out=os.path.abspath(args.out)), indent=1))
    else:
        print(f"wrote {res['tensors']} tensors ({human(res['bytes'])}, dtype {res['dtype']}) from {d} to "
              f"{os.path.abspath(args.out)}: {', '.join(res['files'])}")
        if "config.json" not in res["files"]:
            print("note: no config.json was found in the source or beside the checkpoint; from_pretrained needs "
                  "one: pass --config PATH (the model's config.json)")
    return 0


CONFIG_FILES = ("config.json", "generation_config.json")   # what from_pretrained reads beside the weights


def model_config(args, store: Storage, ckpt_dir: str) -> dict:
    """The Hugging Face config files to write beside exported weights (name -> bytes): from
    ``--config`` (a config.json, or a directory holding one: an error if there is none), else
    from SRC or the directory holding the checkpoint, where there is one (else none)."""
    if args.config:
        path = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
        if not os.path.isfile(path):
            raise ConfigError(f"--config {args.config}: no such file{' in it: config.json' if path != args.config else ''};"
                              " give the model's config.json or the directory that holds it")
        found = {"config.json": LOCAL.read_bytes(path)}
        extra = os.path.join(os.path.dirname(path), "generation_config.json")
        if os.path.isfile(extra):
            found["generation_config.json"] = LOCAL.read_bytes(extra)
        return found
    source_store, src = located(args, args.src)
    for where, s in ((src, source_store), (store.parent(ckpt_dir), store)):
        if s.is_file(s.join(where, "config.json")):
            return {name: s.read_bytes(s.join(where, name)) for name in CONFIG_FILES if s.is_file(s.join(where, name))}
    return {}


def _check_convert_args(args) -> None:
    """The direction (``--to`` defaults to ``weights`` from AdaCheck, ``adacheck`` into it), options
    that belong to another format, and an output that is a file or lies inside the source."""
    if args.to is None:
        args.to = "adacheck" if args.from_ != "adacheck" else "weights"
    if args.from_ != "adacheck" and args.to != "adacheck":
        raise ConfigError(f"--from {args.from_} converts into AdaCheck: use --to adacheck (or leave --to out)")
    if args.to != "weights":
        given = [flag for flag, v in (("--dtype", args.dtype), ("--max-shard-size", args.max_shard_size),
                                      ("--overwrite", args.overwrite), ("--config", args.config))
                 if v not in (None, False)]
        if given:
            raise ConfigError(f"{', '.join(given)} apply to --to weights only, not to "
                              f"{'--from ' + args.from_ if args.from_ != 'adacheck' else '--to ' + args.to}: "
                              "drop them (adacheck convert --to FORMAT --help lists that format's options)")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"the output {args.out} is a file; give a directory (it is created if missing)")
    if args.src and args.out and "://" not in args.src and not args.help:
        src, out = os.path.realpath(args.src), os.path.realpath(args.out)
        if out == src or out.startswith(src + os.sep):
            raise ConfigError(f"the output {args.out} is inside the source {args.src}: a conversion never writes "
                              "into the checkpoint it reads; choose an output directory outside it")


def _note_base_only(d: str, store: Storage, conv) -> None:
    """Say that the conversion holds the base's step when committed online steps follow it (not
    when ``conv``, the format written, materialises that framework's deltas itself)."""
    if not deltas.step_dirs(d, store):
        return
    m = CheckpointReader(d, verify=False, store=store).manifest
    dl = deltas.summary(d, m.step, int(m.topology.get("world_size", 1)), store, m.framework.get("generation"))
    if not dl["committed"] or (conv is not None and conv.framework == m.framework.get("name")):
        return
    sys.stderr.write(f"adacheck convert: note: {d} is the base (step {m.step}) of {dl['committed']} "
                     f"committed online steps (to step {dl['last']}); the conversion holds the "
                     "base's step. For the newest step make it a base first: DeepSpeed: adacheck "
                     "convert SRC NEW --to adacheck (replays the deltas); Megatron: run the "
                     "training script with --adacheck --load SRC --adacheck-convert-save NEW "
                     "[--ckpt-step N] (or Megatron-LM's --ckpt-convert-format torch_dist).\n")


class _ProgressBars:
    """``progress(done, total)`` for a conversion: bytes for ``--to weights``, else the phases of
    each run of ranks (from the moment they start); a new bar when the total changes.  Shown on a terminal
    (ADACHECK_PROGRESS=1 shows it anywhere, 0 nowhere), never with ``--json``."""

    def __init__(self, args):
        self.bytes = args.to == "weights"
        self.show = os.environ.get("ADACHECK_PROGRESS", "1" if sys.stderr.isatty() else "0") == "1" and not args.json
        self.bars = []

    def __call__(self, done, total) -> None:
        """``total`` None: ranks are starting (they import the framework and build an engine)."""
        if not self.show:
            return
        try:
            from tqdm import tqdm      # DeepSpeed's dependency; the core runs without it, with no bar
        except ImportError:
            return
        if not self.bars or self.bars[-1].total != total or done < self.bars[-1].n:
            if self.bars:
                self.bars[-1].close()
            desc = "convert: starting ranks" if total is None else "convert"
            self.bars.append(tqdm(total=total, desc=desc, file=sys.stderr, unit="B" if self.bytes else " phases",
                                  unit_scale=self.bytes, dynamic_ncols=True))
        self.bars[-1].update(done - self.bars[-1].n)

    def close(self) -> None:
        for b in self.bars:
            b.close()


def _materialiser(args):
    """The converter that replays the online deltas of the AdaCheck checkpoint ``args.src``."""
    from .convert import converter, registered
    store, src = located(args, args.src)
    if store is not LOCAL:
        raise ConfigError(f"replaying online deltas reads a local checkpoint: copy {args.src} to local disk first")
    d = resolve(src, args.tag)
    m = CheckpointReader(d, verify=False).manifest
    framework = m.framework.get("name")
    committed = deltas.summary(d, m.step, int(m.topology.get("world_size", 1)),
                               generation=m.framework.get("generation"))["committed"] if (
        m.step is not None and deltas.step_dirs(d)) else 0
    if not committed:
        raise NothingToDo(f"nothing to do: {d} has no committed online deltas, so it already is the state of "
                          f"its step ({m.step}) in one checkpoint; nothing was written to {args.out}")
    if framework is None:
        raise ConfigError(f"{d} does not say which framework saved it, so no converter can replay its deltas")
    if framework == "megatron":
        raise ConfigError("Megatron online deltas are materialised by the training script, which builds the "
                          "model and replays them with its optimizer: --adacheck --load SRC --adacheck-convert-save "
                          "NEW [--ckpt-step N]")
    names = sorted(registered(), key=lambda n: n != framework)    # the one named after it first
    for name in names:
        conv = converter(name)
        if conv.framework == framework:
            return conv
    raise ConfigError(f"no installed converter materialises {framework!r} checkpoints ({d})")


def _convert_help(conv) -> int:
    from .convert import registered
    print(CONVERT_USAGE)
    print("\nformats: weights (model.safetensors: full weights for inference and Hugging Face tools; the default), "
          + ", ".join(sorted(registered())) + ", and adacheck (from another format, or, from a DeepSpeed AdaCheck "
          "checkpoint with online deltas, one new base at the newest committed step)")
    if conv is not None:
        own = argparse.ArgumentParser(usage=argparse.SUPPRESS, add_help=False)
        conv.add_arguments(own)
        print(f"\n{conv.name}: {conv.summary}")
        if own._actions:
            print(own.format_help().replace("options:", f"{conv.name} options:", 1))
    else:
        print("\nadacheck convert --to FORMAT --help (or --from FORMAT --help) shows that format's own options.")
    return 0


CONVERT_USAGE = """usage: adacheck convert SRC OUT [--to FORMAT | --from FORMAT] [--tag TAG] [--no-verify] [--json]
                        [--dtype {model,fp32,bf16,fp16}] [--max-shard-size SIZE] [--overwrite] [format options]

Convert an AdaCheck checkpoint SRC into another format under OUT (--to), or a checkpoint of
another format into an AdaCheck checkpoint (--from).  --dtype, --max-shard-size (5GB = 5*10^9
bytes, 5GiB = 5*2^30) and --overwrite apply to --to weights only; OUT is never inside SRC."""
