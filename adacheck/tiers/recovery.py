"""Recovery from the memory tier: what each node holds (:func:`holdings`), which node's copy a load
reads and what moves to the nodes that lack it (:func:`plan_recovery`, :func:`delta_moves`), and
the moves themselves (:func:`fetch`)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import OrderedDict
from typing import (Callable, Dict, List, NamedTuple, Optional, Sequence,
                    Tuple)

from ..storage import commit
from ..storage import manifest_files
from ..online import deltas
from ..errors import AdaCheckError, FormatError
from ..format.manifest import JOB_OBJECTS, RANK_OBJECT, meta_name, part_name, part_names, rank_file_name, referenced_files, writer_of
from ..format.manifest_read import parse
from ..storage.backends import LOCAL, Storage
from .peers import receive_file, shard_check, tagged_check, unpack_files
from .peers import NodeSpread, file_as_tensor, pack_step, receive_step

log = logging.getLogger("adacheck")


def _own_shards(m) -> set:
    """The shard files a manifest in parts names in its own directory (its writers')."""
    return {f for t, f in referenced_files(m) if t is None}


def holdings(mem: str) -> Dict[str, dict]:
    """What this node's memory holds of ``mem``: per checkpoint with a manifest, its step, the
    manifest's digest, the files present (name -> size) and, per stored region, (its copies'
    files, the ranks that held it); for :meth:`~adacheck.tiers.tiered.TieredLoader.choose_tier` across nodes."""
    out: Dict[str, dict] = {}
    if not os.path.isdir(mem):
        return out
    for tag in sorted(os.listdir(mem)):
        d = os.path.join(mem, tag)
        path = os.path.join(d, commit.MANIFEST_NAME)
        if not os.path.isfile(path):
            continue
        try:
            raw = LOCAL.read_bytes(path)
            digest = hashlib.sha256(raw).hexdigest()
            known = _KNOWN.get(digest)
            m = None if known is not None else parse(raw.decode("utf-8"), where=path,
                                                    open_part=manifest_files.PartFiles(LOCAL, d))
        except (AdaCheckError, UnicodeDecodeError, OSError) as e:
            log.warning("AdaCheck: the memory tier's %s is unreadable, not used: %s", path, e)
            continue
        if known is None:
            world = int(m.topology.get("world_size", 0))
            names = sorted(_own_shards(m)) + part_names(m) if m.index is not None else list(m.files)
            known = _Known(m.step if m.step is not None else -1, world, names)
            if m.index is None:     # one manifest.json: its regions and files are a function of its bytes
                groups, objects = _groups_of(m.tensors, tuple(range(world)))
                known = known._replace(nbytes={f: int(i["nbytes"]) for f, i in m.files.items()}, groups=sorted(groups),
                                       derived=any(e.derived is not None for e in m.tensors.values()),
                                       objects={k: sorted(v) for k, v in objects.items()})
                _KNOWN[digest] = known
                while len(_KNOWN) > _KNOWN_KEPT:
                    _KNOWN.popitem(last=False)
        else:
            _KNOWN.move_to_end(digest)
        world, names = known.world, known.names
        present = {f: os.path.getsize(os.path.join(d, f)) for f in names if os.path.isfile(os.path.join(d, f))}
        nbytes, groups, derived, objects = known.nbytes, known.groups, known.derived, known.objects or {}
        if m is not None and m.index is not None and int(m.topology.get("copies", 1)) > 1:
            # in parts, saved across nodes: what each rank needs, from the rank files here
            nbytes, groups, found = _needed_in_parts(m, d, present)
            derived, objects = False, {k: sorted(v) for k, v in found.items()}
        elif m is not None and m.index is not None:
            # a manifest in parts (saved on one node): complete when every file it names is here;
            # a node that lacks it receives all of them (its files' sizes are those here)
            nbytes, groups, derived = dict(present), [((f,), tuple(range(world))) for f in names], True
        out[tag] = {"step": known.step, "digest": digest, "present": present, "nbytes": nbytes, "groups": groups,
                    "world": world, "derived": derived, "objects": objects,
                    "chain": deltas.read_chain(d), "steps": _delta_steps(d, known.step)}
    return out


class _Known(NamedTuple):
    """What :func:`holdings` takes from a memory checkpoint's manifest (for one in parts: its step,
    world and files; the rest depends on the files here)."""
    step: int
    world: int
    names: list
    nbytes: Optional[dict] = None
    groups: Optional[list] = None
    derived: bool = False
    objects: Optional[dict] = None


# manifest.json's sha256 -> what holdings() takes from it, for a manifest in one file: every load
# with the memory tier asks each node's memory, which holds the same few checkpoints load after load
_KNOWN: "OrderedDict[str, _Known]" = OrderedDict()
_KNOWN_KEPT = 64


def _groups_of(tensors, everyone: Tuple[int, ...]) -> Tuple[set, Dict[int, set]]:
    """The stored regions of ``tensors`` as groups (the files of their copies, the ranks that held
    them; ``everyone`` for the tensors of the job's objects, which every rank reads), and per saving
    rank the files of its own objects' tensors, one tuple per region (other ranks may read those)."""
    regions: Dict[tuple, Tuple[set, set]] = {}
    for name, e in tensors.items():
        for sb in e.boxes:
            files, holders = regions.setdefault((name, sb.box), (set(), set()))
            files.add(sb.file)
            holders.update(everyone if name.startswith(JOB_OBJECTS) else sb.holders)
    groups, objects = set(), {}
    for (name, _), (files, holders) in regions.items():
        group = (tuple(sorted(files)), tuple(sorted(holders)))
        groups.add(group)
        if RANK_OBJECT.match(name):
            objects.setdefault(int(name[len("rank"):name.index("/")]), set()).add(group[0])
    return groups, objects


def _needed_in_parts(m, d: str, present: Dict[str, int]) -> Tuple[Dict[str, int], list, Dict[int, set]]:
    """For :func:`holdings`, a memory checkpoint in parts saved across nodes (each node's directory
    holds the manifest, its ranks' shard files, parts and rank files, and with ``peer`` copies of
    the previous node's): (the sizes of the files known here: a shard file's from its writer's
    rank file, a JSON file's as it is here; the groups (files, ranks that need one of them); per
    saving rank, the files of its objects: its rank file, and its object tensors' as far as known).
    Every rank needs its rank file and the meta file; the regions each rank held, one copy of each,
    as the rank files here say (the other nodes report the rest); a part only a load in another
    layout.  A rank file here that does not read is left out of ``present``."""
    g, ranks = m.index["generation"], int(m.index["ranks"])
    groups = {((meta_name(g),), tuple(range(ranks)))} | {((part_name(g, i),), ()) for i in range(m.index["parts"])}
    nbytes = {f: n for f, n in present.items() if f.endswith(".json")}
    objects: Dict[int, set] = {r: {(rank_file_name(g, r),)} for r in range(ranks)}
    for r in range(ranks):
        name = rank_file_name(g, r)
        groups.add(((name,), (r,)))
        if name not in present:
            continue
        try:
            table = m.ranks.get(r)
        except AdaCheckError as e:
            log.warning("AdaCheck: the memory tier's %s is unreadable, not used: %s", os.path.join(d, name), e)
            del present[name], nbytes[name]
            continue
        nbytes.update((f, int(info["nbytes"])) for f, info in table.files.items())
        found, its = _groups_of(table.tensors, (r,))
        groups |= found
        objects[r] |= its.get(r, set())
    return nbytes, sorted(groups), objects


_RECORD = re.compile(r"^rank(\d+)\.json$")


def _delta_steps(ckpt_dir: str, base_step: int) -> Dict[int, Tuple[int, int]]:
    """The online deltas a memory checkpoint holds, per rank with a record of step base+1: how many
    steps in a row from there (a chain is read up to its first gap) and their bytes.  A few numbers
    per rank, whatever the chain's length: every node's leader sends them to every rank."""
    out: Dict[int, Tuple[int, int]] = {}
    for s in deltas.step_dirs(ckpt_dir):
        if s <= base_step:
            continue
        d = deltas.step_dir(ckpt_dir, s)
        for name in os.listdir(d):
            m = _RECORD.match(name)
            if not m:
                continue
            r = int(m.group(1))
            n, size = out.get(r, (0, 0))
            if s == base_step + 1 + n:        # the next step of rank r's run from the base
                grads = os.path.join(d, f"rank{r}.safetensors")
                out[r] = (n + 1, size + os.path.getsize(os.path.join(d, name))
                          + (os.path.getsize(grads) if os.path.exists(grads) else 0))
    return out


def delta_moves(h: dict, reports: Sequence[Optional[dict]], key: Tuple[str, str], nodes: Sequence[str],
                 every: bool) -> List[Tuple[Optional[int], int, int, int, int]]:
    """The online deltas of the chosen checkpoint each node lacks, for :func:`plan_recovery`:
    (step, or None for the chain file; saving rank; from rank; to rank; its expected bytes).  A
    node needs the chains its ranks read: those of the ranks that shared a node with them when
    recorded (a chain kept per node: :class:`DeltaSpread`), or every rank's (``every``, or a chain
    not kept per node), up to the last step that some node holds for each of them."""
    held = {r: rep[key[0]] for r, rep in enumerate(reports)
            if rep and key[0] in rep and rep[key[0]]["digest"] == key[1]}
    info = next((x["chain"] for x in held.values() if x["chain"] is not None), None)
    if info is None:
        return []
    saved, world, base = info.get("nodes"), h["world"], h["step"]

    def chain_of(r: int, q: int) -> Tuple[int, int]:
        """(steps in a row, their bytes) of rank q's chain on the node led by rank r."""
        return held[r]["steps"].get(q, (0, 0)) if r in held else (0, 0)

    moves: List[Tuple[Optional[int], int, int, int, int]] = []
    for node in sorted(set(nodes), key=nodes.index):
        lead = nodes.index(node)
        mine = [r for r, n in enumerate(nodes) if n == node]
        if every or not saved or len(saved) != world:
            need = list(range(world))
        else:
            need = sorted({q for r in mine if r < world for q in range(world) if saved[q] == saved[r]})
        if lead not in held or held[lead]["chain"] is None:
            moves.append((None, 0, min(r for r in held if held[r]["chain"] is not None), lead, 0))
        source = {q: max(held, key=lambda r: (chain_of(r, q)[0], -r)) for q in need}
        upto = min((chain_of(source[q], q)[0] for q in need), default=0)
        for q in need:
            n, size = chain_of(source[q], q)
            moves += [(base + 1 + i, q, source[q], lead, size // max(n, 1))
                      for i in range(chain_of(lead, q)[0], upto)]
    return moves


def newer_in_memory(reports: Sequence[Optional[dict]], latests: Sequence[Optional[str]], store: Storage,
                    load_dir: str, plan: Callable) -> Tuple[str, Optional[dict]]:
    """Pure but for reading durable storage's ``latest``, on rank 0: ("memory" or "durable", the
    memory's plan) for a load without a tag.  The memory's candidate is the checkpoint its
    ``latest`` names (the newest save that moved ``latest``: it goes to memory first, also after
    a roll-back to an older tag), complete between the nodes' memories; if it is not, the newest
    complete one of no later step (``plan(tag, below)``: :func:`plan_recovery`); none if no memory
    holds it any more (nor without a ``latest``: the newest complete one).  Memory wins
    when durable storage's ``latest`` names a checkpoint the memory also holds (copied from it,
    so not newer) or one of no later step than the candidate's."""
    named = [t for t in latests if t is not None]
    latest_mem = max(sorted(set(named)), key=named.count) if named else None   # every node's, but a new one
    if latest_mem is None:
        chosen = plan(None)
    else:      # one no memory holds any more: durable storage's
        chosen = plan(latest_mem)
        steps = [rep[latest_mem]["step"] for rep in reports if rep and latest_mem in rep]
        if chosen is None and steps:
            chosen = plan(None, max(steps))
    if chosen is None:
        return "durable", None
    latest = commit.latest_or_none(load_dir, store) if store.is_dir(load_dir) else None
    if latest is None:
        return "memory", chosen
    d = store.join(load_dir, latest)
    try:      # its bytes once: the step, and the digest memory's copies are compared by
        raw = store.read_bytes(store.join(d, commit.MANIFEST_NAME))
        step = parse(raw.decode("utf-8"), where=d, open_part=manifest_files.PartFiles(store, d)).step
    except (AdaCheckError, OSError, UnicodeDecodeError):
        return "memory", chosen
    digest = hashlib.sha256(raw).hexdigest()
    copied = chosen["tag"] == latest_mem and any(rep and rep.get(latest, {}).get("digest") == digest for rep in reports)
    return ("memory", chosen) if copied or chosen["step"] >= (step if step is not None else -1) else ("durable", chosen)


def plan_recovery(reports: Sequence[Optional[dict]], nodes: Sequence[str], tag: Optional[str],
                  everything: bool = False, reads_objects_of: Optional[Sequence[Sequence[int]]] = None,
                  below: Optional[int] = None) -> Optional[dict]:
    """Pure, on rank 0: from each node leader's :func:`holdings` (``reports[r]``, None for other
    ranks) and the node of each rank now, the newest checkpoint (or ``tag``) that the nodes'
    memories hold complete between them: every stored region has a copy whose file is present,
    with its size, on some node.  Returns None, or {"tag", "step", "digest", "moves"}: the files
    (and manifest, as None) each node lacks, [(file or None, from rank, to rank)], so that every
    node then holds the manifest and a copy of every region its ranks held when saved (every
    region: with ``everything``, or when the job's world size is not the saving one's), and the
    objects (rank file, object tensors) of the saving ranks ``reads_objects_of[r]`` its rank r reads."""
    on = NodeSpread(tuple(nodes), False).by_node
    leaders = {n: ranks[0] for n, ranks in on.items()}
    seen: Dict[Tuple[str, str], dict] = {}
    has: Dict[Tuple[str, str], Dict[str, set]] = {}     # checkpoint -> file -> leaders holding it
    with_manifest: Dict[Tuple[str, str], List[int]] = {}
    for r, rep in enumerate(reports):       # each node's sizes and groups: the checkpoint's are all of them
        for t, h in (rep or {}).items():
            key = (t, h["digest"])
            if key not in seen:
                seen[key] = dict(h, nbytes=dict(h["nbytes"]), groups=set(map(tuple, h["groups"])), objects={})
            else:
                for f, n in h["nbytes"].items():
                    seen[key]["nbytes"].setdefault(f, n)
                seen[key]["groups"].update(map(tuple, h["groups"]))
            for k, files in h.get("objects", {}).items():
                seen[key]["objects"].setdefault(k, set()).update(map(tuple, files))
            with_manifest.setdefault(key, []).append(r)
    for r, rep in enumerate(reports):
        for t, h in (rep or {}).items():
            key = (t, h["digest"])
            for f, size in h["present"].items():
                if size == seen[key]["nbytes"].get(f):
                    has.setdefault(key, {}).setdefault(f, set()).add(r)
    best = None
    for key, h in seen.items():
        if (tag is not None and key[0] != tag) or (below is not None and h["step"] > below):
            continue
        held = has.get(key, {})
        if all(any(f in held for f in files) for files, _ in h["groups"]):
            if best is None or (h["step"], key) > (seen[best]["step"], best):
                best = key
    if best is None:
        return None
    h, held = seen[best], has.get(best, {})
    every = everything or h["world"] != len(nodes) or h["derived"]
    moves: List[Tuple[Optional[str], int, int]] = []
    for node in sorted(leaders, key=leaders.get):
        lead, mine = leaders[node], set(on[node])
        if lead not in with_manifest[best]:
            moves.append((None, with_manifest[best][0], lead))
        local = {f for f, rs in held.items() if lead in rs}
        needed = [files for files, holders in sorted(h["groups"]) if every or mine.intersection(holders)]
        if not every and reads_objects_of is not None:      # objects other saving ranks' files hold
            others = {k for r in mine for k in reads_objects_of[r]} - mine
            needed += [files for k in sorted(others) for files in sorted(h["objects"].get(k, ()))]
        for files in needed:
            if any(f in local for f in files) or not any(f in held for f in files):
                continue
            # the copy its own ranks wrote when saved, where there is one: the peer copy of a lost node
            f = min((f for f in files if f in held), key=lambda f: (writer_of(f) not in mine, f))
            moves.append((f, min(held[f]), lead))
            local.add(f)
    return {"tag": best[0], "step": h["step"], "digest": best[1], "moves": moves, "nbytes": h["nbytes"],
            "deltas": delta_moves(h, reports, best, nodes, every)}


def fetch(comm, ckpt_dir: str, plan: dict) -> int:
    """Collective: the moves of :func:`plan_recovery` into each node's ``ckpt_dir``; a received
    manifest must hash to the agreed digest, a received shard be what that manifest says (see
    :func:`receive_file`); the manifest is written last.  A failure is raised once every move is
    done (Comm.transfer), and then no manifest is written.  Returns the bytes received here."""
    moves, digest, steps = plan["moves"], plan["digest"], plan.get("deltas", [])
    state = {"manifest": None, "raw": None}

    def manifest():
        if state["manifest"] is None:
            state["manifest"] = parse(LOCAL.read_bytes(os.path.join(ckpt_dir, commit.MANIFEST_NAME)).decode("utf-8"),
                                      where=ckpt_dir)
        return state["manifest"]

    def read(i):
        if i >= len(moves):
            step, rank = steps[i - len(moves)][:2]
            if step is None:
                return LOCAL.read_bytes(os.path.join(deltas.deltas_dir(ckpt_dir), deltas.CHAIN))
            block = pack_step(ckpt_dir, step, rank)
            if block is None:
                raise FormatError(f"{ckpt_dir} has no record of step {step} for rank {rank} to send")
            return block
        return file_as_tensor(os.path.join(ckpt_dir, moves[i][0] or commit.MANIFEST_NAME))

    def deliver(i, data):
        if i >= len(moves):
            step, rank = steps[i - len(moves)][:2]
            if data is None:
                raise FormatError(f"the online deltas of {plan['tag']} (step {step}) could not be read on the node "
                                  "that holds them")
            if step is not None:
                receive_step(ckpt_dir, step, rank, unpack_files(data), f"{plan['tag']} from a peer")
                return
            try:
                info = json.loads(bytes(data).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                info = None
            if not isinstance(info, dict):
                raise FormatError(f"the chain file of {plan['tag']} a peer sent is not a JSON object: refused")
            deltas.write_chain(ckpt_dir, info, fsync=False)
            return
        fname = moves[i][0]
        if fname is None:
            raw = None if data is None else bytes(data)
            if raw is None or hashlib.sha256(raw).hexdigest() != digest:
                raise FormatError(f"the manifest of {plan['tag']} a peer sent is not the one agreed on: refused")
            state["manifest"], state["raw"] = parse(raw.decode("utf-8"), where=f"{plan['tag']} from a peer"), raw
            return
        m = manifest()
        if m.index is not None:       # in parts: its JSON files check themselves when read
            shards = _own_shards(m)
            if fname not in shards and fname not in part_names(m):
                raise FormatError(f"a peer sent {fname!r}, which the manifest of {plan['tag']} does not name: refused")
            receive_file(ckpt_dir, fname, data, plan["nbytes"].get(fname, len(data) if data is not None else 0),
                         by="the node that sent it", check=tagged_check(m.tag, fname) if fname in shards else None)
            return
        if fname not in m.files:
            raise FormatError(f"a peer sent {fname!r}, which the manifest of {plan['tag']} does not list: refused")
        receive_file(ckpt_dir, fname, data, int(m.files[fname]["nbytes"]), check=shard_check(m, fname))

    got = comm.transfer([(src, dst) for _, src, dst in moves] + [(src, dst) for _, _, src, dst, _ in steps],
                        read, deliver, sizes=[plan["nbytes"].get(f, 0) if f else 0 for f, _, _ in moves]
                        + [n for *_, n in steps])
    if state["raw"] is not None:
        LOCAL.write_atomic(os.path.join(ckpt_dir, commit.MANIFEST_NAME), state["raw"], fsync=False)
    return got
