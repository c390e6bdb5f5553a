"""Simulation: what one save costs each rank at 1,024-16,384 ranks, with AdaCheck's real code and
no training.

For a synthetic Megatron layout of a real model (the distributed optimizer, ZeRO-1 style: bf16
weights replicated over data parallelism, fp32 main weights and Adam moments split over it in
Megatron's buckets), every rank's shard list is built the way adacheck_megatron describes it
(``adacheck.format.boxes.flat_pieces`` cuts each rank's flat range into boxes).  Then, per (model, ranks):

The top-level fields are what AdaCheck's default exchange (``"auto"``: partitioned from 32 ranks
on) costs a rank at these sizes; ``ring`` holds the same for the ring, with its whole-job plan on
every rank (``exchange: "ring"``, and what every size ran before the partitioned exchange):

  exchange                  "partitioned"
  plan_seconds_per_rank     the decisions partitioned by tensor (``planner.route`` to each
                            tensor's owner, ``planner.decide`` there; equal to the whole plan's)
                            at a later save (each owner's PlanCache from the first; new hashes),
                            mean over the job's ranks; ``partitioned`` has the busiest owner's
  exchange_bytes_per_rank   the hash bytes a rank receives (mean; ``partitioned``: the busiest
                            owner's, and what a rank sends)
  exchange_rounds           two all-to-alls
  manifest_bytes_read_per_rank   what a rank reads to load the layout it saved: the root and its
                            own rank file (format 6, the real serialisers' bytes)
  max_over_mean_bytes_written    the busiest writer over the mean, writers chosen per holder set
                            (``planner.place_by_group``, no global view)
  stored_over_unique        bytes stored over each distinct box once (the whole plan's, which
                            the partitioned decisions equal: tests/test_partition.py)
  partitioned               more of the partitioned exchange: the busiest owner; ``format4``, the
                            manifest format before (the root with every rank's tables and the
                            parts that list the rank's tensors); ``..._derived_weights``: a
                            load that rebuilds bf16 weights derived from the fp32 main weights
                            (Megatron with --no-load-optim into a job without the distributed
                            optimizer: a load of the main weights, or of the weights only into
                            the distributed optimizer, leaves that to the framework), which
                            reads their parts too; ``..._other_layout``: a load in another
                            layout (half the data-parallel size), which reads (format 6, with
                            the real reader) the header of each part that lists a tensor it
                            holds, that tensor's entry and the pages that meet its regions
                            (``format5``: those parts whole), against
                            ``manifest_bytes_needed_per_rank_other_layout``, the entries of the
                            boxes it needs (two saving ranks' rank files);
                            ``rank0_gather_bytes``: what rank 0 receives once per save for the
                            manifest (``partition.gather``: each owner's counts, warnings and
                            meta entries, as long as they are), against
                            ``rank0_gather_bytes_padded``, a gather of objects that pads each to
                            the longest (what it was)
  ring                      ``plan_seconds_per_rank``: ``planner.plan_save`` as every rank runs
                            it (over the whole job's shards; run for ``--sample-stages`` pipeline
                            stages, all their ranks, scaled by the number of stages), and
                            ``first_plan_seconds_per_rank`` for the first save;
                            ``exchange_bytes_per_rank``: what a rank receives in the ring of a
                            later save (structures cached: hashes only), from
                            ``checkpoint.exchange_blob`` of sampled ranks
                            (``first_exchange_bytes_per_rank`` with the structures);
                            ``exchange_rounds``: its N-1 sequential steps and the digests'
                            all-gather; ``manifest_bytes_read_per_rank``: its one manifest,
                            which every rank reads; ``max_over_mean_bytes_written``: its greedy
                            placement over the whole job
  projection                save seconds = max(busiest rank's bytes / per-rank share of node
                            storage bandwidth, all bytes / file system bandwidth), AdaCheck
                            (the ring's greedy placement) against native DeepSpeed
                            (data-parallel rank 0 writes the weights); the busiest owner's
                            partitioned decisions

Bandwidths are assumptions, given as flags (defaults: 8 ranks per node sharing
``--node-gbps`` of local NVMe writes, ``--fs-gbps`` of aggregate parallel file system
writes); no figure here was measured on such a system.

    .venv/bin/python scripts/simulate_scale.py --model gpt3-175b --ranks 1024 4096 16384 --json OUT
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from adacheck.format import manifest as mf  # noqa: E402
from adacheck.format import manifest_read as mf_read  # noqa: E402
from adacheck.plan import planner  # noqa: E402
from adacheck.gcpause import paused  # noqa: E402
from adacheck.format.boxes import flat_pieces, row_chunks  # noqa: E402
from adacheck.format.hashing import owner_of as hash_owner  # noqa: E402
from adacheck.checkpoint import exchange_blob, structure_of  # noqa: E402
from adacheck.plan.partition import cut_to  # noqa: E402
from adacheck.types import Box, Manifest, ShardMeta  # noqa: E402


@dataclass(frozen=True)
class Param:
    name: str
    shape: Tuple[int, ...]
    tp_dim: Optional[int]          # split over tensor parallelism along this dim (None: replicated)
    expert: bool = False           # an expert's weight (expert parallelism)


@dataclass(frozen=True)
class Model:
    name: str
    tp: int
    pp: int
    ep: int
    layers: int
    hidden: int
    ffn: int
    vocab: int
    qkv: int                       # rows of the fused QKV weight
    gated: bool                    # SwiGLU: fc1 has 2 * ffn rows
    bias: bool
    experts: int = 0
    expert_ffn: int = 0
    shared_expert: bool = False
    positions: int = 0             # learned position embeddings (rows)


MODELS = {
    # GPT-3 175B: 96 layers, hidden 12288, 96 heads, seq 2048, vocab 50257 padded to 51200
    "gpt3-175b": Model("gpt3-175b", tp=8, pp=16, ep=1, layers=96, hidden=12288, ffn=4 * 12288, vocab=51200,
                       qkv=3 * 12288, gated=False, bias=True, positions=2048),
    # Llama-3 405B: 126 layers, hidden 16384, 128 heads / 8 KV heads of 128, FFN 53248, vocab 128256
    "llama3-405b": Model("llama3-405b", tp=8, pp=16, ep=1, layers=126, hidden=16384, ffn=53248, vocab=128256,
                         qkv=(128 + 2 * 8) * 128, gated=True, bias=False),
    # an MoE model shaped like DeepSeek-V3 (simplified attention): 64 layers, hidden 7168, 256
    # routed experts of FFN 2048 and one shared expert; TP=1, PP=16, EP=64
    "moe": Model("moe", tp=1, pp=16, ep=64, layers=64, hidden=7168, ffn=18432, vocab=129280, qkv=3 * 7168,
                 gated=True, bias=False, experts=256, expert_ffn=2048, shared_expert=True),
}
BUCKET = 40_000_000      # Megatron-LM's DDP bucket size (elements; --ddp-bucket-size)


def stage_params(m: Model, stage: int) -> List[Param]:
    """The parameters of pipeline stage ``stage`` (global shapes)."""
    per, extra = divmod(m.layers, m.pp)
    first = stage * per + min(stage, extra)
    h, out = m.hidden, []
    if stage == 0:
        out.append(Param("embedding.word_embeddings.weight", (m.vocab, h), 0))
        if m.positions:
            out.append(Param("embedding.position_embeddings.weight", (m.positions, h), None))
    for layer in range(first, first + per + (stage < extra)):
        p = f"decoder.layers.{layer}."
        out += [Param(p + "input_layernorm.weight", (h,), None),
                Param(p + "self_attention.linear_qkv.weight", (m.qkv, h), 0),
                Param(p + "self_attention.linear_proj.weight", (h, h), 1),
                Param(p + "pre_mlp_layernorm.weight", (h,), None)]
        if m.bias:
            out += [Param(p + "input_layernorm.bias", (h,), None), Param(p + "self_attention.linear_qkv.bias", (m.qkv,), 0),
                    Param(p + "self_attention.linear_proj.bias", (h,), None),
                    Param(p + "pre_mlp_layernorm.bias", (h,), None)]
        mult = 2 if m.gated else 1
        if m.experts:
            out.append(Param(p + "mlp.router.weight", (m.experts, h), None))
            for e in range(m.experts):
                q = f"{p}mlp.experts.{e}."
                out += [Param(q + "linear_fc1.weight", (mult * m.expert_ffn, h), None, expert=True),
                        Param(q + "linear_fc2.weight", (h, m.expert_ffn), None, expert=True)]
            if m.shared_expert:
                out += [Param(p + "mlp.shared_experts.linear_fc1.weight", (mult * m.expert_ffn, h), 0),
                        Param(p + "mlp.shared_experts.linear_fc2.weight", (h, m.expert_ffn), 1)]
        else:
            out += [Param(p + "mlp.linear_fc1.weight", (mult * m.ffn, h), 0),
                    Param(p + "mlp.linear_fc2.weight", (h, m.ffn), 1)]
            if m.bias:
                out += [Param(p + "mlp.linear_fc1.bias", (mult * m.ffn,), 0), Param(p + "mlp.linear_fc2.bias", (h,), None)]
    if stage == m.pp - 1:
        out += [Param("decoder.final_layernorm.weight", (h,), None), Param("output_layer.weight", (m.vocab, h), 0)]
        if m.bias:
            out.append(Param("decoder.final_layernorm.bias", (h,), None))
    return out


def local_box(p: Param, tp_rank: int, tp: int) -> Box:
    offsets, lengths = [0] * len(p.shape), list(p.shape)
    if p.tp_dim is not None and tp > 1:
        lengths[p.tp_dim] = p.shape[p.tp_dim] // tp
        offsets[p.tp_dim] = tp_rank * lengths[p.tp_dim]
    return Box(tuple(offsets), tuple(lengths))


def numel(lengths) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n


def hash_of(*key) -> str:
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()


STATES = (("master", "float32", "param"), ("optim", "float32", "exp_avg"), ("optim", "float32", "exp_avg_sq"))


def rank_metas(m: Model, ranks: int, stage: int, tp_rank: int, dp_rank: int, params: List[Param], salt: int,
               chunk: int = 64 << 20):
    """One rank's shard list: its bf16 weights (replicas over data parallelism; expert weights
    over the expert-data-parallel group), and the fp32 main weights and moments of its ranges of
    Megatron's buckets (dense buckets split over DP, expert buckets over DP / EP); every box cut
    into row chunks of at most ``chunk`` bytes, as a save does (``hash_chunk_bytes``)."""
    dp = ranks // (m.tp * m.pp)
    edp, ep_rank = dp // m.ep, dp_rank % m.ep
    metas = []
    mine = []                      # (param, local box) this rank's model chunk holds
    for p in params:
        if p.expert:
            e = int(p.name.split(".experts.")[1].split(".")[0])
            if e % m.ep != ep_rank:
                continue
        box = local_box(p, tp_rank, m.tp)
        mine.append((p, box))
        for c in row_chunks(box, 2, chunk):
            metas.append(ShardMeta(f"model/{p.name}", "model", "bfloat16", p.shape, c,
                                   hash_of(p.name, c.offsets, salt)))
    for expert_group in (False, True):
        group = [(p, b) for p, b in mine if p.expert == expert_group]
        size, index = (edp, dp_rank // m.ep) if expert_group else (dp, dp_rank)
        if not group or size < 1:
            continue
        bucket, total = [], 0
        for i, (p, b) in enumerate(group + [(None, None)]):
            if p is not None:
                bucket.append((p, b, total))
                total += numel(b.lengths)
            if p is None or total >= BUCKET:
                padded = -(-total // size) * size
                lo, hi = index * padded // size, (index + 1) * padded // size
                for q, qb, at in bucket:
                    start, stop = max(lo, at), min(hi, at + numel(qb.lengths))
                    if stop <= start:
                        continue
                    for kind, dtype, state in STATES:
                        name = f"{kind}/{state}.{q.name}"
                        for pb, _ in flat_pieces(qb, start - at, stop - at):
                            for c in row_chunks(pb, 4, chunk):
                                metas.append(ShardMeta(name, kind, dtype, q.shape, c,
                                                       hash_of(name, c.offsets, salt)))
                bucket, total = [], 0
    return metas


def rank_coords(m: Model, ranks: int, r: int) -> Tuple[int, int, int]:
    """(pipeline stage, tensor-parallel rank, data-parallel rank) of global rank r (Megatron's
    order: TP fastest, then DP, then PP)."""
    dp = ranks // (m.tp * m.pp)
    return r // (m.tp * dp), r % m.tp, (r // m.tp) % dp


def payload(metas, r: int, m: Model, ranks: int) -> dict:
    """A rank's save payload as Checkpointer.prepare makes it (small objects: an RNG state and
    the layout; rank 0 also carries the common objects)."""
    stage, tp_rank, dp_rank = rank_coords(m, ranks, r)
    layout = {"tp": m.tp, "pp": m.pp, "dp": ranks // (m.tp * m.pp), "ep": m.ep,
              "tp_rank": tp_rank, "pp_rank": stage, "dp_rank": dp_rank}
    return {"metas": metas, "objects": {"iteration": 1000, "args": {}} if r == 0 else None,
            "rank_objects": {"rng": hash_of("rng", r) * 8}, "layout": layout, "generation": None,
            "previous": None, "step": 1000, "node": f"node{r // 8:05d}",
            "framework": {"name": "megatron", "layout": {"tp": m.tp, "pp": m.pp, "ep": m.ep}}}


def digests(e):
    """Entry ``e`` with its hashes as a manifest holds them (the prefix of the digest's name)."""
    if e.derived is not None:
        return replace(e, derived=replace(e.derived, boxes=tuple((b, "xxh3_128:" + h) for b, h in e.derived.boxes)))
    return replace(e, boxes=tuple(replace(sb, hash="xxh3_128:" + sb.hash) for sb in e.boxes))


class InMemory:
    """Part files held in memory, read whole or by range as manifest_files.PartFiles reads them from disk."""

    def __init__(self, files: dict):
        self.files = files

    def __call__(self, name: str) -> bytes:
        return self.files[name]

    def read_range(self, name: str, start: int, size: int) -> bytes:
        return self.files[name][start:start + size]


def simulate(m: Model, ranks: int, sample_stages: List[int], a) -> dict:
    if ranks % (m.tp * m.pp) or (ranks // (m.tp * m.pp)) % m.ep:
        raise SystemExit(f"{m.name}: {ranks} ranks do not divide into TP={m.tp} x PP={m.pp} x DP (a multiple of EP={m.ep})")
    dp = ranks // (m.tp * m.pp)
    per_stage = m.tp * dp
    sampled, stage_of, unique = [], [], {}
    first_bytes = later_bytes = 0.0
    t_build = time.perf_counter()
    for s in sample_stages:
        params = stage_params(m, s)
        for tp_rank in range(m.tp):
            for dp_rank in range(dp):
                metas = rank_metas(m, ranks, s, tp_rank, dp_rank, params, salt=1, chunk=a.chunk_bytes)
                sampled.append(metas)
                stage_of.append(s)
        for p in params:
            unique[p.name] = numel(p.shape) * (2 + 4 * len(STATES))
    build_s = time.perf_counter() - t_build
    # the exchange: blobs of a sample of ranks (every rank of a stage is alike but its hashes)
    probe = list(range(0, len(sampled), max(1, len(sampled) // 16)))
    for i in probe:
        r = sample_stages[i // per_stage] * per_stage + i % per_stage
        pl = payload(sampled[i], r, m, ranks)
        structure, digest = structure_of(pl)
        first_bytes += len(exchange_blob(pl, digest, structure))
        later_bytes += len(exchange_blob(pl, digest, None))
    mean_first, mean_later = first_bytes / len(probe), later_bytes / len(probe)
    # the plan every rank computes today, over the sampled stages' ranks, scaled to all stages
    gc.collect()
    cache = planner.PlanCache()     # (a job's: kept from one checkpoint to the next)
    t = time.perf_counter()
    plan = planner.plan_save(sampled, cache=cache)
    first_plan_s = time.perf_counter() - t
    # the next checkpoint: the same boxes with new hashes (what a later save plans)
    later = [[replace(x, hash=hash_of(x.hash, 2)) for x in metas] for metas in sampled]
    gc.collect()
    t = time.perf_counter()
    planner.plan_save(later, cache=cache)
    plan_s = time.perf_counter() - t
    # decisions partitioned by tensor (planner.route / decide, the same outcome): what each
    # owner decides and receives (hashes of a later save; its PlanCache from the first save),
    # over the sampled stages' tensors, the owners being the job's N ranks
    routed, routed_later = planner.route(sampled, ranks), planner.route(later, ranks)
    del later
    decide_s, received, to_rank0 = [], [], []
    with paused():      # (as plan_save runs)
        for (by_name, sources), (later_by_name, later_sources) in zip(routed, routed_later):
            if not by_name:
                continue
            owner_cache = planner.PlanCache()
            planner.decide(by_name, None, 1, owner_cache, source_of=sources.get)
            t = time.perf_counter()
            got = planner.decide(later_by_name, None, 1, owner_cache, source_of=later_sources.get)
            decide_s.append(time.perf_counter() - t)
            received.append(sum(len(x.hash) + 3 for held in by_name.values() for _, x in held))
            # what this owner sends rank 0 for the manifest (partition.gather: counts, warnings,
            # the meta entries of its tensors; its bytes and file are a few digits more)
            to_rank0.append(len(json.dumps((got.warnings, got.held, got.logical, 0, 0, 10 ** 12, True,
                                            len(got.tensors), mf.tensor_meta(got.tensors), []),
                                           separators=(",", ":"))))
    idle = len(json.dumps(([], 0, 0, 0, 0, 10 ** 12, True, 0, {}, []), separators=(",", ":")))
    sent = [sum(len(x.hash) + 3 for x in metas) for metas in sampled]
    del routed, routed_later
    # writers chosen per holder set (planner.place_by_group), against the whole plan's greedy
    items = planner.decide(planner.group_by_tensor(sampled), None, 1, planner.PlanCache()).items
    _, by_group = planner.place_by_group(items, len(sampled))
    grouped_max = max(by_group.values())
    del items
    man = Manifest(format_version=mf.FORMAT_VERSION, tag="iter_0001000",
                   step=1000, framework={"name": "megatron"}, topology={"world_size": ranks},
                   tensors=plan.tensors, objects={"iteration": 1000},
                   rank_objects=tuple({"rng": hash_of("rng", r) * 8} for r in range(len(sampled))),
                   layout={"ranks": [payload([], r, m, ranks)["layout"] for r in range(len(sampled))]},
                   files=plan.files, stats=plan.stats)
    manifest_sampled = len(mf.dumps(man).encode("utf-8"))
    scale = m.pp / len(sample_stages)
    # the same manifest in parts (format 4, as the partitioned exchange writes it): a part per
    # rank of the job, each tensor in the part its name hashes to; a rank that loads reads the
    # root (the per-rank tables and the parts' hashes) and the parts that list its tensors
    by_part = {}
    for name, e in plan.tensors.items():
        by_part.setdefault(hash_owner(name, ranks), {})[name] = e
    part_size = {i: len(mf.part_bytes(man.tag, i, t)) * scale for i, t in by_part.items()}
    digest = "xxh3_128:" + "0" * 32
    root = replace(man, tensors={}, index={"generation": 0, "parts": ranks, "hashes": [None], "tensors": 0,
                                           "referenced": []})
    root_bytes = (len(mf.dumps(root).encode("utf-8")) * scale + (len(digest) + 3) * ranks)
    part_reads = [root_bytes + sum(part_size.get(i, 0) for i in {hash_owner(x.name, ranks) for x in metas})
                  for metas in sampled]
    # format 6 (what the partitioned exchange writes now): the same parts, each tensor's boxes in
    # pages; a load in another layout reads, with the real reader (manifest_read.PartedTensors.region),
    # the header of each part that lists a tensor it needs and the pages that meet its region
    # (the simulation's hashes written as the reader checks them: "xxh3_128:" and 32 hex digits)
    by_part = {i: {n: digests(e) for n, e in t.items()} for i, t in by_part.items()}
    part5_size = {i: len(mf.part_bytes(man.tag, i, t, 0)) * scale for i, t in by_part.items()}
    paged = {mf.part_name(0, i): mf.part_bytes(man.tag, i, t, 0, paged=True) for i, t in by_part.items()}
    del by_part
    # format 5, as the partitioned exchange writes it now: the root holds no per-rank table; a rank
    # that loads the layout it saved reads the root and its own rank file (its layout, objects and
    # file, and the entries of its tensors cut down to its boxes, as partition.tell_holders sends them)
    root5 = replace(man, format_version=mf.RANKED_SINCE, tensors={}, rank_objects=(), layout={}, files={},
                    stats={k: v for k, v in plan.stats.items() if k != "per_rank_bytes"},
                    index={"generation": 0, "parts": ranks, "ranks": ranks, "tensors": round(len(plan.tensors) * scale),
                           "meta": digest, "referenced": [], "writers": [[0, ranks]]})
    root5_bytes = len(mf.dumps(root5).encode("utf-8"))
    # (the meta file: read by a load that asks of a tensor it did not hold, as DeepSpeed's name checks do)
    meta_file_bytes = round(len(mf.meta_bytes(man.tag, 0, mf.tensor_meta(plan.tensors))) * scale)
    rank_reads, derived_reads, other_reads, other5_reads, other_needed = [], [], [], [], []
    for i in probe:
        boxes = {}
        for x in sampled[i]:
            boxes.setdefault(x.name, []).append(x.box)
        held = mf.tensors_json({name: cut_to(plan.tensors[name], bs, i) for name, bs in boxes.items()})
        tables = {"layout": man.layout["ranks"][i], "objects": man.rank_objects[i],
                  "files": {f: info for f, info in plan.files.items() if info["writer"] == i}}
        rank_reads.append(root5_bytes + len(mf.rank_file_bytes(man.tag, 0, i, held, tables)))
        # with its bf16 weights derived from the fp32 main weights (adacheck_megatron proves the cast
        # where it holds): the parts that list their sources too (every data-parallel rank's box)
        sources = {hash_owner("master/param." + n[len("model/"):], ranks) for n in boxes if n.startswith("model/")}
        derived_reads.append(rank_reads[-1] + sum(part_size.get(p, 0) for p in sources))
        # a load in another layout (e.g. half the data-parallel size) reads the parts of every tensor
        # it holds, each tensor's entry whole (every box of it in the job); against the entries of
        # the boxes such a rank needs: about two saving ranks' rank files' worth
        other5_reads.append(root5_bytes + sum(part5_size.get(p, 0) for p in {hash_owner(n, ranks) for n in boxes}))
        other_needed.append(root5_bytes + 2 * (rank_reads[-1] - root5_bytes))
        # (format 6: this rank and the next data-parallel rank's boxes, one rank's at half the size)
        nxt = i + 1 if (i % dp) + 1 < dp else i - 1
        loaded = sampled[i] + (sampled[nxt] if nxt >= 0 else [])
        tensors = mf_read.ranked_tables(root5.index, man.tag, mf.PAGED_SINCE, InMemory(paged), "simulated")[0]
        for x in loaded:
            tensors.region(x.name, x.box)
        # (a part's header lists the tensors of every stage that hash to it: those of the stages not
        # sampled are counted as the sampled others, scaled as the parts are)
        needed = {x.name for x in loaded}
        heads = estimate = 0
        for p in {hash_owner(n, ranks) for n in needed}:
            text = paged[mf.part_name(0, p)]
            head = text[:text.index(b"\n") + 1]
            ours = sum(len(json.dumps({n: e}, separators=(",", ":")))
                       for n, e in json.loads(head)["tensors"].items() if n in needed)
            heads += len(head)
            estimate += ours + (len(head) - ours) * scale
        other_reads.append(root5_bytes + tensors.bytes_read - heads + estimate)
    written = [0] * len(sampled)
    for f, info in plan.files.items():
        written[info["writer"]] += info["nbytes"]
    all_unique = sum(numel(p.shape) * (2 + 4 * len(STATES)) for s in range(m.pp) for p in stage_params(m, s))
    sampled_unique = sum(unique.values())
    stored = plan.stats["stored_bytes"]
    max_written = max(written)
    mean_written = stored * (all_unique / sampled_unique) / ranks
    # native DeepSpeed (ZeRO-1, bf16): data-parallel rank 0 of each (TP, PP) writes the bf16
    # weights, every rank its optimizer partition (fp32 main weights and two moments)
    opt_share = {}
    for i, metas in enumerate(sampled):
        opt_share[i] = sum(numel(x.box.lengths) * 4 for x in metas if x.kind != "model")
    weights_of = {}
    for i, metas in enumerate(sampled):
        weights_of[i] = sum(numel(x.box.lengths) * 2 for x in metas if x.kind == "model")
    native_max = max(opt_share[i] + (weights_of[i] if (i // m.tp) % dp == 0 else 0) for i in range(len(sampled)))
    node_bw = a.node_gbps * 1e9 / a.ranks_per_node
    fs_bw = a.fs_gbps * 1e9
    total = all_unique * stored / sampled_unique

    def save_seconds(busiest, everything):
        return max(busiest / node_bw, everything / fs_bw)

    return {
        "model": m.name, "ranks": ranks, "layout": {"tp": m.tp, "pp": m.pp, "dp": dp, "ep": m.ep},
        "shards_per_rank": sum(len(x) for x in sampled) / len(sampled),
        "shards_whole_job": round(sum(len(x) for x in sampled) * scale),
        "sampled_stages": sample_stages, "sampled_ranks": len(sampled),
        "exchange": "partitioned",
        "plan_seconds_per_rank": sum(decide_s) * scale / ranks,
        "exchange_bytes_per_rank": round(sum(received) * scale / ranks),
        "exchange_rounds": 2,
        "manifest_bytes_read_per_rank": round(sum(rank_reads) / len(rank_reads)),
        "max_over_mean_bytes_written": grouped_max / mean_written,
        "stored_over_unique": stored / sampled_unique,
        "partitioned": {
            "decide_seconds_per_rank": sum(decide_s) * scale / ranks,
            "decide_seconds_busiest_owner_sampled": max(decide_s),
            "exchange_bytes_per_rank": round(sum(received) * scale / ranks),
            "exchange_bytes_busiest_owner_sampled": max(received),
            "exchange_bytes_sent_per_rank": round(sum(sent) / len(sent)),
            "exchange_rounds": 2,
            # rank 0's receipt for the manifest, once per save: each owner's blob as long as it
            # is (an all-to-all, now), against a gather of objects padded to the longest (before)
            "rank0_gather_bytes": round(sum(to_rank0) * scale + idle * max(0, ranks - len(to_rank0) * scale)),
            # (the longest owner's blob: its sampled stages' meta entries scaled to all stages)
            "rank0_gather_bytes_padded": round((idle + (max(to_rank0 + [idle]) - idle) * scale) * ranks),
            "max_over_mean_bytes_written_by_group": grouped_max / mean_written,
            "manifest_bytes_read_per_rank": round(sum(rank_reads) / len(rank_reads)),
            "manifest_bytes_read_busiest_rank": round(max(rank_reads)),
            "manifest_root_bytes": root5_bytes,
            "manifest_meta_file_bytes": meta_file_bytes,
            "manifest_bytes_read_per_rank_derived_weights": round(sum(derived_reads) / len(derived_reads)),
            "manifest_bytes_read_per_rank_other_layout": round(sum(other_reads) / len(other_reads)),
            "manifest_bytes_needed_per_rank_other_layout": round(sum(other_needed) / len(other_needed)),
            "format5": {"manifest_bytes_read_per_rank_other_layout": round(sum(other5_reads) / len(other5_reads))},
            "format4": {"manifest_bytes_read_per_rank": round(sum(part_reads) / len(part_reads)),
                        "manifest_bytes_read_busiest_rank": round(max(part_reads)),
                        "manifest_root_bytes": round(root_bytes)}},
        "ring": {"plan_seconds_per_rank": plan_s * scale, "plan_seconds_sampled": plan_s,
                 "first_plan_seconds_per_rank": first_plan_s * scale,
                 "exchange_bytes_per_rank": round(mean_later * (ranks - 1)),
                 "first_exchange_bytes_per_rank": round(mean_first * (ranks - 1)),
                 "exchange_rounds": ranks - 1 + 1,
                 "manifest_bytes_read_per_rank": round(manifest_sampled * scale),
                 "max_over_mean_bytes_written": max_written / mean_written},
        "build_seconds": build_s,
        "unique_bytes": all_unique, "busiest_rank_bytes": max_written,
        "native_deepspeed_busiest_rank_bytes": native_max,
        "projection": {"assumptions": {"ranks_per_node": a.ranks_per_node, "node_write_gbps": a.node_gbps,
                                       "fs_write_gbps": a.fs_gbps},
                       "adacheck_save_seconds": save_seconds(max_written, total),
                       "native_deepspeed_save_seconds": save_seconds(native_max, all_unique),
                       # (the partitioned decisions: the save waits for the busiest owner)
                       "adacheck_plan_and_exchange_seconds": max(decide_s)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["gpt3-175b"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--sample-stages", type=int, nargs="+", default=None,
                    help="pipeline stages whose ranks run the real code (default: the first, a middle one, the last)")
    ap.add_argument("--chunk-bytes", type=int, default=64 << 20, help="hash_chunk_bytes (the default config's)")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--node-gbps", type=float, default=10.0, help="assumed local NVMe write GB/s per node")
    ap.add_argument("--fs-gbps", type=float, default=1000.0, help="assumed aggregate file system write GB/s")
    ap.add_argument("--json", default="simulate_scale.json")
    a = ap.parse_args()
    rows = []
    print("| model | ranks | shards per rank | plan s per rank (first) | exchange MB per rank (first) | rounds | "
          "manifest MB read per rank | max / mean written | stored / unique | save s AdaCheck / native DS | "
          "partitioned: decide s per rank (busiest) | MB received per rank (busiest) | max / mean by holder set | "
          "manifest MB read per rank (busiest): format 4 / format 5-6 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in a.model:
        m = MODELS[name]
        stages = a.sample_stages or sorted({0, m.pp // 2, m.pp - 1})
        for n in a.ranks:
            row = simulate(m, n, stages, a)
            rows.append(row)
            pr, pa, ring = row["projection"], row["partitioned"], row["ring"]
            print(f"| {name} | {n:,} | {row['shards_per_rank']:.0f} | {ring['plan_seconds_per_rank']:.1f} ({ring['first_plan_seconds_per_rank']:.1f}) | "
                  f"{ring['exchange_bytes_per_rank'] / 1e6:.1f} ({ring['first_exchange_bytes_per_rank'] / 1e6:.1f}) | "
                  f"{ring['exchange_rounds']:,} | {ring['manifest_bytes_read_per_rank'] / 1e6:.1f} | "
                  f"{ring['max_over_mean_bytes_written']:.2f} | {row['stored_over_unique']:.4f} | "
                  f"{pr['adacheck_save_seconds']:.1f} / {pr['native_deepspeed_save_seconds']:.1f} | "
                  f"{pa['decide_seconds_per_rank']:.3f} ({pa['decide_seconds_busiest_owner_sampled']:.3f}) | "
                  f"{pa['exchange_bytes_per_rank'] / 1e6:.2f} ({pa['exchange_bytes_busiest_owner_sampled'] / 1e6:.2f}) | "
                  f"{pa['max_over_mean_bytes_written_by_group']:.2f} | "
                  f"{pa['format4']['manifest_bytes_read_per_rank'] / 1e6:.1f} "
                  f"({pa['format4']['manifest_bytes_read_busiest_rank'] / 1e6:.1f}) / "
                  f"{pa['manifest_bytes_read_per_rank'] / 1e6:.3f} ({pa['manifest_bytes_read_busiest_rank'] / 1e6:.3f}) |",
                  flush=True)
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
