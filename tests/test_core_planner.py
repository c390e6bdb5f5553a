import pytest

from adacheck.errors import StateError
from adacheck.format.hashing import hash_tensor
from adacheck.plan.planner import PlanCache, plan_save
from adacheck.types import Box, ShardMeta
import torch

H1 = hash_tensor(torch.zeros(1))
H2 = hash_tensor(torch.ones(1))


def meta(name, box, shape, h=H1, dtype="float32", kind="master", **kw):
    return ShardMeta(name=name, kind=kind, dtype=dtype, shape=shape, box=box, hash=h, **kw)


def replicated_world(n_ranks, n_tensors, size=10):
    return [[meta(f"t{i}", Box.full((size + i,)), (size + i,)) for i in range(n_tensors)]
            for _ in range(n_ranks)]


def test_replicas_are_written_once_and_balanced():
    per_rank = replicated_world(4, 16)
    plan = plan_save(per_rank)
    keys = [k for w in plan.writes.values() for _, _, k in w]
    assert len(keys) == len(set(keys)) == 16
    loads = plan.stats["per_rank_bytes"]
    biggest = max(4 * (10 + i) for i in range(16))
    assert max(loads) - min(loads) <= biggest
    assert plan.stats["stored_bytes"] == plan.stats["logical_bytes"]
    assert plan.stats["held_bytes"] == 4 * plan.stats["logical_bytes"]


def test_plan_is_deterministic():
    per_rank = replicated_world(3, 9)
    assert plan_save(per_rank) == plan_save([list(reversed(r)) for r in per_rank])


def test_partitions_are_stored_by_their_owner():
    per_rank = [[meta("w", Box((0,), (5,)), (10,))], [meta("w", Box((5,), (5,)), (10,), h=H2)]]
    plan = plan_save(per_rank)
    assert {r: [n for n, _, _ in w] for r, w in plan.writes.items()} == {0: ["w"], 1: ["w"]}


def test_missing_coverage_is_an_error():
    with pytest.raises(Exception, match="cover 5 of 10"):
        plan_save([[meta("w", Box((0,), (5,)), (10,))]])


def test_disagreeing_shapes_are_an_error():
    with pytest.raises(StateError, match="disagree"):
        plan_save([[meta("w", Box.full((4,)), (4,))], [meta("w", Box.full((5,)), (5,))]])


def test_diverged_replicas_are_kept_and_reported():
    per_rank = [[meta("w", Box.full((4,)), (4,), h=H1)], [meta("w", Box.full((4,)), (4,), h=H2)]]
    plan = plan_save(per_rank)
    assert len(plan.tensors["w"].boxes) == 2
    assert plan.warnings and "diverged" in plan.warnings[0]
    assert sorted(r for r in plan.writes) == [0, 1]


def test_derivation_needs_every_holder_to_prove_it():
    def world(ok1):
        return [[meta("m", Box.full((4,)), (4,)), meta("b", Box.full((4,)), (4,), dtype="bfloat16",
                                                     kind="model", derive="m", derive_ok=True)],
                [meta("b", Box.full((4,)), (4,), dtype="bfloat16", kind="model", derive="m",
                      derive_ok=ok1)]]
    plan = plan_save(world(True))
    assert plan.tensors["b"].derived is not None and plan.stats["derived_bytes"] == 8
    plan = plan_save(world(False))
    assert plan.tensors["b"].derived is None and plan.tensors["b"].boxes


# ---------------------------------------------------------------- placement over nodes
from adacheck.plan.planner import place  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("nodes", [["n0"] * 4, ["n0", "n0", "n1", "n1"], ["n0", "n1", "n2", "n3"],
                                   ["a", "b", "a", "b"]])
@pytest.mark.parametrize("copies", [1, 2])
def test_placement_copies_on_distinct_nodes_and_balanced(nodes, copies):
    items = [(100 + 7 * i, f"k{i:02d}", (0, 1, 2, 3)) for i in range(20)]
    writers, load = place(items, 4, copies, nodes)
    assert place(items, 4, copies, nodes) == (writers, load)           # deterministic
    assert place(list(reversed(items)), 4, copies, nodes)[0] == writers  # order-independent
    for key, ws in writers.items():
        assert len(ws) == copies and len(set(ws)) == copies
        if len(set(nodes)) >= copies:
            assert len({nodes[w] for w in ws}) == copies, (key, ws)
    # balance: within one item of the optimum (all ranks hold everything here)
    total = sum(n for n, _, _ in items) * copies
    assert max(load.values()) - min(load.values()) <= max(n for n, _, _ in items)
    assert sum(load.values()) == total


def test_placement_never_exceeds_holders_and_prefers_other_nodes():
    items = [(10, "solo", (2,)), (10, "pair", (0, 1)), (10, "spread", (0, 1, 2))]
    writers, _ = place(items, 3, copies=2, nodes=["x", "x", "y"])
    assert writers["solo"] == [2]                 # one holder: one copy, nothing else can write it
    assert sorted(writers["pair"]) == [0, 1]      # same node: second copy on another holder
    assert {["x", "x", "y"][w] for w in writers["spread"]} == {"x", "y"}


def test_plan_with_two_copies_lists_both_files():
    per_rank = [[meta("w", Box.full((10,)), (10,))] for _ in range(4)]
    plan = plan_save(per_rank, copies=2, nodes=["a", "a", "b", "b"])
    files = sorted(sb.file for sb in plan.tensors["w"].boxes)
    assert len(files) == 2 and plan.stats["stored_bytes"] == 80
    writers = sorted(int(f[4:9]) for f in files)
    assert {["a", "a", "b", "b"][w] for w in writers} == {"a", "b"}


def test_tiling_is_rechecked_when_the_structure_changes():
    """The planner remembers structures it proved to tile (same boxes at every checkpoint), but a
    tensor whose boxes change is checked again."""
    def meta(box, h="a"):
        return ShardMeta("optim/x", "optim", "float32", (4,), box, h, replicated=False)
    good = [[meta(Box((0,), (2,)))], [meta(Box((2,), (2,)))]]
    cache = PlanCache()
    plan_save(good, cache=cache)
    assert "optim/x" in cache.tiled
    plan_save([[meta(Box((0,), (2,)), "b")], [meta(Box((2,), (2,)), "c")]], cache=cache)   # new hashes, same boxes
    with pytest.raises(Exception, match="cover 3 of 4"):
        plan_save([[meta(Box((0,), (2,)))], [meta(Box((2,), (1,)))]], cache=cache)


def test_placement_is_reused_only_while_sizes_and_holders_stay_the_same():
    """The last assignment is kept for the next checkpoint when only hashes changed; a box
    whose holders changed is placed again (never on a rank that no longer holds it)."""
    a = [[meta("w", Box.full((8,)), (8,))], [meta("w", Box.full((8,)), (8,))], []]
    cache = PlanCache()
    first = plan_save(a, cache=cache)
    again = plan_save([[meta("w", Box.full((8,)), (8,), h=H2)], [meta("w", Box.full((8,)), (8,), h=H2)], []],
                      cache=cache)
    assert {r: [k for *_, k in w] for r, w in again.writes.items()} == \
        {r: [k for *_, k in w] for r, w in first.writes.items()}
    assert cache.placed and cache.placed[1] is not None      # (kept for the next one)
    moved = plan_save([[], [meta("w", Box.full((8,)), (8,))], [meta("w", Box.full((8,)), (8,))]], cache=cache)
    assert set(moved.writes) <= {1, 2} and len([k for w in moved.writes.values() for k in w]) == 1


# ----------------------------------------------------------------- decisions partitioned by tensor

def random_world(rng, n_ranks):
    """Random shard lists of a plausible job: tensors split in rows over some ranks and replicated
    over others (declared or not), replicas that sometimes diverge, bf16 copies derived from an
    fp32 master (proven only where a rank holds that master part), and now and then a bad job
    (holders that disagree on a shape, rows nobody holds)."""
    per_rank = [[] for _ in range(n_ranks)]
    for t in range(rng.randint(1, 12)):
        rows, cols = rng.randint(1, 9), rng.randint(1, 4)
        parts = rng.randint(1, rows)
        cuts = sorted(rng.sample(range(1, rows), parts - 1)) if parts > 1 else []
        bounds = list(zip([0] + cuts, cuts + [rows]))
        declared = rng.random() < 0.7
        derived = rng.random() < 0.4
        for a, b in bounds:
            holders = rng.sample(range(n_ranks), rng.randint(1, n_ranks))
            digest = f"h{t}-{a}-{rng.random() < 0.95}"
            box = Box((a, 0), (b - a, cols))
            for r in holders:
                h = digest if rng.random() < 0.9 else f"{digest}-x{r}"
                per_rank[r].append(meta(f"m{t}", box, (rows, cols), h=h, replicated=declared))
                if derived:
                    per_rank[r].append(meta(f"b{t}", box, (rows, cols), h=h + "b", dtype="bfloat16", kind="model",
                                            derive=f"m{t}", derive_ok=rng.random() < 0.9, replicated=declared))
        if rng.random() < 0.03:   # a rank that disagrees on the shape
            r = rng.randrange(n_ranks)
            per_rank[r].append(meta(f"m{t}", Box((0, 0), (1, cols)), (rows + 1, cols)))
    if rng.random() < 0.03:       # rows that no rank holds
        per_rank[0].append(meta("gap", Box((0,), (2,)), (5,)))
    return per_rank


def outcome(fn):
    try:
        return fn(), None
    except Exception as e:   # (the kind of error is compared)
        return None, type(e)


@pytest.mark.parametrize("seed", range(300))
def test_decisions_partitioned_by_tensor_equal_the_whole_plans(seed):
    import random
    from adacheck.plan.planner import decide, group_by_tensor, route
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    per_rank = random_world(rng, n)
    whole, error = outcome(lambda: decide(group_by_tensor(per_rank), None, 1, PlanCache()))
    owners = rng.randint(1, 9)
    parts = [outcome(lambda p=p: decide(p[0], None, 1, PlanCache(), source_of=p[1].get))
             for p in route(per_rank, owners)]
    if error is not None:
        assert error in {e for _, e in parts}, (error, parts)
        return
    assert all(e is None for _, e in parts), parts
    got = [d for d, _ in parts]
    assert {k: v for d in got for k, v in d.tensors.items()} == whole.tensors
    assert sorted(i for d in got for i in d.items) == sorted(whole.items)
    assert sorted(w for d in got for w in d.warnings) == sorted(whole.warnings)
    assert sum(d.logical for d in got) == whole.logical and sum(d.held for d in got) == whole.held


def test_placement_by_holder_set_places_every_item_on_its_holders():
    import random
    from adacheck.plan.planner import place, place_by_group
    rng = random.Random(5)
    groups = [tuple(range(0, 4)), tuple(range(4, 8)), tuple(range(0, 8))]
    items = [(rng.randint(1, 100), f"k{i}", rng.choice(groups)) for i in range(200)]
    items += [(rng.randint(1, 400), f"p{r}", (r,)) for r in range(8)]        # pinned: one holder each
    nodes = [f"n{r // 2}" for r in range(8)]
    out, load = place_by_group(items, 8, copies=2, nodes=nodes)
    assert out == place_by_group(list(reversed(items)), 8, copies=2, nodes=nodes)[0]   # deterministic
    for nbytes, key, holders in items:
        w = out[key]
        assert set(w) <= set(holders) and len(w) == min(2, len(holders)) and len(set(w)) == len(w)
        if len(holders) > 1:
            assert len({nodes[x] for x in w}) == 2      # the copies on two nodes
    assert sum(load.values()) == sum(n * len(out[k]) for n, k, _ in items)
    # about as balanced as the whole job's greedy here (the simulation measures real layouts)
    _, whole = place(items, 8, copies=2, nodes=nodes)
    mean = sum(load.values()) / 8
    assert max(load.values()) <= 1.25 * max(whole.values()) and max(load.values()) < 1.5 * mean
    # a holder set's items go around its members' pinned bytes
    heavy = [(5000, f"h{r}", (r,)) for r in range(4)] + [(100, f"s{i}", tuple(range(8))) for i in range(40)]
    out, load = place_by_group(heavy, 8)
    assert all(out[f"s{i}"][0] >= 4 for i in range(40)) and max(load.values()) == 5000, load
    # a set that contains smaller ones is placed after them, around what they gave its members
    nested = [(100, "a", (0, 1)), (100, "b", (2, 3)), (100, "c", (0, 1, 2, 3)), (100, "d", (0, 1, 2, 3))]
    out, load = place_by_group(nested, 4)
    assert (out["a"], out["b"], sorted(out["c"] + out["d"])) == ([0], [2], [1, 3]) and set(load.values()) == {100}


def test_auto_exchange_is_the_ring_below_32_ranks_and_partitioned_from_there(tmp_path):
    """The default exchange, "auto": small jobs keep one manifest file and the ring; from 32
    ranks on every save is partitioned (scripts/bench_plan.py: the whole-job plan the ring makes
    every rank compute grows with the job); an exchange that is named is the one run."""
    from adacheck.checkpoint import save
    from adacheck.integration import LocalShard, LocalState
    from adacheck.config import AdaCheckConfig
    from adacheck.plan.exchange import SoloComm, exchange_for
    assert [exchange_for("auto", n) for n in (1, 2, 31, 32, 64, 16384)] == ["ring"] * 3 + ["partitioned"] * 3
    assert exchange_for("ring", 16384) == "ring" and exchange_for("partitioned", 2) == "partitioned"
    assert exchange_for("allgather", 64) == "allgather"
    assert AdaCheckConfig.from_dict({"enabled": True}).exchange == "auto"
    t = torch.arange(6.0)
    st = LocalState([LocalShard("master/w", "master", (6,), Box.full((6,)), t)], objects={}, framework={}, step=1)
    m = save(SoloComm(), str(tmp_path), "s1", lambda: st)
    assert m.stats["exchange"]["how"] == "ring" and m.format_version < 5
    m = save(SoloComm(), str(tmp_path), "s2", lambda: st, exchange="partitioned")
    assert m.stats["exchange"]["how"] == "partitioned" and m.format_version == 6
