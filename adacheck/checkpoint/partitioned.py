"""The steps of a save that differ with the partitioned exchange (``exchange: "partitioned"``,
:mod:`adacheck.plan.partition`): no rank gathers every rank's (box, hash) list; each tensor's
owner decides it, each rank writes its part of the tensor table and its rank file, and each rank
confirms the next rank's file.  :class:`~adacheck.checkpoint.saving.SavePipeline` calls these
where a save's exchange (chosen once, in ``prepare``) is the partitioned one."""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from ..errors import SaveWarning
from ..format.manifest import MANIFEST_NAME, PAGED_SINCE, file_name, meta_name, own_files, part_name, rank_file_name
from ..format.manifest_read import ranked_tables
from ..plan import partition
from ..plan.exchange import Comm, agree
from ..plan.planner import WritePlan
from ..storage import manifest_files
from .options import Caches, Options
from .reader import confirm_files
from .steps import Exchanged, Prepared, Written

VERSION = PAGED_SINCE      # the manifest's format: in parts


def ranges(ranks: List[int]) -> List[List[int]]:
    """Sorted ranks as [first, end) ranges: [0, 1, 2, 5] -> [[0, 3], [5, 6]]."""
    out: List[List[int]] = []
    for r in ranks:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


@dataclass
class Parts:
    """What :meth:`PartitionedSteps.write_parts` wrote on this rank (``mine``: its part, rank file and,
    on rank 0, meta file names, removed if the save fails) and, on rank 0, the manifest's tables
    as a reader sees them (``tables``: tensors, ranks, files, rank objects, layout; and ``index``)."""
    mine: Tuple[Optional[str], ...]
    tables: Optional[tuple] = None
    index: Optional[dict] = None


class PartitionedSteps:
    """The partitioned exchange's steps of a save for a job with these ``options`` and ``caches``;
    ``remove_mine(prepared, *names)`` removes this rank's files of a failed save."""

    def __init__(self, options: Options, caches: Caches, remove_mine: Callable[..., None]):
        self.options, self.caches, self.remove_mine = options, caches, remove_mine

    def exchange(self, comm: Comm, prepared: Prepared, t0: float) -> Exchanged:
        """Step 2: only rank 0's generation, reference, step and framework go to every rank (the
        (box, hash) lists go to their owners in the plan step)."""
        p = prepared.payload
        head = comm.broadcast_object({k: p[k] for k in ("generation", "previous", "step", "framework")})
        mine = dict({k: v for k, v in p.items() if k != "metas"}, step=head["step"], framework=head["framework"])
        nodes = self.nodes(comm, p["node"]) if self.options.copies > 1 else None
        return Exchanged([mine], head["generation"], head["previous"],
                         {"how": "partitioned", "seconds": time.perf_counter() - t0}, partitioned=True, nodes=nodes)

    def nodes(self, comm: Comm, mine: str) -> List[str]:
        """Every rank's node (the placement of copies on distinct nodes), gathered at the job's
        first such save and then kept: one reduction checks that no rank's node changed (or lost
        the list with its caches)."""
        known = self.caches.nodes.get(comm.world_size)
        if comm.any(known is None or known[comm.rank] != mine):
            known = self.caches.nodes[comm.world_size] = comm.all_gather_object(mine)
        return known

    def plan(self, comm: Comm, prepared: Prepared, exchanged: Exchanged, previous_of) -> WritePlan:
        """Step 3: this rank's writes and file, the entries of the tensors it owns (the part of
        the manifest it writes at the commit); on rank 0 also the warnings (warned there), the
        counts and the manifest's index."""
        t0, gen = time.perf_counter(), exchanged.generation
        placed, own, got, stats, held = partition.plan(
            comm, prepared.payload["metas"], gen, previous_of, self.options.copies, exchanged.nodes,
            self.caches.partitioned.setdefault(comm.world_size, partition.PartitionCache()), self.caches.plan,
            f"AdaCheck save of {prepared.ckpt_dir}")
        exchanged.stats.update(stats, seconds=exchanged.stats["seconds"] + time.perf_counter() - t0)
        writes = {comm.rank: tuple(placed.writes)} if placed.writes else {}
        files = {file_name(comm.rank, gen): {"writer": comm.rank, "nbytes": placed.nbytes}} if writes else {}
        if got is None:
            return WritePlan(tensors=own, writes=writes, files=files, warnings=(), stats={}, held=held)
        for w in got.warnings:
            warnings.warn(f"AdaCheck: {w}", SaveWarning, stacklevel=4)
        exchanged.index = {"generation": gen, "parts": comm.world_size, "ranks": comm.world_size,
                           "tensors": got.tensors, "meta": got.meta, "referenced": got.referenced,
                           "writers": ranges(got.writers)}      # meta: written to its file, then its hash
        return WritePlan(tensors=own, writes=writes, files=files, warnings=tuple(got.warnings), stats=got.stats,
                         held=held)

    def written(self, comm: Comm, my_file: Optional[str], size: int, tag: Optional[str]) -> Written:
        """Step 4's sizes: each rank's own is in its rank file; only their sum goes round."""
        return Written([], [], my_file, size, tag, comm.sum_each([size])[0])

    def write_parts(self, comm: Comm, prepared: Prepared, exchanged: Exchanged, plan: WritePlan,
                    written: Written) -> Parts:
        """Step 5, before the manifest: this rank confirms the next rank's file (no rank stats them
        all; a save directory that is not shared between nodes fails where the job crosses a node;
        a memory-tier save across nodes: the next rank on the node, whose directory is the node's
        own), then writes its part of the tensor table and its rank file (rank 0: the meta file);
        across nodes with peer copies its files travel to its partner."""
        store, ckpt_dir, gen, fsync = prepared.store, prepared.ckpt_dir, exchanged.generation, self.options.fsync
        mine = (part_name(gen, comm.rank), rank_file_name(gen, comm.rank), meta_name(gen) if comm.rank == 0 else None)
        p = prepared.payload
        tables = {"layout": p["layout"], "objects": p["rank_objects"],
                  "files": {written.my_file: {"writer": comm.rank, "nbytes": written.my_size}}
                  if written.my_file else {}, **({"node": p["node"]} if self.options.copies > 1 else {})}
        n, spread = comm.world_size, self.options.spread
        confirmer = (comm.rank - 1) % n if spread is None else spread.before(comm.rank)
        told = comm.all_to_all_bytes([json.dumps([written.my_file, written.my_size, written.my_tag]).encode()
                                      if written.my_file and dst == confirmer else None
                                      for dst in range(n)])
        nxt = [(json.loads(b), src) for src, b in enumerate(told) if b]

        def run():
            confirm_files(store, ckpt_dir, {f: {"writer": src, "nbytes": k, "tag": t} for (f, k, t), src in nxt})
            manifest_files.write_rank_file(ckpt_dir, gen, comm.rank, prepared.tag, plan.held or {}, tables, fsync,
                                           store)
            manifest_files.write_part(ckpt_dir, gen, comm.rank, prepared.tag, plan.tensors, fsync, store)
            if comm.rank == 0:      # what the index says of the tensors, bound by its hash
                return manifest_files.write_meta(ckpt_dir, gen, prepared.tag, exchanged.index["meta"], fsync, store)

        meta = agree(comm, f"AdaCheck save of {ckpt_dir} (manifest parts)", run,
                     on_failure=lambda: self.remove_mine(prepared, written.my_file, *mine))
        if spread is not None:      # its peer copies: each rank's files, to its partner on the next node
            agree(comm, f"AdaCheck save of {ckpt_dir} (copies to other nodes)",
                  lambda: spread.move_own(comm, ckpt_dir, prepared.tag, lambda r: own_files(gen, r)),
                  on_failure=lambda: self.remove_mine(prepared, written.my_file, *mine))
        if comm.rank != 0:
            return Parts(mine)
        # its tables as a reader sees them: each rank's read from its rank file if asked
        index, where = dict(exchanged.index, meta=meta), store.join(ckpt_dir, MANIFEST_NAME)
        return Parts(mine, ranked_tables(index, prepared.tag, VERSION, manifest_files.PartFiles(store, ckpt_dir),
                                         where), index)
