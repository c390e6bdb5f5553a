"""Two jobs, one checkpoint directory (issue 64): the save directory's lease.

A second job is refused at its first save, on every rank, with the owner's name and how to take
over; nothing of the first job's is touched, and the first job's checkpoints all verify.  An owner
that was SIGKILLed stops renewing its lease: once it has expired, the next job takes the directory
over without a flag.  A takeover while the old owner still runs: the old owner's save in flight is
refused at its commit (the fencing token), and 'latest' is the new owner's.  The same on an S3
server (moto) and for megatron-core.  Real DeepSpeed / megatron-core jobs of 2 ranks (gloo, CPU);
loads by another job stay allowed."""
import contextlib
import io
import json
import os
import time

import pytest

from adacheck.storage import commit, lease
from adacheck.storage import manifest_files
from adacheck.cli import main
from adacheck.config import AdaCheckConfig
from adacheck.errors import ConfigError, FormatError, LeaseError
from adacheck.tiers.tiered import TieredCheckpointer
from adacheck.storage.backends import LOCAL
from launch import check, launch

pytestmark = pytest.mark.timeout(1800)
LONG = 1500     # seconds a first job may wait for the second (2 shared cores, jobs starting in turn)

REFUSED = "belongs to another job"
TAKEN = "took the directory over"


def job(name, node=None):
    """launch()'s rank_env for a job named ``name`` ($ADACHECK_JOB), on the machine ``node``
    ($ADACHECK_NODE; None: this one).  A lease of a job on another machine is judged by its time to
    live alone; on this one, a rank 0 that is gone ends it at once."""
    return lambda rank: dict({"ADACHECK_JOB": name}, **({"ADACHECK_NODE": node} if node else {}))


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def cli(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


def verified(ck, *opts):
    """``adacheck ls --verify``: every checkpoint of ``ck`` verifies (exit status 0)."""
    code, text = cli("ls", ck, "--verify", *opts)
    assert code == 0 and "missing" not in text and "damaged" not in text, text
    return text


def run_in_thread(fn):
    import threading
    box = {}

    def go():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            box["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()

    def join():
        t.join()
        if "error" in box:
            raise box["error"]
        return box["out"]
    return join


# ---------------------------------------------------------------------- the pure decision and the file
def at(t, **kw):
    base = dict(job="a", incarnation="i1", host="h", pid=1, acquired=t, renewed=t, ttl_s=10.0, generation=3)
    return lease.Lease(**dict(base, **kw))


def test_the_decision_on_plain_leases():
    assert lease.decide(None, "a", "i1", False, 100.0, "D") == ("acquire", 0)
    assert lease.decide(at(100.0), "a", "i1", False, 105.0, "D") == ("renew", 3)          # this job
    assert lease.decide(at(100.0), "a", "i2", False, 105.0, "D") == ("acquire", 4)        # a restart of it
    assert lease.decide(at(100.0), "b", "i9", False, 111.0, "D") == ("acquire", 4)        # expired
    assert lease.decide(at(100.0), "b", "i9", True, 105.0, "D") == ("acquire", 4)         # takeover
    with pytest.raises(LeaseError) as e:
        lease.decide(at(100.0), "b", "i9", False, 105.0, "D")
    said = str(e.value)
    for part in ("job 'a'", "host h", "pid 1", "generation 3", '"takeover": true', "10s", "D"):
        assert part in said, (part, said)


def test_a_lease_file_is_checked_before_use(tmp_path):
    d = str(tmp_path)
    assert lease.read(LOCAL, d) is None
    good = at(100.0)
    LOCAL.write_atomic(lease.lease_path(LOCAL, d), good.to_bytes())
    assert lease.read(LOCAL, d) == good
    for raw in (b"", b"[]", b"{\"adacheck_lease\": 2}", json.dumps(dict(json.loads(good.to_bytes()), pid="1")).encode(),
                json.dumps(dict(json.loads(good.to_bytes()), renewed=float("nan"))).encode(),
                json.dumps({k: v for k, v in json.loads(good.to_bytes()).items() if k != "generation"}).encode()):
        LOCAL.write_atomic(lease.lease_path(LOCAL, d), raw)
        with pytest.raises(FormatError):
            lease.read(LOCAL, d)


def test_the_lease_keys_are_validated():
    assert AdaCheckConfig.from_dict({"takeover": True, "lease_ttl_s": 2.5}).lease_ttl_s == 2.5
    assert AdaCheckConfig().lease_ttl_s == lease.DEFAULT_TTL_S and not AdaCheckConfig().takeover
    for block, key in (({"takeover": 1}, "takeover"), ({"lease_ttl_s": 0}, "lease_ttl_s"),
                       ({"lease_ttl_s": "60"}, "lease_ttl_s"), ({"lease_ttl_s": True}, "lease_ttl_s"),
                       ({"lease_tll_s": 60}, "lease_ttl_s")):
        with pytest.raises(ConfigError, match=key):
            AdaCheckConfig.from_dict(block)


# ---------------------------------------------------------------------- DeepSpeed
def ds_run(block, actions, seed=None):
    run = {"stage": 2, "dtype": "bf16", "adacheck": dict({"enabled": True}, **block), "actions": actions}
    if seed is not None:
        run["seed"] = seed
    return {"runs": [run]}


def test_a_second_deepspeed_job_is_refused_and_the_first_loses_nothing(tmp_path):
    """The issue's trial: two 2-rank ZeRO-2 bf16 jobs with different seeds, saving every step into
    one directory at the same time.  The second loads (allowed), then is refused at its first save
    on both ranks with the owner's name; the first goes on saving, and every checkpoint of it
    verifies."""
    ck, a_out, b_out = str(tmp_path / "ck"), str(tmp_path / "a"), str(tmp_path / "b")
    every_step = [a for _ in range(3) for a in (["train", 1], ["save", ck])]
    first = run_in_thread(lambda: launch(2, ds_run({}, every_step + [
        ["marker", "saved"], ["wait_file", os.path.join(b_out, "refused-rank1")]] + every_step + [["latest", ck]]),
        a_out, rank_env=job("job-a"), timeout=LONG))
    deadline = time.monotonic() + LONG
    while not os.path.exists(os.path.join(a_out, "saved-rank0")) and time.monotonic() < deadline:
        time.sleep(0.2)
    second = launch(2, ds_run({}, [["load", ck], ["train", 1], ["expect_error", REFUSED, "save", ck],
                                   ["marker", "refused"]], seed=7), b_out, rank_env=job("job-b"))
    check(second)
    check(first())
    for rank in (0, 1):
        errors = results(b_out, rank)[0]["errors"]
        assert len(errors) == 1 and "job 'job-a'" in errors[0] and '"takeover": true' in errors[0], errors
        assert "LeaseError" in results(b_out, rank)[0]["error_classes"][0]
    assert results(b_out)[0]["loaded"][0][0].endswith("global_step3")     # (a load by another job)
    a = results(a_out)[0]
    assert a["errors"] == [] and a["latest"] == ["global_step6"]
    text = verified(ck)
    assert all(f"global_step{s}" in text for s in range(1, 7)), text
    assert lease.read(LOCAL, ck).job == "job-a" or lease.read(LOCAL, ck) is None


def wait_expired(store, d):
    """Until the lease of ``d`` has expired (its owner was killed: nobody renews it)."""
    while True:
        held = lease.read(store, d)
        if held is None or time.time() > held.renewed + held.ttl_s:
            return held
        time.sleep(0.2)


@pytest.mark.parametrize("node, ttl", [("node-a", 3), (None, 3600)], ids=["expired", "rank0-gone"])
def test_a_killed_owners_lease_expires_and_the_next_job_takes_over_without_a_flag(tmp_path, node, ttl):
    """Job A saves twice and is SIGKILLed (nothing at exit runs: its lease stays); job B, another
    job without "takeover", then saves into the directory: 'latest' is B's, the lease B's at the
    next generation, and A's checkpoints still verify.  A on another machine with a 3 s lease: B
    saves once it has expired; A on this machine with an hour's lease: at once (its rank 0 is gone)."""
    ck = str(tmp_path / "ck")
    out = launch(2, ds_run({"lease_ttl_s": ttl}, [["train", 1], ["save", ck], ["train", 1], ["save", ck], ["die"]]),
                 str(tmp_path / "a"), rank_env=job("job-a", node), grace=30)
    assert all(rc != 0 for rc, _ in out)
    dead = wait_expired(LOCAL, ck) if node else lease.read(LOCAL, ck)
    assert dead is not None and dead.job == "job-a" and dead.generation == 0
    check(launch(2, ds_run({}, [["load", ck], ["train", 1], ["save", ck], ["latest", ck]], seed=7),
                 str(tmp_path / "b"), rank_env=job("job-b")))
    b = results(str(tmp_path / "b"))[0]
    assert b["errors"] == [] and b["latest"] == ["global_step3"]
    now = lease.read(LOCAL, ck)
    assert now is None or (now.job, now.generation) == ("job-b", 1)
    verified(ck)


def test_a_takeover_while_the_owner_runs_refuses_its_save_in_flight(tmp_path):
    """Job A saves asynchronously; its rank 0 writer is stopped inside the next save (after the
    save took its lease), and job B takes the directory over ("takeover": true) and saves the same
    tag.  A's writer goes on: its commit is refused by the fencing token, on both ranks; A's next save
    is refused too; 'latest' and the tag's manifest are B's, and everything verifies."""
    ck, a_out, b_out = str(tmp_path / "ck"), str(tmp_path / "a"), str(tmp_path / "b")
    block = {"async": True, "on_error": "raise"}
    first = run_in_thread(lambda: launch(2, ds_run(block, [
        ["train", 1], ["save", ck], ["finish"], ["stop_writer", 0], ["train", 1], ["save", ck],
        ["marker", "in_flight"], ["wait_file", os.path.join(b_out, "took-rank1")], ["cont_writer", 0],
        ["expect_error", TAKEN, "finish"], ["train", 1], ["expect_error", TAKEN, "save", ck]]),
        a_out, rank_env=job("job-a"), timeout=LONG))
    deadline = time.monotonic() + LONG
    while not os.path.exists(os.path.join(a_out, "in_flight-rank0")) and time.monotonic() < deadline:
        time.sleep(0.2)
    check(launch(2, ds_run({"takeover": True}, [["load", ck], ["train", 1], ["save", ck], ["marker", "took"],
                                                ["latest", ck]], seed=7), b_out, rank_env=job("job-b")))
    check(first())
    for rank in (0, 1):
        errors = results(a_out, rank)[0]["errors"]
        assert len(errors) == 2 and all("job 'job-b'" in e for e in errors), errors
    assert results(b_out)[0]["loaded"][0][0].endswith("global_step1")
    assert results(b_out)[0]["latest"] == ["global_step2"]
    assert commit.read_latest(ck) == "global_step2"
    assert manifest_files.read_manifest(os.path.join(ck, "global_step2")).framework["generation"] == 0   # B's files, not A's
    held = lease.read(LOCAL, ck)
    assert held is None or (held.job, held.generation) == ("job-b", 1)
    verified(ck)


# ---------------------------------------------------------------------- an S3 server
@pytest.fixture(scope="module")
def s3():
    from s3server import s3_server
    with s3_server() as server:
        yield server


def test_on_s3_a_second_deepspeed_job_is_refused_and_the_owners_checkpoints_verify(s3, tmp_path):
    """On an S3 server: job A (on another machine, a lease of an hour) saves twice and is
    SIGKILLed; job B loads its checkpoint (allowed) and is refused at its first save on both ranks; nothing of A's is
    touched (its objects are the same) and 'adacheck ls --verify' passes."""
    url = s3.url("refused")
    opts = {"storage_options": s3.options}
    out = launch(2, ds_run(dict(opts, lease_ttl_s=3600), [["train", 1], ["save", url], ["train", 1], ["save", url],
                                                           ["die"]]),
                 str(tmp_path / "a"), rank_env=job("job-a", "node-a"), grace=30)
    assert all(rc != 0 for rc, _ in out)
    from adacheck.checkpoint import Checkpointer, Options
    store, where = Checkpointer(options=Options(storage_options=s3.options)).locate(url)
    held = lease.read(store, where)       # (the killed job's lease, through the storage layer: live for an hour)
    assert (held.job, held.ttl_s, held.generation) == ("job-a", 3600.0, 0), held
    before = {k: s3.fs.info(f"{s3.bucket}/{k}")["ETag"] for k in s3.keys("refused")}
    check(launch(2, ds_run(opts, [["load", url], ["train", 1], ["expect_error", REFUSED, "save", url]], seed=7),
                 str(tmp_path / "b"), rank_env=job("job-b")))
    for rank in (0, 1):
        errors = results(str(tmp_path / "b"), rank)[0]["errors"]
        assert len(errors) == 1 and "job 'job-a'" in errors[0], errors
    assert {k: s3.fs.info(f"{s3.bucket}/{k}")["ETag"] for k in s3.keys("refused")} == before
    text = verified(url, "--storage-options", json.dumps(s3.options))
    assert "global_step1" in text and "global_step2" in text


def test_on_s3_a_takeover_fences_the_old_owner(s3, monkeypatch):
    """In one process, two jobs on S3 by name: 'old' saves; 'new' is refused, then takes over; the old
    owner's next save and its save already past its lease check (its commit) are refused, 'latest'
    is the new owner's, and every checkpoint loads."""
    from adacheck.checkpoint import Checkpointer, Options
    from adacheck.plan.exchange import SoloComm
    from test_core_storage import state
    import torch
    url, frozen = s3.url("takeover"), torch.arange(9.0).view(3, 3)

    def ckp(**kw):
        return Checkpointer(options=Options(storage_options=s3.options, chunk_bytes=32, **kw))

    def save(c, step):
        st = state(step, frozen)[1]
        return c.save(SoloComm(), url, f"s{step}", lambda: st)

    monkeypatch.setenv("ADACHECK_JOB", "old")
    old = ckp()
    save(old, 1)
    monkeypatch.setenv("ADACHECK_JOB", "new")
    with pytest.raises(LeaseError, match="job 'old'"):
        save(ckp(), 2)
    store = old.locate(url)[0]
    held = lease.read(store, old.locate(url)[1])
    assert (held.job, held.generation) == ("old", 0)
    # the old owner's save of s2 passes its lease check, then the new owner takes over before its commit
    new = ckp(takeover=True)
    snap_save = old.snapshot

    def taken_over_meanwhile(*args, **kw):
        got = snap_save(*args, **kw)
        save(new, 3)
        return got
    old.snapshot = taken_over_meanwhile
    with pytest.raises(LeaseError, match=TAKEN):
        save(old, 2)
    old.snapshot = snap_save
    with pytest.raises(LeaseError, match=TAKEN):
        save(old, 4)
    save(new, 5)
    where = old.locate(url)[1]
    assert commit.read_latest(where, store) == "s5"
    assert lease.read(store, where).generation == 1
    assert sorted(t for t, m, _ in commit.list_checkpoints(where, store) if m is not None) == ["s1", "s3", "s5"]
    verified(url, "--storage-options", json.dumps(s3.options))


# ---------------------------------------------------------------------- megatron-core
def test_a_second_megatron_job_is_refused_and_the_owners_checkpoints_verify(tmp_path):
    """megatron-core (TP=2, scripts/pretrain_gpt.py's functions): job A (on another machine,
    --adacheck-lease-ttl-s 3600) saves and is SIGKILLed; job B loads its checkpoint, then is refused
    at its first save on both ranks, naming A; with --adacheck-takeover a third job saves there, and
    everything verifies."""
    ck = str(tmp_path / "ck")
    argv = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--adacheck"]
    out = launch(2, {"runs": [{"argv": argv + ["--adacheck-lease-ttl-s", "3600"],
                               "actions": [["train", 2], ["save", ck], ["die"]]}]},
                 str(tmp_path / "a"), script="megatron_worker.py", rank_env=job("job-a", "node-a"), grace=30)
    assert all(rc != 0 for rc, _ in out)
    check(launch(2, {"runs": [{"argv": argv, "actions": [["load", ck], ["train", 1],
                                                         ["expect_error", REFUSED, ["save", ck]]]}]},
                 str(tmp_path / "b"), script="megatron_worker.py", rank_env=job("job-b")))
    for rank in (0, 1):
        errors = results(str(tmp_path / "b"), rank)[0]["errors"]
        assert len(errors) == 1 and "job 'job-a'" in errors[0] and "--adacheck-takeover" in errors[0], errors
    assert results(str(tmp_path / "b"))[0]["loaded"] == [2]
    check(launch(2, {"runs": [{"argv": argv + ["--adacheck-takeover"],
                               "actions": [["load", ck], ["train", 1], ["save", ck], ["latest", ck]]}]},
                 str(tmp_path / "c"), script="megatron_worker.py", rank_env=job("job-c")))
    assert results(str(tmp_path / "c"))[0]["latest"] == ["iter_0000003"]
    text = verified(ck)
    assert "iter_0000002" in text and "iter_0000003" in text


# ---------------------------------------------------------------------- garbage collection beside a live job
def test_prune_beside_a_live_job_keeps_its_save_in_flight(tmp_path, monkeypatch):
    """'adacheck prune' while a job owns the directory: a leftover older than the newest commit and
    the retired checkpoint's files go, the files of a save in flight (written after the newest
    commit) stay; once the job has ended (its lease removed), they are leftovers and go too."""
    import torch
    from adacheck.checkpoint import Checkpointer
    from adacheck.plan.exchange import SoloComm
    from test_core_storage import state
    monkeypatch.setenv("ADACHECK_JOB", "owner")
    d, frozen = str(tmp_path / "ck"), torch.arange(9.0).view(3, 3)
    owner = Checkpointer()
    for step in (1, 2):
        st = state(step, frozen)[1]
        owner.save(SoloComm(), d, f"s{step}", lambda: st)
    old = os.path.join(d, "s1", "rank00000-g7.safetensors")     # a killed save's, before s2 committed
    open(old, "wb").write(b"x" * 10)
    past = os.path.getmtime(os.path.join(d, "s2", "manifest.json")) - 60
    os.utime(old, (past, past))
    os.makedirs(os.path.join(d, "s3"))
    flight = os.path.join(d, "s3", "rank00000-g0.safetensors")   # the owner's next save, being written
    open(flight, "wb").write(b"y" * 10)
    code, text = cli("prune", d, "--keep-last", "1", "--yes")
    assert code == 0 and "job 'owner'" in text, text
    assert not os.path.exists(old) and os.path.exists(flight)
    assert sorted(t for t, m, _ in commit.list_checkpoints(d) if m is not None) == ["s2"]
    owner.leases.close()       # (what the job's exit does)
    assert lease.read(LOCAL, d) is None
    code, text = cli("prune", d, "--keep-last", "1", "--yes")
    assert code == 0 and not os.path.exists(flight), text
    verified(d)


# ---------------------------------------------------------------------- the memory tier
def test_the_memory_tiers_copies_hold_and_are_fenced_by_the_directorys_lease(tmp_path, monkeypatch):
    """With the memory tier, the lease is the checkpoint directory's: another job is refused before
    its memory save, and the owner's copy of a memory checkpoint to the directory is refused at its
    commit when a job took the directory over while it was copied ('latest' stays that job's)."""
    import torch
    from adacheck.checkpoint import Options
    from adacheck.config import TiersConfig
    from adacheck.plan.exchange import SoloComm
    from test_core_storage import state
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", str(tmp_path / "shm"))
    d, frozen, comm = str(tmp_path / "ck"), torch.arange(9.0).view(3, 3), SoloComm()

    def tiered(**kw):
        return TieredCheckpointer(options=Options(fsync=False, on_error="raise", tiers=TiersConfig(memory=True), **kw))

    def save(c, step):
        st = state(step, frozen)[1]
        c.save(comm, d, f"s{step}", lambda: st)
        c.finish()

    monkeypatch.setenv("ADACHECK_JOB", "old")
    old = tiered()
    save(old, 1)
    assert commit.read_latest(d) == "s1"
    monkeypatch.setenv("ADACHECK_JOB", "new")
    with pytest.raises(LeaseError, match="job 'old'"):
        save(tiered(), 2)
    new = tiered(takeover=True)
    confirm = old.tier.confirm

    def taken_over_meanwhile(*args):        # (the old owner's copy: its files are in the directory)
        save(new, 3)
        return confirm(*args)
    old.tier.confirm = taken_over_meanwhile
    with pytest.raises(LeaseError, match=TAKEN):
        save(old, 2)
    assert commit.read_latest(d) == "s3" and not manifest_files.has_manifest(os.path.join(d, "s2"))
    with pytest.raises(LeaseError, match=TAKEN):
        save(old, 4)
    assert lease.read(LOCAL, d).generation == 1
    verified(d)
