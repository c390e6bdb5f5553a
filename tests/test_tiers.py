"""The memory tier (adacheck.tiers) with real DeepSpeed engines (CPU, gloo, 2 processes on one
node): every save goes to memory, every 4th is copied to the checkpoint directory behind
training, and recovery takes the newest state across the tiers.

The oracle is the state DeepSpeed's own accessors return at each save (ds_worker's dumps)."""
import json
import os
import subprocess
import sys
from functools import partial

import pytest
from safetensors.torch import load_file

from launch import ROOT, check, launch
from test_ds_integration import assert_same, results

from adacheck.storage import commit
from adacheck.storage import manifest_files

from adacheck.online import deltas

from adacheck.online import deltalog
from adacheck.storage.backends import LOCAL
from adacheck.tiers import memory_location
from adacheck.integration import Restore
from adacheck import jobs
from adacheck.tiers.tiered import TieredCheckpointer

pytestmark = pytest.mark.timeout(900)


def dump(d, name):
    return load_file(os.path.join(d, f"{name}.safetensors"))


def state(d, name):
    s = dump(d, name)
    return s, [k for k in s if k.startswith(("model/", "master/", "optim/"))]


def cli(*argv):
    p = subprocess.run([sys.executable, "-m", "adacheck.cli", *argv], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def committed(ckpt_dir, base_step, world=2):
    """The delta steps of ``ckpt_dir`` every rank has a record of."""
    return [st.step for st in deltas.committed_steps(ckpt_dir, base_step, world)[0]]


def on_nodes(d, nodes):
    """rank_env for simulated nodes: rank r on node nodes[r], with the memory directory d/shm-<node>."""
    return lambda r: {"ADACHECK_NODE": nodes[r], "ADACHECK_MEMORY_DIR": f"{d}/shm-{nodes[r]}"}


def memory_of(monkeypatch, d, ck, node):
    """The memory location of ck on simulated node ``node`` (see on_nodes)."""
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm-{node}")
    return memory_location(LOCAL, ck)


def tags(path):
    return sorted(t for t, m, _ in commit.list_checkpoints(path, LOCAL) if m is not None) if os.path.isdir(path) else []


def test_a_checkpoint_copied_to_the_directory_leaves_memory_once_the_copy_ends(tmp_path, monkeypatch):
    """The memory tier keeps the checkpoint being copied to the directory beyond ``keep`` (2) only
    while it is copied: saves 1-5 (3 persisted, its copy held up for 3 s, so that it outlasts
    saves 4 and 5) leave memory holding 3, 4, 5; once the copy ended (``finish``), 4 and 5, and
    the directory holds 3.  (It was trimmed only at the next save: a job killed after a finish
    left keep + 1 checkpoints in memory.)"""
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-copy")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    ck = f"{d}/ck"
    mem = memory_location(LOCAL, ck)
    tiered = {"enabled": True, "async": True, "tiers": {"memory": True, "persist_interval": 3}}
    saves = [a for _ in range(5) for a in (["train", 1], ["save", ck])]
    runs = [{"stage": 1, "dtype": "bf16", "adacheck": tiered,
             "actions": [["slow_persist", 3]] + saves + [["ls", mem], ["finish"], ["ls", mem], ["latest", ck]]}]
    check(launch(1, {"runs": runs}, f"{d}/a"))
    got = results(f"{d}/a")[0]
    # (before the finish, 3 is being copied and kept beyond keep; 5's asynchronous save runs on its
    # own time: its directory may not be there yet)
    assert got["ls_dirs"][0] in (["global_step3", "global_step4"], ["global_step3", "global_step4", "global_step5"]), \
        got["ls_dirs"]
    assert got["ls"][0] in (["global_step3", "global_step4"], ["global_step3", "global_step4", "global_step5"]), got["ls"]
    assert got["ls"][1] == ["global_step4", "global_step5"], got["ls"]
    assert got["ls_dirs"][1] == ["global_step4", "global_step5"], got["ls_dirs"]     # (3's files went)
    assert got["latest"] == ["global_step3"]


def test_memory_tier_recovers_newer_than_durable_falls_back_and_persists_at_exit(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-1")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    ck, ck2, ck3 = f"{d}/ck", f"{d}/ck2", f"{d}/ck3"
    mem3 = memory_location(LOCAL, ck3)
    # (asynchronous: the memory copy is written behind training, by a writer process)
    tiered = {"enabled": True, "async": True, "tiers": {"memory": True, "persist_interval": 4}}
    saves = []
    for step in range(1, 7):
        saves += [["train", 1]] + ([["dump", f"A{step}"]] if step in (4, 6) else []) + [["save", ck]]
    runs = [
        # 50 saves, every 10th persisted: memory holds at most keep (2) + the one being copied
        {"stage": 1, "dtype": "bf16", "adacheck": {"enabled": True, "tiers": {"memory": True, "persist_interval": 10}},
         "actions": [a for _ in range(50) for a in (["train", 1], ["save", ck3], ["ls", mem3])] + [["finish"]]},
        # 6 saves (durable: the 4th), then the job is killed
        {"stage": 1, "dtype": "bf16", "adacheck": tiered, "actions": saves + [["finish"], ["die"]]},
    ]
    out = launch(2, {"runs": runs}, f"{d}/a")
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    assert tags(ck3) == [f"global_step{s}" for s in (10, 20, 30, 40, 50)]
    seen = results(f"{d}/a")[0]["ls"]           # the memory tier of ck3 after each save
    assert max(len(x) for x in seen) <= 3 and seen[-1] == ["global_step49", "global_step50"], seen
    held = results(f"{d}/a")[0]["ls_dirs"]      # (and the files of those alone: retired ones are deleted)
    assert max(len(x) for x in held) <= 3 and held[-1] == ["global_step49", "global_step50"], held
    assert not os.path.exists(mem3)             # (the engine's destroy ended that training cleanly)
    assert tags(ck) == ["global_step4"] and commit.read_latest(ck) == "global_step4"
    mem = memory_location(LOCAL, ck)
    assert tags(mem) == ["global_step5", "global_step6"]
    # `adacheck inspect` of the directory's checkpoint says what the memory tier holds for it
    said = cli("inspect", ck)
    assert "memory tier job job-1 holds 2 checkpoint(s) of this directory, newest global_step6" in said, said
    held = json.loads(cli("inspect", ck, "--json"))["memory_tier"]
    assert [(x["job"], x["checkpoints"], x["newest"]) for x in held] == [("job-1", 2, "global_step6")], held
    assert held[0]["bytes"] == sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(mem) for f in fs)
    assert json.loads(cli("inspect", ck, "--json", "--memory-dir", f"{d}/elsewhere"))["memory_tier"] == []

    # a new job (same identity): the newest state is in memory, newer than durable storage
    runs = [{"stage": 1, "dtype": "bf16", "seed": 7, "adacheck": tiered, "actions": [["load", ck], ["dump", "B6"]]},
            # a job that ends cleanly: its newest memory checkpoint is persisted at exit
            {"stage": 1, "dtype": "bf16", "adacheck": tiered,
             "actions": [["train", 1], ["save", ck2], ["train", 1], ["save", ck2], ["train", 1], ["dump", "E3"],
                         ["save", ck2]]}]
    out = launch(2, {"runs": runs}, f"{d}/b")
    check(out)
    assert "loaded global_step6 (step 6) from the memory tier" in out[0][1], out[0][1][-3000:]
    assert "the memory tier holds 1 checkpoint(s) of " + ck2 in out[0][1]      # (the log's total)
    a6, keys = state(f"{d}/a", "A6")
    assert_same(a6, dump(f"{d}/b", "B6"), keys)
    assert commit.read_latest(ck2) == "global_step3" and tags(ck2) == ["global_step3"]
    assert not os.path.exists(memory_location(LOCAL, ck2))       # (removed at the clean exit)
    # another layout (DP=1, ZeRO-3) recovers from the memory tier too
    check(launch(1, {"runs": [{"stage": 3, "dtype": "bf16", "seed": 7, "adacheck": tiered,
                               "actions": [["load", ck], ["dump", "C6"]]}]}, f"{d}/c"))
    assert_same(a6, dump(f"{d}/c", "C6"), keys)

    # the node's memory is lost (here: `adacheck clean` removes what the killed job left): recovery
    # falls back to durable storage and says so
    dry = cli("clean", "--memory-dir", f"{d}/shm")
    assert "job-1:" in dry and f"for {ck}: newest global_step6" in dry and "dry run" in dry, dry
    assert os.path.isdir(mem)
    cli("clean", "--memory-dir", f"{d}/shm", "--job", "job-1", "--yes")
    assert not os.path.exists(mem) and not os.path.exists(f"{d}/shm/job-1")
    runs = [{"stage": 1, "dtype": "bf16", "seed": 7, "adacheck": tiered, "actions": [["load", ck], ["dump", "D4"]]},
            {"stage": 1, "dtype": "bf16", "seed": 7, "adacheck": tiered, "actions": [["load", ck2], ["dump", "F3"]]}]
    out = launch(2, {"runs": runs}, f"{d}/d")
    check(out)
    assert "memory tier holds no checkpoint" in out[0][1]
    a4, keys = state(f"{d}/a", "A4")
    assert_same(a4, dump(f"{d}/d", "D4"), keys)
    e3, keys = state(f"{d}/b", "E3")
    assert_same(e3, dump(f"{d}/d", "F3"), keys)


def test_a_load_without_a_tag_takes_what_latest_names_also_after_a_roll_back(tmp_path, monkeypatch):
    """Saves 1-3 through the memory tier (each copied to the directory), a roll-back to
    global_step1 by tag, then global_step2 saved again (the new run's) and global_step3 saved
    with save_latest=False: a load without a tag takes global_step2, what 'latest' names and what
    a load without the memory tier takes, not the memory's highest step (the abandoned run's, or
    the save that was not to be latest).  Oracle: DeepSpeed's own accessors at that save."""
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-rollback")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    ck = f"{d}/ck"
    actions = [a for _ in range(3) for a in (["train", 1], ["save", ck])] + [
        ["load", ck, {"tag": "global_step1"}], ["train", 1], ["save", ck], ["dump", "R2"],
        ["train", 1], ["save", ck, None, {"save_latest": False}], ["dump", "N3"], ["finish"],
        ["train", 1], ["load", ck], ["steps"], ["dump", "L"]]
    runs = [{"stage": 1, "dtype": "bf16", "adacheck": {"enabled": True, "tiers": {"memory": True, "persist_interval": 1}},
             "actions": actions}]
    check(launch(2, {"runs": runs}, d))
    got = results(d)[0]
    assert got["steps"][0] == 2 and got["loaded"][-1][0].endswith("global_step2"), got["loaded"]
    assert "/shm/" in got["loaded"][-1][0]       # (from the memory tier: it is as new as the directory's)
    r2, keys = state(d, "R2")
    assert_same(r2, dump(d, "L"), keys)


def test_online_deltas_go_to_the_memory_tier_and_the_last_steps_to_durable_storage_at_exit(tmp_path, monkeypatch):
    """Online deltas with the memory tier (ZeRO-2 bf16, 2 ranks): bases every 3 steps and every
    step's deltas go to memory; every 2nd base also to the checkpoint directory, its deltas copied
    after it behind training, and on through the next base (kept in memory only: its step is
    also recorded as the last delta of the chain before it).  The job is SIGKILLed after step 8:
    a new job recovers step 8 exactly from memory (base 7 + delta 8; so does a DP=1 job, from the
    saving ranks' partitions); a job without the memory recovers step 8 too, from durable storage
    (base 4 + deltas 5-8, across base 7); the first job continues the chain in memory, and ends cleanly after step
    11: its newest base (10) and delta 11 go to durable storage at exit, and a job without the
    memory recovers step 11 from there.  A clean end whose deltas cannot be copied keeps them in
    memory, from where the next job recovers them.  The oracle: a run never checkpointed (DeepSpeed's own
    accessors at each step, and its losses)."""
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-online")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    ck = f"{d}/ck"
    mem = memory_location(LOCAL, ck)
    ac = {"enabled": True, "save_dir": ck, "online": {"enabled": True, "base_interval": 3},
          "tiers": {"memory": True, "persist_interval": 2}}
    model = {"stage": 2, "dtype": "bf16"}
    out = launch(2, {"runs": [dict(model, actions=[["train_dump", 14, "U"]]),
                              dict(model, adacheck=ac, actions=[["train", 8], ["finish"], ["die"]])]}, f"{d}/a")
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    ref = results(f"{d}/a")[0]["losses"]
    assert tags(ck) == ["global_step4"] and tags(mem) == ["global_step4", "global_step7"]
    # memory holds the newest keep (2) bases with their chains, nothing of the retired base 1 but its
    # delta files (steps 2-4, both ranks) as spares: step 8's were written over two of them
    assert sorted(os.listdir(mem)) == [".spare-deltas", "SOURCE", "global_step4", "global_step7", "latest"], \
        os.listdir(mem)
    assert len(os.listdir(f"{mem}/.spare-deltas")) == 4, os.listdir(f"{mem}/.spare-deltas")
    # (step 7 took a base and is also the last delta of base 4's chain: the chains join up)
    assert deltas.step_dirs(os.path.join(mem, "global_step4")) == [5, 6, 7]
    assert deltas.step_dirs(os.path.join(mem, "global_step7")) == [8]
    # copied behind training: base 4's chain, then base 7's (kept in memory only) after it
    assert committed(os.path.join(ck, "global_step4"), 4) == [5, 6, 7, 8]
    def recovers(name, step, said, world=2, seed=5, more=(), **kw):
        """A new job of ``world`` ranks loads ck: it reaches ``step`` (its log says ``said``), and
        its state equals the run never checkpointed at that step."""
        out = launch(world, {"runs": [dict(model, seed=seed, adacheck=ac, actions=[["load", ck], ["steps"],
                                                                                    ["dump", name], *more])]},
                     f"{d}/{name}", **kw)
        check(out)
        assert said in out[0][1], out[0][1][-3000:]
        got = results(f"{d}/{name}")[0]
        assert got["steps"][0] == step, got
        u, keys = state(f"{d}/a", f"U{step}")
        assert_same(u, dump(f"{d}/{name}", name), keys)
        return got

    # without the memory tier (another memory directory): durable storage's base 4 + deltas 5-8
    recovers("D8", 8, "memory tier holds no checkpoint", rank_env=lambda r: {"ADACHECK_MEMORY_DIR": f"{d}/other-shm"})
    # another layout (DP=1) recovers step 8 from the memory tier: the saving ranks' partitions are
    # rebuilt from base 7 and stepped with their deltas (read only: it neither trains nor saves)
    recovers("E8", 8, "loaded global_step7 (step 7) from the memory tier", world=1, seed=3)
    b = recovers("B8", 8, "loaded global_step7 (step 7) from the memory tier", seed=7, more=[["train_to", 11]])
    assert b["losses"] == ref[8:11], (b, ref)
    assert not os.path.exists(mem)          # (a clean end: the newest base and its deltas are durable)
    assert tags(ck) == ["global_step10", "global_step4"] and commit.read_latest(ck) == "global_step10"
    assert committed(os.path.join(ck, "global_step10"), 10) == [11]
    recovers("C11", 11, "memory tier holds no checkpoint", seed=9)

    # a clean end whose deltas cannot reach the directory (a file stands where their directory
    # goes): the memory tier keeps them, says so, and the next job recovers them from there
    os.makedirs(f"{ck}/global_step12")
    open(f"{ck}/global_step12/deltas", "w").close()
    recovers("F11", 11, "memory tier holds no checkpoint", seed=9, more=[["train_to", 14]])
    said = open(f"{d}/F11/rank0.log").read()
    assert "the memory tier keeps them" in said, said[-3000:]
    assert tags(ck) == ["global_step10", "global_step12", "global_step4"] and committed(f"{mem}/global_step12", 12) == [13, 14]
    recovers("G14", 14, "loaded global_step12 (step 12) from the memory tier", seed=9)


@pytest.mark.parametrize("exchange", ["ring", "partitioned"])
def test_online_deltas_across_two_nodes_with_peer_copies_survive_the_loss_of_one(tmp_path, monkeypatch, exchange):
    """Online deltas with the memory and peer tiers on two simulated nodes (a: ranks 0-1, b: ranks
    2-3; ZeRO-0 fp32 DP=4, whose replicated gradients each node stores once; bases every 3 steps,
    none persisted).  Each node's memory holds its ranks' chains and, copied behind training, the
    other node's.  The job is SIGKILLed after step 8, and node b is lost with its memory:
    - with node a's copies of b's step 8 gone too, every rank agrees on step 7 (base 7 alone);
    - another layout (DP=2, nodes a and c) recovers step 8 from the memories;
    - a restart with a replacement node c recovers step 8 (c receives b's base files and deltas
      from node a), trains to step 11 with the uninterrupted run's losses and ends cleanly;
    - a job without the memory then recovers step 11 from the checkpoint directory (base 10 and
      the deltas of step 11 that each rank copied there at exit).
    The oracle is a run never checkpointed (DeepSpeed's own accessors at each step, its losses).
    Partitioned: the bases are checkpoints in parts on each node."""
    import shutil
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-online-nodes")
    ck = f"{d}/ck"

    mem_of, on = partial(memory_of, monkeypatch, d, ck), partial(on_nodes, d)

    ac = {"enabled": True, "save_dir": ck, "exchange": exchange, "online": {"enabled": True, "base_interval": 3},
          "tiers": {"memory": True, "peer": True, "persist_interval": 10}}
    model = {"stage": 0, "dtype": "fp32"}
    out = launch(4, {"runs": [dict(model, actions=[["train_dump", 11, "U"]]),
                              dict(model, adacheck=ac, actions=[["train", 8], ["finish"], ["die"]])]},
                 f"{d}/a", rank_env=on("aabb"))
    assert [rc for rc, _ in out] == [-9] * 4, out[0][1][-3000:]
    ref = results(f"{d}/a")[0]["losses"]
    mem_a, mem_b = mem_of("a"), mem_of("b")
    assert tags(ck) == [] and tags(mem_a) == tags(mem_b) == ["global_step4", "global_step7"]
    for mem in (mem_a, mem_b):        # every rank's chain on both nodes: its own node's, and the peer copies
        assert committed(f"{mem}/global_step4", 4, world=4) == [5, 6, 7]
        assert committed(f"{mem}/global_step7", 7, world=4) == [8]
        assert deltas.read_chain(f"{mem}/global_step7")["nodes"] == list("aabb")
        # base 1's chain (steps 2-4 of all four ranks, the peer copies too) became spares when base 1
        # retired, and step 8's own files were written over two of them
        assert 0 < len(os.listdir(f"{mem}/.spare-deltas")) <= 4 * 3 - 2, os.listdir(f"{mem}/.spare-deltas")
    rec = deltas.committed_steps(f"{mem_a}/global_step7", 7, 4)[0][0].records
    keys = [set(rec[r]["tensors"]) for r in range(4)]
    # the replicated gradients are split within each node: each node stores each once
    assert keys[0] and keys[1] and not keys[0] & keys[1] and keys[0] | keys[1] == keys[2] | keys[3], keys
    assert not keys[2] & keys[3]

    def recovers(name, step, world=4, nodes="aacc", more=(), said=(), env=on):
        out = launch(world, {"runs": [dict(model, seed=7, adacheck=ac, actions=[
            ["load", ck], ["steps"], ["dump", name], *more])]}, f"{d}/{name}", rank_env=env(nodes))
        check(out)
        for rank, text in said:
            assert text in out[rank][1], out[rank][1][-3000:]
        got = results(f"{d}/{name}")[0]
        assert got["steps"][0] == step, got
        u, k = state(f"{d}/a", f"U{step}")
        assert_same(u, dump(f"{d}/{name}", name), k)
        return got

    keep_a = f"{d}/keep-a"
    shutil.copytree(f"{d}/shm-a", keep_a)
    # each node without its peer copies: a step counts when the node's own ranks have it
    for node, others in (("a", ("rank2.", "rank3.")), ("b", ("rank0.", "rank1."))):
        for root, _, fs in os.walk(mem_of(node)):
            for f in fs:
                if f.startswith(others):
                    os.remove(os.path.join(root, f))
    recovers("N8", 8, nodes="aabb", said=[(0, "replayed 1 gradient delta")])
    shutil.rmtree(f"{d}/shm-a")
    shutil.copytree(keep_a, f"{d}/shm-a")
    shutil.rmtree(f"{d}/shm-b")
    # node a's copies of b's step 8 lost too: no rank replays a step the others cannot
    for f in os.listdir(deltas.step_dir(f"{mem_a}/global_step7", 8)):
        if f.startswith(("rank2.", "rank3.")):
            os.remove(os.path.join(deltas.step_dir(f"{mem_a}/global_step7", 8), f))
    recovers("D7", 7, said=[(0, "loaded global_step7 (step 7) from the memory tier"),
                            (0, "up to step 8, but step 8 is not committed for every rank")])

    def restore_a():
        shutil.rmtree(f"{d}/shm-a")
        shutil.copytree(keep_a, f"{d}/shm-a")
        shutil.rmtree(f"{d}/shm-c", ignore_errors=True)

    restore_a()
    recovers("E8", 8, world=2, nodes="ac", said=[(0, "replayed 1 gradient delta")])
    restore_a()
    b = recovers("B8", 8, more=[["train_to", 11]], said=[(2, "from other nodes' memory")])
    assert b["losses"] == ref[8:11], (b, ref)
    assert not os.path.exists(mem_a) and not os.path.exists(mem_of("c"))     # (a clean end)
    assert tags(ck) == ["global_step10"] and committed(f"{ck}/global_step10", 10, world=4) == [11]
    recovers("C11", 11, nodes="aabb", said=[(0, "memory tier holds no checkpoint")],
             env=lambda nodes: lambda r: {"ADACHECK_NODE": nodes[r], "ADACHECK_MEMORY_DIR": f"{d}/other-{nodes[r]}"})


def test_online_deltas_from_a_peer_are_checked_before_they_are_kept(tmp_path):
    """The peer receive path of online deltas: a step arrives as its rank's files only, with a valid
    record of that step and rank and a gradients file of the record's size, dtypes and shapes;
    anything else is refused and nothing is left where the step's files go.  The oracle for the
    step that is accepted: the gradient read back equals the tensor recorded."""
    import torch
    from adacheck.errors import FormatError
    from adacheck.tiers import Reused, pack_files, pack_step, receive_step, unpack_files
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    g = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    lg = deltalog.DeltaLog(src, 2, "n0nce", fsync=False)
    lg.begin(5)
    lg.add("w", g)
    lg.submit(5, {"lr": 0.1})
    lg.close()
    files = {name: bytes(b) for name, b in unpack_files(pack_step(src, 5, 2)).items()}
    assert sorted(files) == ["rank2.json", "rank2.safetensors"]
    assert pack_step(src, 6, 2) is None and bytes(pack_step(src, 5, 2).numpy()) == pack_files(files)
    kept = Reused()       # (the peer thread's: one buffer read into at every step)
    for _ in range(2):
        block = pack_step(src, 5, 2, kept)
        assert bytes(block.numpy()) == pack_files(files) and block.data_ptr() == kept(1).data_ptr()
    here = deltas.step_dir(dst, 5)

    def refused(bad, match, rank=2):
        with pytest.raises(FormatError, match=match):
            receive_step(dst, 5, rank, bad, "test")
        assert not os.path.isdir(here) or not os.listdir(here)

    refused({"../rank2.json": files["rank2.json"]}, "came as")
    refused(dict(files, **{"rank2.json.evil": b"x"}), "came as")
    refused({"rank3.json": files["rank2.json"], "rank3.safetensors": files["rank2.safetensors"]},
            "lies where step 5 of rank 3 belongs", rank=3)
    refused({"rank2.json": files["rank2.json"]}, "without rank2.safetensors")
    refused(dict(files, **{"rank2.safetensors": files["rank2.safetensors"][:-1]}), "its record says")
    wrong = files["rank2.safetensors"].replace(b'"shape":[3,4]', b'"shape":[4,3]')   # (the same size)
    assert wrong != files["rank2.safetensors"]
    refused(dict(files, **{"rank2.safetensors": wrong}), r"bfloat16\[4, 3\] as 'grad/w', its record says bfloat16\[3, 4\]")
    with pytest.raises(FormatError, match="not a table of files"):
        unpack_files(b"\xff" * 20)
    # the memory tier has a spare file (a retired chain's, longer than this step's): the step is
    # written over it, and cut to the bytes sent
    from adacheck.tiers import spares_of
    os.makedirs(spares_of(str(tmp_path)))
    with open(os.path.join(spares_of(str(tmp_path)), "old"), "wb") as f:
        f.write(os.urandom(100_000))
    receive_step(dst, 5, 2, unpack_files(pack_files(files)), "test")
    assert os.listdir(spares_of(str(tmp_path))) == []
    with open(os.path.join(here, "rank2.safetensors"), "rb") as f:
        assert f.read() == files["rank2.safetensors"]
    steps, _ = deltas.committed_steps(dst, 4, 3, ranks=[2])
    assert [s.step for s in steps] == [5]
    assert torch.equal(deltas.read_grad(dst, steps[0], "w", 2).float(), g)


def test_megatron_online_deltas_in_the_memory_tier_recover_after_a_sigkill(tmp_path, monkeypatch):
    """TP=2 megatron-core (scripts/pretrain_gpt.py's flags) with --adacheck-online (bases every 3
    iterations), --adacheck-tiers-memory and -peer, one rank on each of two simulated nodes:
    killed after iteration 6, node b lost with its memory; a new job (other weights, rank 1 on a
    replacement node c) recovers iteration 6 from the memory tier (base 4 + deltas 5, 6; rank 1's
    part of all three from node a's peer copies) with every rank's weights, main weights and
    optimizer state equal to the killed job's there (megatron-core's objects), and trains on with
    the losses of a run never checkpointed."""
    import shutil
    from test_megatron import assert_same_dumps
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "megatron-online-tiers")
    ck = f"{d}/ck"

    on = partial(on_nodes, d)

    argv = ["--tensor-model-parallel-size", "2", "--global-batch-size", "2"]
    on_argv = argv + ["--adacheck", "--adacheck-dir", ck, "--adacheck-online", "--adacheck-online-base-interval", "3",
                      "--adacheck-tiers-memory", "--adacheck-tiers-peer", "--adacheck-tiers-persist-interval", "10"]
    out = launch(2, {"runs": [{"argv": on_argv, "actions": [["online"], ["train", 6], ["dump", "a"],
                                                            ["online", False], ["die"]]}]},
                 d, script="megatron_worker.py", rank_env=on("ab"))
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    mem_a = memory_of(monkeypatch, d, ck, "a")
    assert tags(ck) == [] and tags(mem_a) == ["iter_0000001", "iter_0000004"]
    assert committed(f"{mem_a}/iter_0000004", 4) == [5, 6]      # (rank 1's steps: node b's, copied here)
    shutil.rmtree(f"{d}/shm-b")
    out = launch(2, {"runs": [{"argv": argv, "actions": [["train", 8]]},
                              {"argv": on_argv, "actions": [["online"], ["scramble"], ["load", ck], ["dump", "b"],
                                                            ["train", 2], ["online", False],
                                                            ["copy_memory", ck, "mem"]]}]},
                 d, script="megatron_worker.py", rank_env=on("ac"))
    check(out)
    said = out[0][1]
    assert "loaded AdaCheck checkpoint iteration 6 from the memory tier" in said, said[-3000:]
    assert "replayed 2 gradient deltas (steps 5-6) on base step 4" in said, said[-3000:]
    # node c (rank 1's, copied before the exit) received node b's part of base 4 and rank 1's
    # deltas from node a's peer copies
    mem_c = f"{d}/mem-rank1"
    assert "iter_0000004" in tags(mem_c)
    # (5, 6 received; 7, the next base's iteration, recorded by the resumed chain on node c)
    assert [s.step for s in deltas.committed_steps(f"{mem_c}/iter_0000004", 4, 2, ranks=[1])[0]] == [5, 6, 7]
    # the clean exit persisted the newest checkpoint (base 7) and then emptied both nodes' memory
    assert tags(ck) == ["iter_0000007"]
    assert tags(memory_of(monkeypatch, d, ck, "a")) == [] and tags(memory_of(monkeypatch, d, ck, "c")) == []
    ref, b = results(d)
    assert b["loaded"] == [6] and b["losses"] == ref["losses"][6:8], (b, ref)
    assert_same_dumps(d, "a", "b", 2)


@pytest.mark.parametrize("exchange", ["ring", "partitioned"])
def test_megatron_recovers_from_the_memory_tier_after_a_sigkill(tmp_path, monkeypatch, exchange):
    """TP=2 megatron-core (scripts/pretrain_gpt.py's flags, --adacheck-tiers-memory and -peer,
    nothing copied to the checkpoint directory yet), one rank on each of two simulated nodes: the
    job is killed after iteration 5 and node b's memory is lost; a new job (other weights, rank 1
    on a replacement node c) loads iteration 3 from memory (rank 1's part from node a's peer
    copy), and after 2 more iterations every rank's weights, main weights and optimizer state
    equal the killed job's at iteration 5 (read from megatron-core's objects).  Node c's ranks
    stage at the first try: it is sent the job's objects and, saved in parts, rank 0's rank file
    (a ShardedObject rank 1 loads has its main replica there), and no part."""
    import shutil
    from test_megatron import assert_same_dumps
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "megatron-tiers")
    ck = f"{d}/ck"

    on = partial(on_nodes, d)

    argv = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--adacheck", "--adacheck-exchange",
            exchange, "--adacheck-tiers-memory", "--adacheck-tiers-peer", "--adacheck-tiers-persist-interval", "10"]
    out = launch(2, {"runs": [{"argv": argv, "actions": [["train", 3], ["save", ck], ["train", 2], ["dump", "a"],
                                                          ["die"]]}]},
                 d, script="megatron_worker.py", rank_env=on("ab"))
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    for node in "ab":
        assert tags(ck) == [] and tags(memory_of(monkeypatch, d, ck, node)) == ["iter_0000003"]
        raw = json.load(open(f"{memory_of(monkeypatch, d, ck, node)}/iter_0000003/manifest.json"))
        assert (raw["format_version"] == 6) == (exchange == "partitioned")
    shutil.rmtree(f"{d}/shm-b")
    out = launch(2, {"runs": [{"argv": argv, "actions": [["scramble"], ["load", ck], ["train", 2], ["dump", "b"]]}]},
                 d, script="megatron_worker.py", rank_env=on("ac"))
    check(out)
    assert "loaded AdaCheck checkpoint iteration 3 from the memory tier" in out[0][1], out[0][1][-3000:]
    # (at once: rank 1 reads the job's objects and a ShardedObject whose main replica rank 0 saved,
    # sent to node c first)
    assert "staging from the memory tier failed" not in out[0][1], out[0][1][-3000:]
    got = os.listdir(f"{memory_of(monkeypatch, d, ck, 'c')}/iter_0000003")
    assert (exchange == "partitioned") == ("manifest-g0-rank-00000.json" in got), got
    assert not [f for f in got if "-part-" in f], got
    assert tags(memory_of(monkeypatch, d, ck, "c")) == ["iter_0000003"]       # (node c received rank 1's part)
    assert results(str(tmp_path))[0]["loaded"] == [3]
    assert_same_dumps(str(tmp_path), "a", "b", 2)


def test_megatron_partitioned_exchange_with_the_memory_tier_after_a_sigkill(tmp_path, monkeypatch):
    """TP=2 megatron-core on one node, --adacheck-exchange partitioned with --adacheck-tiers-memory
    (every 2nd save copied to the checkpoint directory): killed after iteration 6, the memory holds
    iterations 5 and 6 in parts (format 5) and the directory iteration 5.  A new job (other weights)
    loads iteration 6 from memory; a job without that memory loads 5 from the directory; every
    rank's weights, main weights and optimizer state equal the killed job's there (megatron-core's
    objects)."""
    from test_megatron import assert_same_dumps
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "megatron-parts")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    ck = f"{d}/ck"
    mem = memory_location(LOCAL, ck)
    argv = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--adacheck", "--adacheck-exchange",
            "partitioned", "--adacheck-tiers-memory", "--adacheck-tiers-persist-interval", "2"]
    out = launch(2, {"runs": [{"argv": argv, "actions": [["train", 3], ["save", ck], ["train", 2], ["dump", "a5"],
                                                          ["save", ck], ["train", 1], ["dump", "a6"], ["save", ck],
                                                          ["finish"], ["die"]]}]},
                 d, script="megatron_worker.py")
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    assert tags(mem) == ["iter_0000005", "iter_0000006"] and tags(ck) == ["iter_0000005"]
    for where in (f"{mem}/iter_0000006", f"{ck}/iter_0000005"):
        assert json.load(open(f"{where}/manifest.json"))["format_version"] == 6, where
    said = cli("verify", f"{ck}/iter_0000005")     # (every part and rank file there, as the root says)
    assert "OK" in said, said
    out = launch(2, {"runs": [{"argv": argv, "actions": [["scramble"], ["load", ck], ["dump", "b6"]]}]}, f"{d}/b",
                 script="megatron_worker.py")
    check(out)
    assert "loaded AdaCheck checkpoint iteration 6 from the memory tier" in out[0][1], out[0][1][-3000:]
    assert_same_dumps(d, "a6", "b/b6", 2)
    out = launch(2, {"runs": [{"argv": argv, "actions": [["scramble"], ["load", ck], ["dump", "c5"]]}]}, f"{d}/c",
                 script="megatron_worker.py", rank_env=lambda r: {"ADACHECK_MEMORY_DIR": f"{d}/other-shm"})
    check(out)
    assert "memory tier holds no checkpoint" in out[0][1], out[0][1][-3000:]
    assert_same_dumps(d, "a5", "c/c5", 2)


@pytest.mark.parametrize("exchange", ["ring", "partitioned"])
def test_memory_and_peer_tiers_across_two_nodes_survive_the_loss_of_one(tmp_path, monkeypatch, exchange):
    """Four ranks (ZeRO-2 bf16 DP=4) on two simulated nodes (a: ranks 0-1, b: ranks 2-3, each node
    its own memory directory), tiers memory + peer, asynchronous, every 4th save persisted.  The job is killed
    after step 5.  Node b is lost (its memory deleted): the job restarted with a replacement node
    c recovers step 5 exactly from node a's memory (its own files and its peer copy of b's); with
    b's peer copy lost too it falls back to durable step 4 and says so; another layout (DP=2, one
    rank per node) recovers step 5 from the nodes' memories as well.  The oracle is DeepSpeed's
    own state at each step (ds_worker's dumps).  Partitioned: every node's memory copy is a
    checkpoint in parts (format 5) with its ranks' parts and rank files (and the peer copies of
    the other node's), and the copy in the checkpoint directory passes `adacheck verify`."""
    import shutil
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-2")
    ck = f"{d}/ck"

    mem_of, on = partial(memory_of, monkeypatch, d, ck), partial(on_nodes, d)

    # (asynchronous: writer processes write the memory copies and send the peer copies)
    tiered = {"enabled": True, "async": True, "exchange": exchange,
              "tiers": {"memory": True, "peer": True, "persist_interval": 4}}
    actions = []
    for step in range(1, 6):
        actions += [["train", 1]] + ([["dump", f"A{step}"]] if step in (4, 5) else []) + [["save", ck]]
    out = launch(4, {"runs": [{"stage": 2, "dtype": "bf16", "adacheck": tiered,
                               "actions": actions + [["finish"], ["die"]]}]}, f"{d}/a", rank_env=on("aabb"))
    assert [rc for rc, _ in out] == [-9] * 4, out[0][1][-3000:]
    assert tags(ck) == ["global_step4"]
    mem_a, mem_b = mem_of("a"), mem_of("b")
    assert tags(mem_a) == tags(mem_b) == ["global_step4", "global_step5"]
    m = manifest_files.read_manifest(f"{mem_a}/global_step5")
    files = {f: int(i["writer"]) for f, i in m.files.items()}
    assert sorted(set(files.values())) == [0, 1, 2, 3], files     # (each node writes what its ranks hold)
    for mem in (mem_a, mem_b):       # (and holds the other node's files too: its peer copy)
        assert all(os.path.getsize(f"{mem}/global_step5/{f}") == m.files[f]["nbytes"] for f in files)
    # the memory copies of the durable checkpoint went there with it (each writer's own)
    assert sorted(os.listdir(f"{ck}/global_step4")) == sorted(os.listdir(f"{mem_a}/global_step4"))
    if exchange == "partitioned":
        for mem in (mem_a, mem_b):      # (in parts, on both nodes: each rank's files and their peer copies)
            raw = open(f"{mem}/global_step5/manifest.json", "rb").read()
            assert json.loads(raw)["format_version"] == 6 and raw == open(f"{mem_a}/global_step5/manifest.json",
                                                                          "rb").read()
            assert {f"manifest-g0-{k}-{r:05d}.json" for k in ("part", "rank") for r in range(4)} <= set(
                os.listdir(f"{mem}/global_step5")), os.listdir(f"{mem}/global_step5")
        said = cli("verify", f"{ck}/global_step4")
        assert "OK" in said, said

    # node b is lost, and node a's peer copy of its files too: nothing in memory is complete
    keep_a = f"{d}/keep-a"
    shutil.copytree(f"{d}/shm-a", keep_a)
    shutil.rmtree(f"{d}/shm-b")
    for f, w in files.items():
        if w >= 2:
            os.remove(f"{mem_a}/global_step5/{f}")
            os.remove(f"{mem_a}/global_step4/{f}")
    run = [{"stage": 2, "dtype": "bf16", "seed": 7, "adacheck": tiered, "actions": [["load", ck], ["dump", "B"]]}]
    out = launch(4, {"runs": run}, f"{d}/b", rank_env=on("aacc"))
    check(out)
    assert "the memory tier holds no complete checkpoint" in out[0][1], out[0][1][-3000:]
    a4, keys = state(f"{d}/a", "A4")
    assert_same(a4, dump(f"{d}/b", "B"), keys)

    # with node a's memory as it was (its peer copy of b's files), the replacement node c gets them
    shutil.rmtree(f"{d}/shm-a")
    shutil.copytree(keep_a, f"{d}/shm-a")
    out = launch(4, {"runs": run}, f"{d}/c", rank_env=on("aacc"))
    check(out)
    assert "loaded global_step5 (step 5) from the memory tier" in out[0][1], out[0][1][-3000:]
    assert "from other nodes' memory" in out[2][1], out[2][1][-3000:]
    a5, keys = state(f"{d}/a", "A5")
    assert_same(a5, dump(f"{d}/c", "B"), keys)
    mem_c = mem_of("c")
    # (what its ranks read, at once: the job's objects every rank reads too)
    assert all(w < 2 for f, w in files.items() if not os.path.exists(f"{mem_c}/global_step5/{f}"))
    assert "staging from the memory tier failed" not in out[0][1], out[0][1][-3000:]
    if exchange == "partitioned":       # (what its ranks read: their rank files and the meta file, not the parts)
        got = os.listdir(f"{mem_c}/global_step5")
        assert {"manifest-g0-rank-00002.json", "manifest-g0-rank-00003.json", "manifest-g0-meta.json"} <= set(got)
        assert not [f for f in got if "-part-" in f or f in ("manifest-g0-rank-00000.json",
                                                             "manifest-g0-rank-00001.json")], got

    # another layout: DP=2, one rank on each node, from the nodes' memories
    out = launch(2, {"runs": [dict(run[0], stage=1)]}, f"{d}/e", rank_env=on("ac"))
    check(out)
    assert "loaded global_step5 (step 5) from the memory tier" in out[0][1], out[0][1][-3000:]
    assert_same(a5, dump(f"{d}/e", "B"), keys)


def test_partitioned_exchange_with_the_memory_tier(tmp_path, monkeypatch):
    """``exchange: "partitioned"`` with the memory tier (ZeRO-1 bf16, 2 ranks, asynchronous, every
    2nd save persisted).  On one node the memory copies are checkpoints in parts (format 5), and
    the copy to the checkpoint directory takes each rank's part and rank file with its shard file.
    The job is killed after step 3.  A job on two nodes (a, and c whose memory is empty) recovers
    step 3 from node a's memory, node c receiving every file of it; its own save across nodes is in
    parts on each node too, and is persisted at its clean exit.  A job without the memory loads both checkpoints from the directory.  The oracle is
    DeepSpeed's own state at each step (ds_worker's dumps), and `adacheck verify`."""
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-parts")
    ck = f"{d}/ck"
    mem_of, on = partial(memory_of, monkeypatch, d, ck), partial(on_nodes, d)
    tiered = {"enabled": True, "async": True, "exchange": "partitioned",
              "tiers": {"memory": True, "persist_interval": 2}}
    model = {"stage": 1, "dtype": "bf16"}
    actions = []
    for step in range(1, 4):
        actions += [["train", 1]] + ([["dump", f"A{step}"]] if step >= 2 else []) + [["save", ck]]
    out = launch(2, {"runs": [dict(model, adacheck=tiered, actions=actions + [["finish"], ["die"]])]}, f"{d}/a",
                 rank_env=on("aa"))
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    mem_a = mem_of("a")
    assert tags(ck) == ["global_step2"] and tags(mem_a) == ["global_step2", "global_step3"]
    for where in (f"{ck}/global_step2", f"{mem_a}/global_step3"):
        assert json.load(open(f"{where}/manifest.json"))["format_version"] == 6, where
    # the directory's copy holds every file of the memory copy (the parts, rank files and meta file too)
    assert sorted(os.listdir(f"{ck}/global_step2")) == sorted(os.listdir(f"{mem_a}/global_step2"))
    assert {"manifest-g0-part-00001.json", "manifest-g0-rank-00001.json", "manifest-g0-meta.json"} <= set(
        os.listdir(f"{ck}/global_step2")), os.listdir(f"{ck}/global_step2")
    said = cli("verify", f"{ck}/global_step2")
    assert "OK" in said, said

    # rank 0 on node a, rank 1 on a new node c: step 3 from a's memory, c given all of it
    run = dict(model, seed=7, adacheck=tiered, actions=[["load", ck], ["dump", "B3"], ["train", 1], ["dump", "B4"],
                                                        ["save", ck]])
    out = launch(2, {"runs": [run]}, f"{d}/b", rank_env=on("ac"))
    check(out)
    assert "loaded global_step3 (step 3) from the memory tier" in out[0][1], out[0][1][-3000:]
    assert "from other nodes' memory" in out[1][1], out[1][1][-3000:]
    a3, keys = state(f"{d}/a", "A3")
    assert_same(a3, dump(f"{d}/b", "B3"), keys)
    # (its save across nodes, in parts on each node, persisted at the clean exit: each rank copied
    # its files from its own node's memory)
    assert tags(ck) == ["global_step2", "global_step4"] and commit.read_latest(ck) == "global_step4"
    assert json.load(open(f"{ck}/global_step4/manifest.json"))["format_version"] == 6
    said = cli("verify", f"{ck}/global_step4")
    assert "OK" in said, said

    # without the memory tier: the newest from the directory, and the one persisted in parts
    runs = [dict(model, seed=9, adacheck=tiered, actions=[["load", ck], ["dump", "C4"]]),
            dict(model, seed=9, adacheck=tiered, actions=[["load", ck, {"tag": "global_step2"}], ["dump", "C2"]])]
    out = launch(2, {"runs": runs}, f"{d}/c", rank_env=lambda r: {"ADACHECK_MEMORY_DIR": f"{d}/other-shm"})
    check(out)
    b4, keys = state(f"{d}/b", "B4")
    assert_same(b4, dump(f"{d}/c", "C4"), keys)
    a2, keys = state(f"{d}/a", "A2")
    assert_same(a2, dump(f"{d}/c", "C2"), keys)


def test_a_tag_saved_again_through_the_memory_tier_leaves_the_committed_files_of_that_tag(tmp_path, monkeypatch):
    """A re-saved tag never writes over a committed checkpoint's files, also when the memory tier
    copies it in: global_step1 (whose file global_step2 references) is saved again by a job with
    the memory tier, whose memory copy of the tag is its first (generation 0 there); its files come
    into the checkpoint directory under a generation of their own, so the old file keeps its
    bytes, global_step2 still loads what it saved, and global_step1 what the new job saved."""
    import hashlib
    import torch
    from adacheck.checkpoint import Checkpointer, Options
    from adacheck.integration import LocalShard, LocalState
    from adacheck.config import TiersConfig
    from adacheck.plan.exchange import SoloComm
    from adacheck.types import Box
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", "job-resave")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    ck, comm = f"{d}/ck", SoloComm()

    def collect(w, frozen, step):
        return lambda: LocalState(shards=[
            LocalShard("model/w", "model", (4,), Box.full((4,)), torch.full((4,), float(w))),
            LocalShard("model/frozen", "model", (4,), Box.full((4,)), torch.full((4,), float(frozen)))],
            framework={"name": "toy"}, step=step)

    def load(tag):
        return Checkpointer(options=Options(fsync=False)).load(
            comm, ck, tag, Restore.of(lambda r: (r.read("model/w").tolist(), r.read("model/frozen").tolist()))).result

    first = Checkpointer(options=Options(fsync=False))
    first.save(comm, ck, "global_step1", collect(1, 7, 1))
    first.save(comm, ck, "global_step2", collect(2, 7, 2))      # (its frozen weights: global_step1's file)
    files = {f: hashlib.sha256(open(f"{ck}/global_step1/{f}", "rb").read()).hexdigest()
             for f in os.listdir(f"{ck}/global_step1") if f.endswith(".safetensors")}
    assert "global_step1/" in open(f"{ck}/global_step2/manifest.json").read()
    tiered = TieredCheckpointer(options=Options(fsync=False, tiers=TiersConfig(memory=True, persist_interval=1)))
    tiered.save(comm, ck, "global_step1", collect(100, 200, 1))
    tiered.finish()
    tiered.close()
    for f, digest in files.items():
        assert hashlib.sha256(open(f"{ck}/global_step1/{f}", "rb").read()).hexdigest() == digest, f
    assert load("global_step2") == ([2.0] * 4, [7.0] * 4)
    assert load("global_step1") == ([100.0] * 4, [200.0] * 4)


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_copy_to_the_directory_that_fails_on_storage_is_said_as_on_error_asks(tmp_path, monkeypatch, on_error):
    """The copy of a memory checkpoint to durable storage fails with an OSError (the directory's
    parent is a file): finish() raises it with on_error "raise", or warns with a SaveWarning;
    the checkpoint stays in memory either way.  (It was only logged, whatever on_error said.)"""
    import torch
    from adacheck.checkpoint import Options
    from adacheck.integration import LocalShard, LocalState
    from adacheck.config import TiersConfig
    from adacheck.errors import SaveWarning
    from adacheck.plan.exchange import SoloComm
    from adacheck.types import Box
    d = str(tmp_path)
    monkeypatch.setenv("ADACHECK_JOB", f"job-{on_error}")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", f"{d}/shm")
    open(f"{d}/afile", "w").close()
    ck = f"{d}/afile/ck"
    job = TieredCheckpointer(options=Options(fsync=False, on_error=on_error, tiers=TiersConfig(memory=True,
                                                                                         persist_interval=1)))
    job.save(SoloComm(), ck, "s1", lambda: LocalState(
        shards=[LocalShard("master/w", "master", (4,), Box.full((4,)), torch.arange(4.0))], step=1))
    if on_error == "raise":
        with pytest.raises(OSError):
            job.finish()
    else:
        with pytest.warns(SaveWarning, match="copying s1 from the memory tier to durable storage failed"):
            job.finish()
    assert tags(memory_location(LOCAL, ck)) == ["s1"]
    job.close()         # (it tries the copy once more, and says so: the interpreter is not exiting here)


def test_committing_a_copy_leaves_the_files_of_the_next_copy_in_flight(tmp_path):
    """Rank 0 commits the copy of s1 to the checkpoint directory while another rank, done with
    its part of s1, already copies its files of s2 there (no manifest yet): the retention and
    clean-up after s1's commit leave them, and s2 then commits and loads.  (Every directory
    without a manifest was cleaned up as an abandoned save: the next copy failed, its checkpoint
    lost from both tiers once memory retired it.)"""
    import shutil
    import torch
    from adacheck.checkpoint import Checkpointer, Options, confirm_files
    from adacheck.integration import LocalShard, LocalState
    from adacheck.plan.exchange import SoloComm
    from adacheck.tiers import persist_checkpoint
    from adacheck.types import Box
    mem, ck, comm = str(tmp_path / "mem"), str(tmp_path / "ck"), SoloComm()
    memory = Checkpointer(options=Options(fsync=False, reference_previous=False))
    for step in (1, 2):
        memory.save(comm, mem, f"s{step}", lambda step=step: LocalState(
            shards=[LocalShard("master/w", "master", (4,), Box.full((4,)), torch.full((4,), float(step)))], step=step))
    os.makedirs(f"{ck}/s2")
    ahead = [f for f in os.listdir(f"{mem}/s2") if f.endswith(".safetensors")]
    for f in ahead:          # (the other rank's copy of s2, under way)
        shutil.copy(f"{mem}/s2/{f}", f"{ck}/s2/{f}")
    assert persist_checkpoint(0, f"{mem}/s1", LOCAL, ck, "s1", False, True, 1, confirm_files)
    assert sorted(os.listdir(f"{ck}/s2")) == sorted(ahead)
    assert persist_checkpoint(0, f"{mem}/s2", LOCAL, ck, "s2", False, True, 1, confirm_files)
    got = Checkpointer().load(comm, ck, None, Restore.of(lambda r: r.read("master/w").tolist()))
    assert got.ckpt_dir.endswith("s2") and got.result == [2.0] * 4
    assert tags(ck) == ["s2"]       # (keep_last 1: s1 retired, its files removed)
    left = os.listdir(f"{ck}/s1") if os.path.isdir(f"{ck}/s1") else []
    assert not [f for f in left if f.endswith(".safetensors")], left


def test_the_newest_memory_checkpoint_is_copied_at_exit_also_when_the_job_was_let_go(tmp_path):
    """A script saves s1-s3 through the memory tier (persist_interval 2: s2 is copied, s3 is in
    memory only) in a function whose Checkpointer is garbage-collected when it returns, and ends
    without closing anything: at exit s3 is copied to the checkpoint directory, 'latest' names it
    and it loads.  (The exit hook held the job weakly: s3 stayed in memory, no warning, exit 0.)"""
    import textwrap
    from adacheck.checkpoint import Checkpointer
    from adacheck.plan.exchange import SoloComm
    d, ck = str(tmp_path), str(tmp_path / "ck")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import gc
        import torch
        from adacheck.checkpoint import Options
        from adacheck.integration import LocalShard, LocalState
        from adacheck.tiers.tiered import TieredCheckpointer
        from adacheck.config import TiersConfig
        from adacheck.plan.exchange import SoloComm
        from adacheck.types import Box

        def main():
            job = TieredCheckpointer(options=Options(fsync=False, tiers=TiersConfig(memory=True, persist_interval=2)))
            for step in (1, 2, 3):
                job.save(SoloComm(), {ck!r}, f"s{{step}}", lambda: LocalState(shards=[LocalShard(
                    "master/w", "master", (4,), Box.full((4,)), torch.full((4,), float(step)))], step=step))
            job.finish()

        main()
        gc.collect()
        print(sorted(__import__("os").listdir({ck!r})))
        """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, ADACHECK_JOB="job-let-go", ADACHECK_MEMORY_DIR=f"{d}/shm"))
    assert p.returncode == 0, p.stdout + p.stderr
    # (before the exit; the job still owns the directory: its lease)
    assert p.stdout.strip().splitlines()[-1] == "['.adacheck-lease.json', 'README', 'latest', 's2']", p.stdout
    assert open(f"{ck}/latest").read().strip() == "s3"
    assert not os.path.exists(f"{ck}/.adacheck-lease.json")       # (removed at its exit)
    got = Checkpointer().load(SoloComm(), ck, None, Restore.of(lambda r: r.read("master/w").tolist()))
    assert got.ckpt_dir.endswith("s3") and got.result == [3.0] * 4


def test_at_exit_the_newest_committed_memory_checkpoint_is_copied_when_the_last_memory_save_failed(tmp_path):
    """A script saves s1 asynchronously through the memory tier (not yet copied: persist_interval
    10), then s2, whose memory save fails (a file stands where its directory goes), and ends without
    closing anything: at exit s1, the state training went on from, is copied to the checkpoint
    directory, and 'latest' names it.  (Exit tried to copy s2, which has no manifest, warned that
    it "stays in the memory tier", and left s1 in memory only.)"""
    import textwrap
    d, ck = str(tmp_path), str(tmp_path / "ck")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import os
        import torch
        from adacheck.checkpoint import Options
        from adacheck.integration import LocalShard, LocalState
        from adacheck.tiers.tiered import TieredCheckpointer
        from adacheck.config import TiersConfig
        from adacheck.plan.exchange import SoloComm
        from adacheck.storage.backends import LOCAL
        from adacheck.tiers import memory_location
        from adacheck.types import Box

        job = TieredCheckpointer(options=Options(fsync=False, tiers=TiersConfig(memory=True, persist_interval=10)))
        for step in (1, 2):
            if step == 2:
                open(memory_location(LOCAL, {ck!r}) + "/s2", "w").close()
            job.save_async(SoloComm(), {ck!r}, f"s{{step}}", lambda: LocalState(shards=[LocalShard(
                "master/w", "master", (4,), Box.full((4,)), torch.full((4,), float(step)))], step=step))
            job.finish()
        print([x for x in (os.listdir({ck!r}) if os.path.isdir({ck!r}) else []) if x != ".adacheck-lease.json"])
        """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, ADACHECK_JOB="job-failed-last",
                                ADACHECK_MEMORY_DIR=f"{d}/shm"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout     # (nothing copied before the exit; its lease)
    assert "asynchronous save of" in p.stderr and "s2 failed" in p.stderr, p.stderr
    assert "persisting s1, the newest checkpoint there, instead" in p.stderr, p.stderr
    assert open(f"{ck}/latest").read().strip() == "s1"
    shards = [f for f in os.listdir(f"{ck}/s1") if f.endswith(".safetensors")]
    assert load_file(f"{ck}/s1/{shards[0]}")["master/w@0+4"].tolist() == [1.0] * 4, shards    # (safetensors reads it)


def test_a_memory_save_that_fails_when_its_copy_is_due_makes_the_next_copy_due(tmp_path, monkeypatch):
    """persist_interval 2, asynchronous memory saves: s2's copy to the checkpoint directory is due,
    but its memory save fails (a file stands where its directory goes); s3 is then copied, not
    s4.  (s3 was the first of a new interval: the directory stayed empty for another interval.)"""
    import warnings
    import torch
    from adacheck.checkpoint import Options
    from adacheck.integration import LocalShard, LocalState
    from adacheck.config import TiersConfig
    from adacheck.errors import SaveWarning
    from adacheck.plan.exchange import SoloComm
    from adacheck.types import Box
    monkeypatch.setenv("ADACHECK_JOB", "job-due")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", str(tmp_path / "shm"))
    ck = str(tmp_path / "ck")
    job = TieredCheckpointer(options=Options(fsync=False, tiers=TiersConfig(memory=True, persist_interval=2)))
    for step in (1, 2, 3):
        if step == 2:
            open(os.path.join(memory_location(LOCAL, ck), "s2"), "w").close()
        job.save_async(SoloComm(), ck, f"s{step}", lambda step=step: LocalState(shards=[LocalShard(
            "master/w", "master", (4,), Box.full((4,)), torch.full((4,), float(step)))], step=step))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            job.finish()
        failed = [w for w in said if issubclass(w.category, SaveWarning) and "s2 failed" in str(w.message)]
        assert bool(failed) == (step == 2), (step, [str(w.message) for w in said])
        if step < 3:
            assert not os.path.exists(os.path.join(ck, "latest")), step
    assert open(os.path.join(ck, "latest")).read().strip() == "s3"
    shard = next(f for f in os.listdir(os.path.join(ck, "s3")) if f.endswith(".safetensors"))
    assert load_file(os.path.join(ck, "s3", shard))["master/w@0+4"].tolist() == [3.0] * 4   # (safetensors reads it)
    job.close()


def test_at_exit_a_failed_memory_save_with_none_committed_before_leaves_nothing_in_memory(tmp_path, monkeypatch):
    """The job's only memory save fails at its commit (its manifest cannot be put in place): at
    close nothing of the job stays in the memory directory.  (Close found no committed checkpoint
    to persist and left the directory, its SOURCE file and the failed save's, in /dev/shm.)"""
    import warnings
    import torch
    from adacheck.checkpoint import Options
    from adacheck.integration import LocalShard, LocalState
    from adacheck.config import TiersConfig
    from adacheck.errors import SaveWarning
    from adacheck.plan.exchange import SoloComm
    from adacheck.types import Box
    monkeypatch.setenv("ADACHECK_JOB", "job-none-committed")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", str(tmp_path / "shm"))
    ck = str(tmp_path / "ck")
    job = TieredCheckpointer(options=Options(fsync=False, tiers=TiersConfig(memory=True, persist_interval=10)))
    os.makedirs(os.path.join(memory_location(LOCAL, ck), "s1", commit.MANIFEST_NAME))   # (a directory)
    job.save_async(SoloComm(), ck, "s1", lambda: LocalState(shards=[LocalShard(
        "master/w", "master", (4,), Box.full((4,)), torch.ones(4))], step=1))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        job.finish()
    assert any(issubclass(w.category, SaveWarning) and "s1 failed" in str(w.message) and "IsADirectoryError"
               in str(w.message) for w in said), [str(w.message) for w in said]
    job.close()
    assert os.listdir(tmp_path / "shm") == []
    assert not os.path.exists(os.path.join(ck, "latest"))


def test_saves_without_an_owner_count_towards_one_persist_interval(tmp_path, monkeypatch):
    """adacheck.jobs.kept_on(None) (Megatron's save without an optimizer) is the process's one
    job: two saves with persist_interval 2 copy the second to the checkpoint directory.  (A new
    job per call counted each save as its first: nothing was copied until exit.)"""
    import torch
    from adacheck.checkpoint import lifecycle
    from adacheck.checkpoint import Options
    from adacheck.integration import LocalShard, LocalState
    from adacheck.config import TiersConfig
    from adacheck.plan.exchange import SoloComm
    from adacheck.types import Box
    monkeypatch.setenv("ADACHECK_JOB", "job-no-owner")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", str(tmp_path / "shm"))
    ck = str(tmp_path / "ck")
    options = Options(fsync=False, tiers=TiersConfig(memory=True, persist_interval=2))
    for step in (1, 2):
        jobs.kept_on(None, options).save(SoloComm(), ck, f"s{step}", lambda: LocalState(
            shards=[LocalShard("master/w", "master", (4,), Box.full((4,)), torch.full((4,), float(step)))], step=step))
    job = jobs.kept_on(None, options)
    job.finish()
    assert tags(ck) == ["s2"]
    job.close()
    lifecycle.release(job)


def test_files_from_a_peer_are_checked_before_they_are_kept(tmp_path):
    """The peer receive path: a name that leaves the directory, a size or a header that is not
    what the manifest says is refused, and nothing is left under the file's name."""
    import hashlib as _h
    import torch
    from adacheck.plan.exchange import SoloComm
    from adacheck.checkpoint import Checkpointer
    from adacheck.integration import LocalShard, LocalState
    from adacheck.errors import FormatError
    from adacheck.tiers import fetch, receive_file, shard_check
    from adacheck.types import Box
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    m = Checkpointer().save(SoloComm(), src, "t1", lambda: LocalState(
        shards=[LocalShard("w", "master", tuple(t.shape), Box.full(t.shape), t)]))
    (fname, info), = m.files.items()
    data = open(f"{src}/t1/{fname}", "rb").read()
    for bad in ("../evil.safetensors", "/tmp/evil.safetensors", "a/b.safetensors", ".."):
        with pytest.raises(FormatError, match="not a plain file name"):
            receive_file(dst, bad, data, len(data), check=None)
    assert not os.path.exists(str(tmp_path / "evil.safetensors"))
    with pytest.raises(FormatError, match="the manifest says"):
        receive_file(dst, fname, data[:-1], info["nbytes"], check=None)
    # a shard whose header holds the manifest's key with another shape
    from safetensors.torch import save as st_save
    key = m.tensors["w"].boxes[0].key
    wrong = st_save({key: torch.zeros(4, 3)}, metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"float32\[4, 3\].*the manifest says float32\[3, 4\]"):
        receive_file(dst, fname, wrong, len(wrong), check=shard_check(m, fname))
    assert not os.listdir(dst)
    receive_file(dst, fname, data, len(data), check=shard_check(m, fname))
    assert open(f"{dst}/{fname}", "rb").read() == data
    # a manifest that is not the agreed one is refused before anything is written
    raw = open(f"{src}/t1/manifest.json", "rb").read()
    plan = {"tag": "t1", "digest": _h.sha256(raw + b" ").hexdigest(), "moves": [(None, 0, 0), (fname, 0, 0)],
            "nbytes": {}}
    with pytest.raises(FormatError, match="not the one agreed on"):
        fetch(SoloComm(), f"{src}/t1", plan)


def test_the_peer_copy_of_a_save_in_parts_keeps_only_the_senders_files(tmp_path):
    """NodeSpread.move_own between two real ranks on simulated nodes (tests/peer_worker.py): each
    rank's shard file, part, rank file (and rank 0's meta file) arrive at the other node as they
    were sent; a block that also holds a name that is not the sender's (one leading out of the
    directory, one of another rank) is refused on the receiving rank, and nothing of it is kept
    outside; a shard file written for another checkpoint is refused and not kept.  Blocks that
    Comm.transfer receives into a buffer kept from round to round (the online deltas' peer
    copies) arrive whole, in that buffer, each round."""
    from adacheck.tiers import own_files
    d = str(tmp_path)
    out = launch(2, {}, d, script="peer_worker.py", timeout=180)
    check(out)
    got = [json.load(open(f"{d}/rank{r}.json")) for r in range(2)]
    for r in range(2):
        other = 1 - r
        good = got[r]["good"]
        assert good["error"] is None and set(good["files"]) == set(own_files(0, 0) + own_files(0, 1)[:3]), good
        for name in own_files(0, other)[:3] + ([own_files(0, 0)[3]] if other == 0 else []):
            assert open(f"{d}/node{r}/good/{name}", "rb").read() == open(f"{d}/node{other}/good/{name}", "rb").read()
        foreign = got[r]["foreign"]
        assert "FormatError" in foreign["error"] and "not one of its names" in foreign["error"], foreign
        assert not set(foreign["files"]) & set(own_files(0, other)), foreign
        assert json.load(open(f"{d}/node{r}/evil.json")) == {"rank": r}      # (not written over from outside)
        wrong = got[r]["wrong_tag"]
        assert "FormatError" in wrong["error"] and "'other'" in wrong["error"], wrong
        assert own_files(0, other)[0] not in wrong["files"] and not [f for f in wrong["files"] if ".tmp" in f], wrong
        rounds = got[r]["reused"]    # (the buffer is alive throughout: no other memory has its address)
        assert [x["same"] for x in rounds] == [True] * 3, rounds
        assert [x["at"] for x in rounds] == [x["buffer"] for x in rounds] and rounds[0]["at"] == rounds[1]["at"], rounds


def test_a_replacement_node_is_planned_the_deltas_its_ranks_read():
    """delta_moves (pure): three nodes a, b, e recorded a chain per node (b's peer copies on e);
    b is replaced by c.  Node c is sent the chain file and ranks 2-3's steps from e, up to the
    last step e holds for both (rank 2: 2 steps, rank 3: 3), and nodes a and e nothing.  A
    report of another checkpoint under the same tag (another digest) counts for nothing.  In
    another layout (3 ranks, one per node) every node is sent every rank's steps it lacks."""
    from adacheck.tiers import delta_moves
    rep = {"digest": "x", "chain": {"nodes": list("aabbee")}}
    on_a = {"t": dict(rep, steps={0: (3, 300), 1: (3, 300), 4: (3, 300), 5: (3, 300)})}
    on_e = {"t": dict(rep, steps={4: (3, 300), 5: (3, 300), 2: (2, 200), 3: (3, 300)})}
    h = {"world": 6, "step": 10}
    moves = delta_moves(h, [on_a, None, None, None, on_e, None], ("t", "x"), list("aaccee"), every=False)
    assert moves == [(None, 0, 0, 2, 0), (11, 2, 4, 2, 100), (12, 2, 4, 2, 100), (11, 3, 4, 2, 100),
                     (12, 3, 4, 2, 100)], moves
    other = {"t": dict(on_a["t"], digest="y")}
    moves = delta_moves(h, [other, None, None, None, on_e, None], ("t", "x"), list("aaccee"), every=False)
    assert (None, 0, 4, 0, 0) in moves and (11, 0, 4, 0, 100) not in moves, moves   # (e holds no step of 0)
    every = delta_moves(h, [on_a, None, on_e], ("t", "x"), list("ace"), every=True)
    assert sorted(m for m in every if m[0] is None) == [(None, 0, 0, 1, 0)]
    assert sorted((s, q, src, d) for s, q, src, d, _ in every if s is not None) == sorted(
        [(s, q, 2, 0) for q in (2, 3) for s in (11, 12)]
        + [(s, q, 2 if q in (2, 3) else 0, 1) for q in range(6) for s in (11, 12)]
        + [(s, q, 0, 2) for q in (0, 1) for s in (11, 12)])



def test_a_replacement_node_is_planned_what_its_ranks_read_of_a_checkpoint_in_parts():
    """plan_recovery (pure) of a memory checkpoint in parts saved on nodes a (ranks 0-1) and b
    (ranks 2-3), a replicated weight stored once per node (by ranks 0 and 2), each rank's own
    state in its file; each node reports its files and the groups its rank files give (what
    :func:`holdings` says).  Node b lost, node a holding its peer copies: the replacement node c
    is sent ranks 2-3's rank files, the meta file and b's copies (not a's copy of the weight), no
    part (with rank 0's rank file when its ranks read rank 0's objects); in another layout every
    part too.  Restarted on a and b without peer copies: the
    checkpoint is complete from both reports together (b's regions only b's rank files name), b
    is sent the meta file only; with b's memory lost, or only rank 3's shard file, it is not."""
    from adacheck.tiers import plan_recovery
    shard, meta = "rank{:05d}-g0.safetensors".format, "manifest-g0-meta.json"
    rank_file, part = "manifest-g0-rank-{:05d}.json".format, "manifest-g0-part-{:05d}.json".format
    sizes = {**{shard(r): 100 + r for r in range(4)}, **{rank_file(r): 10 for r in range(4)},
             **{part(r): 20 for r in range(4)}, meta: 30}

    def report(present, ranks):
        groups = {((meta,), (0, 1, 2, 3))} | {((part(i),), ()) for i in range(4)}
        groups |= {((rank_file(r),), (r,)) for r in range(4)}
        for r in ranks:     # (the regions rank r's file names: the weight's two copies, its own state)
            groups |= {((shard(0), shard(2)), (r,)), ((shard(r),), (r,))}
        return {"t": {"step": 5, "digest": "x", "present": {f: sizes[f] for f in present},
                      "nbytes": {f: sizes[f] for f in present}, "groups": sorted(groups), "world": 4,
                      "derived": False, "chain": None, "steps": {},
                      "objects": {r: [(rank_file(r),)] for r in range(4)}}}

    with_peer = report(list(sizes), range(4))       # (node a: its files, and its peer copies of b's)
    plan = plan_recovery([with_peer, None, {}, None], list("aacc"), None)
    assert sorted(plan["moves"], key=str) == sorted(
        [(None, 0, 2), (rank_file(2), 0, 2), (rank_file(3), 0, 2), (meta, 0, 2), (shard(2), 0, 2), (shard(3), 0, 2)],
        key=str), plan["moves"]
    # (ranks 2-3 read objects rank 0 saved: its rank file too)
    plan = plan_recovery([with_peer, None, {}, None], list("aacc"), None, reads_objects_of=[(), (), (0,), (0, 2)])
    assert {f for f, _, dst in plan["moves"] if dst == 2} == {rank_file(0), rank_file(2), rank_file(3), meta,
                                                                shard(2), shard(3), None}, plan["moves"]
    plan = plan_recovery([with_peer, None, {}, None], list("aacc"), None, everything=True)
    assert {part(i) for i in range(4)} <= {f for f, _, dst in plan["moves"] if dst == 2}, plan["moves"]

    own = lambda ranks: [shard(r) for r in ranks] + [rank_file(r) for r in ranks] + [part(r) for r in ranks]  # noqa
    node_a, node_b = report(own((0, 1)) + [meta], (0, 1)), report(own((2, 3)), (2, 3))
    plan = plan_recovery([node_a, None, node_b, None], list("aabb"), None)
    assert plan["moves"] == [(meta, 0, 2)], plan["moves"]
    assert plan_recovery([node_a, None, {}, None], list("aabb"), None) is None
    # (rank 3's own state, which only b's report names, lost: incomplete, though every file a names is there)
    lost = report([f for f in own((2, 3)) if f != shard(3)], (2, 3))
    assert plan_recovery([node_a, None, lost, None], list("aabb"), None) is None
