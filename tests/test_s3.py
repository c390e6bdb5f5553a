"""Checkpoints on a real S3 API server (moto's, on 127.0.0.1) through s3fs: the same bytes as a
local save, published in order (shards, manifest, latest), stale multipart uploads aborted, a
server lost in the middle of a save leaves the previous checkpoint as 'latest' and loadable, and
real DeepSpeed engines save to it and load from it in another layout."""
import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from adacheck.storage import commit
from adacheck.storage import manifest_files
from adacheck.checkpoint import CheckpointReader, Checkpointer, Options, SavePipeline
from adacheck.cli import main
from adacheck.errors import AdaCheckError, IntegrityError
from adacheck.plan.exchange import SoloComm
from adacheck.integration import Restore
from adacheck.storage.backends import LOCAL
from launch import check, launch
from s3server import s3_server
from test_core_storage import files_of, state

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def job(s3, **kw):
    return Checkpointer(options=Options(storage_options=s3.options, chunk_bytes=32, **kw))


def save_steps(checkpointer, root, steps, frozen):
    out = {}
    for step in steps:
        w, st = state(step, frozen)
        checkpointer.save(SoloComm(), root, f"s{step}", lambda st=st: st)
        out[step] = w
    return out


def test_an_s3_checkpoint_is_the_local_bytes_published_in_order(s3, tmp_path):
    frozen = torch.arange(9.0).view(3, 3)
    root = s3.url("order")
    # a save killed earlier left multipart uploads of a shard and a delta file here; the others are
    # not AdaCheck's, or another job's (under another prefix, or its own save directory below this one)
    others = ["elsewhere/big.bin", "order/run2/s0/rank00000-g0.safetensors", "order/tools/upload.bin"]
    for key in ("order/s0/rank00000-g0.safetensors", "order/s0/deltas/0000000002/rank0.safetensors", *others):
        s3.fs.call_s3("create_multipart_upload", Bucket=s3.bucket, Key=key)
    s3.relay.requests.clear()
    checkpointer = job(s3, keep_last=2)
    save_steps(checkpointer, root, (1,), frozen)
    first = list(s3.relay.requests)
    weights = save_steps(checkpointer, root, (2, 3), frozen)
    assert sorted(u["Key"] for u in s3.fs.list_multipart_uploads(s3.bucket)) == others
    # the first save: the directory's lease (before anything else), its shard object, then its manifest,
    # then 'latest' (and the directory's README, once)
    puts = [r.split(b" ")[1].split(b"?")[0].decode() for r in first if r.startswith((b"PUT", b"POST"))]
    puts = [p for p in puts if p.startswith("/ckpt/order/")]
    assert puts == ["/ckpt/order/.adacheck-lease.json", "/ckpt/order/s1/rank00000-g0.safetensors",
                    "/ckpt/order/s1/manifest.json", "/ckpt/order/latest", "/ckpt/order/README"], puts
    local = str(tmp_path / "local")
    local_job = Checkpointer(options=Options(chunk_bytes=32, keep_last=2))
    save_steps(local_job, local, (1, 2, 3), frozen)
    store, where = job(s3).locate(root)
    assert files_of(store, where) == files_of(LOCAL, local)   # byte for byte a local save's files
    assert commit.read_latest(where, store) == "s3"
    r = CheckpointReader(store.join(where, "s3"), store=store)
    assert torch.equal(r.read("master/w"), weights[3]) and torch.equal(r.read("model/frozen"), frozen)
    check_cli_on(s3, root, local, tmp_path)


def test_a_save_asks_the_same_requests_however_many_checkpoints_the_directory_keeps(s3):
    """Retention and garbage collection see an object store's save directory through one listing,
    and a manifest seen before by its ETag: each save made a LIST, a HEAD and a GET more per
    checkpoint kept (the publish of the 12th took 0.46 s on this server, of the 1st 0.11 s).
    Oracle: the requests the server received (the relay's log)."""
    frozen = torch.arange(9.0).view(3, 3)
    root, checkpointer, counts = s3.url("many"), job(s3), []      # (keep_last 0: every checkpoint kept)
    for step in range(1, 13):
        _, st = state(step, frozen)
        before = len(s3.relay.requests)
        checkpointer.save(SoloComm(), root, f"s{step}", lambda st=st: st)
        counts.append(len(s3.relay.requests) - before)
    assert len(set(counts[2:])) == 1, counts
    # garbage collection from the listing still removes what nothing reads: a tag saved again
    # leaves its earlier generation's file to a later save (one modified in the second of the
    # newest manifest or after it may be a save in flight: kept), and no file of the others goes
    w, st = state(99, frozen)
    checkpointer.save(SoloComm(), root, "s12", lambda: st)
    time.sleep(1.1)
    checkpointer.save(SoloComm(), root, "s13", lambda: st)     # (the same state: it reads s12's file)
    assert [k for k in s3.keys("many/s12") if k.endswith(".safetensors")] == ["many/s12/rank00000-g1.safetensors"]
    assert len([k for k in s3.keys("many") if k.endswith(".safetensors")]) == 12
    store, where = checkpointer.locate(root)
    assert torch.equal(CheckpointReader(store.join(where, "s12"), store=store).read("master/w"), w)
    assert torch.equal(CheckpointReader(store.join(where, "s1"), store=store).read("model/frozen"), frozen)


def check_cli_on(s3, root, local, tmp_path):
    """Every adacheck subcommand takes the URL with --storage-options and answers as it does for
    the byte-identical local copy."""
    import contextlib
    import io
    opts = ["--storage-options", json.dumps(s3.options)]

    def run(*argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(list(argv))
        return code, out.getvalue()

    code, text = run("ls", root, *opts)
    assert code == 0 and "s3 (latest)" in text and text.count("unverified") == 2, text
    assert run("ls", local)[1].replace(local, "X") == text.replace(root, "X")
    code, text = run("inspect", root, "--json", *opts)
    got = json.loads(text)
    assert code == 0 and got["dir"] == f"{root}/s3" and got["tag"] == "s3"
    assert {k: v for k, v in json.loads(run("inspect", local, "--json")[1]).items() if k != "dir"} == \
        {k: v for k, v in got.items() if k != "dir"}
    code, text = run("inspect", root, "--redundancy", *opts)
    assert code == 0 and text.replace(root, "X") == run("inspect", local, "--redundancy")[1].replace(local, "X"), text
    code, text = run("verify", root, "--quiet", *opts)
    assert code == 0 and "OK" in text, text
    code, text = run("diff", f"{root}/s2", f"{root}/s3", "--json", *opts)
    assert code == 1 and json.loads(text)["changed"], text
    for src, out in ((root, tmp_path / "w_s3"), (local, tmp_path / "w_local")):
        code, text = run("convert", src, str(out), *(opts if src == root else []))
        assert code == 0, text
    assert (tmp_path / "w_s3" / "model.safetensors").read_bytes() == \
        (tmp_path / "w_local" / "model.safetensors").read_bytes()
    from adacheck.cli.local_ranks import free_port
    nowhere = json.dumps(dict(s3.options, endpoint_url=f"http://127.0.0.1:{free_port()}"))
    code, text = run("verify", root, "--storage-options", nowhere)    # no server there
    assert code == 2 and "StorageError" not in text and "127.0.0.1" in text and "Traceback" not in text, text
    code, text = run("ls", local, *opts)
    assert code == 2 and "not to the local path" in text, text
    # damage one stored object: verify names it
    shard = f"{s3.bucket}/order/s3/rank00000-g0.safetensors"
    data = bytearray(s3.fs.cat_file(shard))
    data[-3] ^= 1
    s3.fs.pipe_file(shard, bytes(data))
    code, text = run("verify", root, "--quiet", *opts)
    assert code == 1 and "s3/rank00000-g0.safetensors" in text, text
    code, text = run("prune", root, "--keep-last", "1", "--yes", *opts)
    assert code == 0 and "retiring 1" in text, text
    assert not [k for k in s3.keys("order/s2") if k.endswith("manifest.json")]


def test_server_lost_during_a_save_keeps_the_previous_checkpoint(s3):
    frozen = torch.zeros(3, 3)
    root, checkpointer = s3.url("lost"), job(s3)
    weights = save_steps(checkpointer, root, (1,), frozen)
    s3.relay.cut_on(b"PUT /ckpt/lost/s2/manifest.json")
    try:
        with pytest.raises(AdaCheckError) as err:
            save_steps(checkpointer, root, (2,), frozen)
    finally:
        s3.relay.reopen()
    text = str(err.value)
    assert "lost/s2" in text and "commit" in text and "127.0.0.1" in text, text
    store, where = checkpointer.locate(root)
    assert commit.read_latest(where, store) == "s1"
    assert not manifest_files.has_manifest(store.join(where, "s2"), store)
    got = checkpointer.load(SoloComm(), root, None, Restore.of(lambda r: r.read("master/w")))
    assert got.manifest.tag == "s1" and torch.equal(got.result, weights[1])
    # the next save goes on, and removes what the interrupted one left
    save_steps(checkpointer, root, (3,), frozen)
    assert not [k for k in s3.keys("lost/s2")], s3.keys("lost")
    assert commit.read_latest(where, store) == "s3"


class WrittenAgain(Checkpointer):
    """A job whose shard object someone else writes again, same size, other bytes, between its upload
    and the commit (a save of the same tag still running elsewhere)."""

    def __init__(self, s3, **kw):
        super().__init__(options=Options(storage_options=s3.options, chunk_bytes=32, **kw))

        class Pipeline(SavePipeline):
            def commit(self, comm, prepared, exchanged, plan, written):
                path = prepared.store.join(prepared.ckpt_dir, written.my_file)
                data = bytearray(s3.fs.cat_file(path))
                data[-1] ^= 1
                s3.fs.pipe_file(path, bytes(data))
                return super().commit(comm, prepared, exchanged, plan, written)
        self.pipeline_class = Pipeline


@pytest.mark.parametrize("exchange", ["ring", "partitioned"])
def test_an_object_written_again_before_the_commit_is_not_published(s3, exchange):
    frozen = torch.ones(3, 3)
    root = s3.url(f"again-{exchange}")
    weights = save_steps(job(s3, exchange=exchange), root, (1,), frozen)
    with pytest.raises(IntegrityError) as err:
        save_steps(WrittenAgain(s3, exchange=exchange), root, (2,), frozen)
    text = str(err.value)
    assert "s2/rank00000-g0.safetensors" in text and "is not the object rank 0 wrote" in text, text
    checkpointer = job(s3, exchange=exchange)
    store, where = checkpointer.locate(root)
    assert commit.read_latest(where, store) == "s1"
    assert not manifest_files.has_manifest(store.join(where, "s2"), store)
    got = checkpointer.load(SoloComm(), root, None, Restore.of(lambda r: r.read("master/w")))
    assert got.manifest.tag == "s1" and torch.equal(got.result, weights[1])
    save_steps(checkpointer, root, (2,), frozen)      # the next save of that tag goes through
    assert commit.read_latest(where, store) == "s2"


def test_a_memory_checkpoint_copied_to_s3_is_confirmed_by_its_objects_tags(s3, tmp_path):
    from adacheck.checkpoint import confirm_files
    from adacheck.tiers import persist_checkpoint
    local = str(tmp_path / "memory")
    save_steps(Checkpointer(options=Options(chunk_bytes=32)), local, (1,), torch.zeros(3, 3))
    store, where = job(s3).locate(s3.url("copied"))

    def written_again_then_confirmed(dst_store, dst, files):
        path = dst_store.join(dst, "rank00000-g0.safetensors")
        data = bytearray(s3.fs.cat_file(path))
        data[-1] ^= 1
        s3.fs.pipe_file(path, bytes(data))
        confirm_files(dst_store, dst, files)

    with pytest.raises(IntegrityError, match="is not the object rank 0 wrote"):
        persist_checkpoint(0, os.path.join(local, "s1"), store, where, "s1", True, True, None,
                           written_again_then_confirmed)
    assert not manifest_files.has_manifest(store.join(where, "s1"), store) and commit.read_latest(where, store) is None
    assert persist_checkpoint(0, os.path.join(local, "s1"), store, where, "s1", True, True, None, confirm_files)
    assert commit.read_latest(where, store) == "s1"


def test_a_pointer_to_a_checkpoint_on_s3_is_written_and_followed_there(s3):
    """A save called with another directory than the job's (a Hugging Face Trainer's checkpoint-N)
    leaves a pointer there, also on S3; a load finds it and hears of newer state in the job's
    directory."""
    from adacheck.storage import pointer
    store, given = job(s3).locate(s3.url("trainer/checkpoint-3"))
    _, save_dir = job(s3).locate(s3.url("run"))
    save_steps(job(s3), s3.url("run"), (3, 4), torch.zeros(3, 3))
    pointer.write(store, given, "s3", store.canonical(save_dir), 3)
    assert json.loads(s3.fs.cat_file(f"{s3.bucket}/trainer/checkpoint-3/s3/adacheck.json")) == \
        {"adacheck_save_dir": s3.url("run"), "tag": "s3", "step": 3}
    found = pointer.find(store, given)
    assert found == pointer.Pointer(s3.url("run"), "s3", 3) and pointer.find(store, given, "s4") is None
    assert pointer.newer_state(store, save_dir, found) == "its latest is s4"
    s3.fs.pipe_file(f"{s3.bucket}/trainer/checkpoint-3/s3/adacheck.json", b"{}")
    with pytest.raises(AdaCheckError, match="not an AdaCheck pointer"):
        pointer.find(store, given)


def results(d, rank=0):
    with open(os.path.join(d, f"result-rank{rank}.json")) as f:
        return json.load(f)


def test_deepspeed_saves_to_s3_and_loads_into_another_layout(s3, tmp_path):
    """DP=2 ZeRO-2 bf16 saves to s3://, the server goes away during the next save (a clear
    error; training goes on), then DP=1 ZeRO-3 loads the checkpoint that stayed 'latest': every
    master weight, optimizer moment and buffer equal to the saving engine's."""
    block = {"enabled": True, "storage_options": s3.options}
    url = s3.url("ds")
    src = str(tmp_path / "src")
    s3.relay.cut_on(b"PUT /ckpt/ds/global_step5/manifest.json")
    try:
        check(launch(2, {"runs": [{"stage": 2, "dtype": "bf16", "adacheck": block,
                                   "actions": [["train", 3], ["save", url], ["dump", "S"], ["train", 2],
                                               ["expect_error", "global_step5", "save", url],
                                               ["train", 1]]}]}, src))
    finally:
        s3.relay.reopen()
    res = results(src)
    assert len(res[0]["losses"]) == 6 and all(x == x for x in res[0]["losses"])   # training went on
    assert "commit" in res[0]["errors"][0], res[0]["errors"]
    dst = str(tmp_path / "dst")
    check(launch(1, {"runs": [{"stage": 3, "dtype": "bf16", "seed": 9, "adacheck": block,
                               "actions": [["load", url], ["dump", "L"], ["train", 1], ["save", url]]}]}, dst))
    saved, loaded = load_file(os.path.join(src, "S.safetensors")), load_file(os.path.join(dst, "L.safetensors"))
    keys = [k for k in saved if k.startswith(("master/", "optim/", "buffer/"))]
    assert keys
    for k in keys:
        assert torch.equal(saved[k], loaded[k]), k
    assert loaded["meta/optim_step"].tolist() == saved["meta/optim_step"].tolist()
    assert results(dst)[0]["loaded"][0][1] == {"epoch": 3, "note": "hi", "vec": [0.0, 1.0, 2.0, 3.0]}
    assert s3.keys("ds/global_step5") == []        # the interrupted save's objects: collected
    assert "ds/global_step4/manifest.json" in s3.keys("ds")


def test_megatron_tp2_saves_to_s3_and_resumes_exactly(s3, tmp_path):
    """TP=2 megatron-core through scripts/pretrain_gpt.py with --adacheck-storage-options: train 3,
    save to s3://, train 2 == other weights, load from s3://, train 2 (losses, and every rank's
    weights, main weights and optimizer state read from megatron-core's objects)."""
    from test_megatron import assert_same_dumps
    url = s3.url("megatron")
    argv = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--adacheck",
            "--adacheck-storage-options", json.dumps(s3.options)]
    runs = [{"argv": argv, "actions": [["train", 3], ["save", url], ["train", 2], ["dump", "a"]]},
            {"argv": argv, "actions": [["scramble"], ["load", url], ["train", 2], ["dump", "b"]]}]
    check(launch(2, {"runs": runs}, str(tmp_path), script="megatron_worker.py"))
    res = results(str(tmp_path))
    assert res[1]["loaded"] == [3] and res[0]["losses"][3:] == res[1]["losses"]
    assert_same_dumps(str(tmp_path), "a", "b", 2)
    assert "megatron/iter_0000003/manifest.json" in s3.keys("megatron")
    assert s3.fs.cat_file(f"{s3.bucket}/megatron/latest").decode().strip() == "iter_0000003"


def test_sigkill_during_a_background_write_to_s3(s3, tmp_path):
    """Rank 1 is SIGKILLed the moment its shard upload of an asynchronous save reaches the server
    (the training loop has gone on; the background is writing): nothing of that save is published,
    and a new job loads the newest committed checkpoint exactly (DeepSpeed's own accessors)."""
    import signal
    import threading
    import time
    from test_ds_integration import assert_same
    url = s3.url("kill")
    big = {"stage": 1, "dtype": "fp32", "hidden": 700, "layers": 6,
           "adacheck": {"enabled": True, "async": True, "reference_previous": False, "storage_options": s3.options}}
    runs = [dict(big, actions=[["train", 1], ["save", url, "good"], ["finish"], ["dump", "good"]]
                 + [a for i in range(30) for a in (["train", 1], ["save", url, f"doomed{i}"])])]
    marker = b"PUT /ckpt/kill/doomed"
    seen = {}

    def killer(procs):
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            hit = [r for r in list(s3.relay.requests) if r.startswith(marker) and b"/rank00001-" in r]
            if hit:
                procs[1].send_signal(signal.SIGKILL)
                seen["request"] = hit[0].decode()
                return
            time.sleep(0.001)

    res = launch(2, {"runs": runs}, str(tmp_path / "a"), grace=20,
                 on_started=lambda procs: threading.Thread(target=killer, args=(procs,), daemon=True).start())
    assert res[1][0] == -signal.SIGKILL, res[1][1][-3000:]
    doomed = seen["request"].split("/")[3]
    keys = s3.keys("kill")
    assert f"kill/{doomed}/manifest.json" not in keys
    latest = s3.fs.cat_file(f"{s3.bucket}/kill/latest").decode().strip()
    assert latest == "good", latest      # (rank 1 uploads in every save: the first doomed one was hit)
    load_dir = str(tmp_path / "reload")
    check(launch(2, {"runs": [dict(big, seed=3, actions=[["load", url], ["dump", "reloaded"]])]}, load_dir))
    good = load_file(str(tmp_path / "a" / "good.safetensors"))
    assert_same(good, load_file(os.path.join(load_dir, "reloaded.safetensors")))
    # from an object store each rank downloads its own half of the masters and moments, and
    # DeepSpeed all-gathers the module weights (on local files gloo's ranks read every master)
    unique = sum(v.numel() * v.element_size() for k, v in good.items() if k.startswith(("master/", "optim/")))
    read = [results(load_dir, r)[0]["manifest_read"][0]["data"] for r in (0, 1)]
    assert max(read) < 0.6 * unique, (read, unique)


@pytest.mark.parametrize("exchange", ["ring", "partitioned"])
def test_a_writer_process_uploads_the_state_at_the_call(s3, tmp_path, exchange):
    """``async_writer: "process"`` (a world of one: no process group): the writer process reads
    the snapshot from shared memory and uploads it while the state changes; the objects are byte
    for byte those of a synchronous local save of the state at the call.  (partitioned: the
    manifest in parts the writer process sends back reads its parts through the S3 storage, which
    could not be pickled: the writer process died.)"""
    frozen = torch.arange(9.0).view(3, 3)
    _, st = state(5, frozen)
    Checkpointer(options=Options(chunk_bytes=32, exchange=exchange)).save(SoloComm(), str(tmp_path / "local"), "s5",
                                                                         lambda: st)
    remote = job(s3, writer="process", exchange=exchange)
    try:
        remote.save_async(SoloComm(), s3.url(f"proc-{exchange}"), "s5", lambda: st)
        for s in st.shards:     # training goes on at once
            s.tensor.add_(1)
        manifest = remote.finish()
        assert manifest is not None and manifest.tag == "s5"
        local = manifest_files.read_manifest(str(tmp_path / "local" / "s5"))      # (its tables, read through its storage)
        assert dict(manifest.tensors) == dict(local.tensors) and manifest.tensors
        assert remote.writer is not None and remote.writer.alive
    finally:
        remote.close()
    assert remote.writer is None
    store, where = remote.locate(s3.url(f"proc-{exchange}"))
    assert files_of(store, where) == files_of(LOCAL, str(tmp_path / "local"))


@pytest.mark.parametrize("exchange", ["ring", "partitioned"])
def test_memory_tier_persists_to_s3_and_recovers_across_tiers(s3, tmp_path, monkeypatch, exchange):
    """The memory tier in front of s3://: every 2nd save is copied to the server behind training
    (each rank its files, rank 0 the manifest, then latest); the job is killed after step 3.
    A new job recovers step 3 from memory; with the memory gone, step 2 from the server; both
    equal to DeepSpeed's state at those saves.  (partitioned: each rank's part and rank file go
    with its shard file, each confirmed by its content tag.)"""
    monkeypatch.setenv("ADACHECK_JOB", f"s3-tiers-{exchange}")
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", str(tmp_path / "shm"))
    block = {"enabled": True, "storage_options": s3.options, "exchange": exchange,
             "tiers": {"memory": True, "persist_interval": 2}}
    prefix = f"tiers-{exchange}"
    url = s3.url(prefix)
    src = str(tmp_path / "src")
    out = launch(2, {"runs": [{"stage": 1, "dtype": "bf16", "adacheck": block, "actions": [
        ["train", 1], ["save", url], ["train", 1], ["dump", "S2"], ["save", url], ["train", 1], ["dump", "S3"],
        ["save", url], ["finish"], ["die"]]}]}, src)
    assert [rc for rc, _ in out] == [-9, -9], out[0][1][-3000:]
    assert f"{prefix}/global_step2/manifest.json" in s3.keys(prefix) and s3.keys(f"{prefix}/global_step3") == []
    assert not any(".persisted-rank" in k for k in s3.keys(prefix))
    parts = {f"{prefix}/global_step2/manifest-g0-{n}.json" for n in ("part-00001", "rank-00001", "meta")}
    assert (parts <= set(s3.keys(prefix))) == (exchange == "partitioned"), s3.keys(prefix)
    dst = str(tmp_path / "dst")
    check(launch(2, {"runs": [{"stage": 1, "dtype": "bf16", "seed": 9, "adacheck": block,
                               "actions": [["load", url], ["dump", "L3"]]}]}, dst))
    shutil.rmtree(tmp_path / "shm")
    lost = str(tmp_path / "lost")
    out = launch(2, {"runs": [{"stage": 1, "dtype": "bf16", "seed": 9, "adacheck": block,
                               "actions": [["load", url], ["dump", "L2"]]}]}, lost)
    check(out)
    assert "memory tier holds no checkpoint" in out[0][1]
    for saved, d, loaded in (("S3", dst, "L3"), ("S2", lost, "L2")):
        a, b = load_file(os.path.join(src, f"{saved}.safetensors")), load_file(os.path.join(d, f"{loaded}.safetensors"))
        keys = [k for k in a if k.startswith(("model/", "master/", "optim/"))]
        assert keys
        for k in keys:
            assert torch.equal(a[k], b[k]), (saved, k)


def test_a_region_of_a_tensor_on_s3_is_read_from_the_pages_of_its_part(s3):
    """Format 6 on S3: a read of a region (a load in another layout) takes the part's header and
    the pages that meet the region by ranged GETs, not the whole part object; the values are the
    tensor given to the save."""
    from adacheck.integration import LocalShard, LocalState
    from adacheck.types import Box
    rows = 256
    w = torch.randn(rows, 8, generator=torch.Generator().manual_seed(3))
    shards = [LocalShard("master/w", "master", (rows, 8), Box((r, 0), (1, 8)), w[r:r + 1]) for r in range(rows)]
    root = s3.url("paged")
    job(s3, exchange="partitioned").save(SoloComm(), root, "s1", lambda: LocalState(shards, step=1))
    store, where = job(s3).locate(root)
    part = store.join(where, "s1", "manifest-g0-part-00000.json")
    r = CheckpointReader(store.join(where, "s1"), store=store)
    s3.relay.requests.clear()
    before = s3.relay.received
    entry = r.manifest.tensors.region("master/w", Box((100, 0), (2, 8)))
    # what came over the wire for it (HTTP headers included) is a small part of the part object
    assert s3.relay.received - before < s3.fs.size(part) / 3, (s3.relay.received - before, s3.fs.size(part))
    assert sum(b"manifest-g0-part-00000.json" in q for q in s3.relay.requests) >= 2    # (header, pages)
    assert {sb.box.offsets[0] for sb in entry.boxes} >= {100, 101}
    assert torch.equal(r.read("master/w", Box((100, 0), (2, 8))), w[100:102])
    assert torch.equal(r.read_flat("master/w", 8 * 200, 8 * 203), w[200:203].reshape(-1))


def test_a_tag_deleted_and_saved_again_elsewhere_loads_its_new_bytes(s3):
    """A job that has read a checkpoint keeps blocks of its files; when another process deletes
    that checkpoint and saves the same tag again (same object names), the job's next load reads
    the new objects: the weights the second save was given, not a refusal over stale blocks."""
    frozen = torch.zeros(3, 3)
    root = s3.url("same-tag")
    reading = job(s3)
    first = save_steps(reading, root, (1,), frozen)
    read = lambda r: r.read("master/w")   # noqa: E731
    got = reading.load(SoloComm(), root, "s1", Restore.of(read))
    assert torch.equal(got.result, first[1])
    other = job(s3)        # another process: its own storage object
    store, where = other.locate(root)
    store.remove_tree(store.join(where, "s1"))
    w, st = state(7, frozen)
    other.save(SoloComm(), root, "s1", lambda: st)
    got = reading.load(SoloComm(), root, "s1", Restore.of(read))
    assert not torch.equal(w, first[1]) and torch.equal(got.result, w)


def test_a_tag_saved_again_asynchronously_that_fails_after_its_commit_is_said_committed(s3):
    """An asynchronous save of a tag already on S3 commits its manifest, then 'latest' cannot be
    written (the server goes away): it is said committed, its manifest returned, when the new
    manifest has the same modification second as the one it replaced (S3's times are whole
    seconds; the two were told apart by time alone, and the commit said "training goes on from
    the previous checkpoint").  Tried until the two manifests share a second."""
    import warnings
    from adacheck.errors import SaveWarning
    frozen = torch.zeros(3, 3)
    root = s3.url("again-async")
    checkpointer = job(s3, writer="thread")       # (a writer process that failed is started anew: seconds)
    store, where = checkpointer.locate(root)
    manifest = store.join(where, "s1", commit.MANIFEST_NAME)
    same_second = False
    for attempt in range(12):
        save_steps(checkpointer, root, (1,), frozen)
        before = s3.fs.modified(manifest)
        w, st = state(2, frozen)
        s3.relay.cut_on(b"PUT /ckpt/again-async/latest")
        try:
            pending = checkpointer.save_async(SoloComm(), root, "s1", lambda: st)
            pending.thread.join(timeout=120)
        finally:
            s3.relay.reopen()
        s3.fs.invalidate_cache()
        same_second = s3.fs.modified(manifest) == before
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = checkpointer.finish()
        text = "\n".join(str(x.message) for x in said if issubclass(x.category, SaveWarning))
        assert "was committed" in text and "'latest' names it" in text, (attempt, same_second, text)
        assert got is not None and got.step == 2
        assert torch.equal(CheckpointReader(store.join(where, "s1"), store=store).read("master/w"), w)
        if same_second:
            break
    checkpointer.leases.close()     # (what the job's exit does; here while the server still runs)
    assert same_second
