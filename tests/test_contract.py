"""The integration contract (adacheck/integration.py) as an adapter meets it: a shard's kind, and
a load's Restore (staged on every rank before any rank applies; undone on every rank when one
fails; the adapter's own call named when a checkpoint is damaged).

Oracles: manifest.json read with the json module, and what the adapter's own functions saw."""
import json
import os

import pytest
import torch

from thread_comm import run_ranks

from adacheck.checkpoint import Checkpointer, Options
from adacheck.errors import AdaCheckError, IntegrityError, StateError
from adacheck.integration import Kind, LocalShard, LocalState, Restore
from adacheck.plan.exchange import SoloComm
from adacheck.types import Box

pytestmark = pytest.mark.unit


def state(rank: int, value: float) -> LocalState:
    return LocalState(shards=[LocalShard("master/w", Kind.MASTER, (4,), Box.full((4,)), torch.full((4,), value)),
                              LocalShard("model/w", "model", (4,), Box.full((4,)), torch.full((4,), value))],
                      framework={"name": "toy"}, step=int(value))


def test_a_kind_is_a_kind_or_its_value_and_is_written_as_its_value(tmp_path):
    with pytest.raises(StateError, match="kind 'weights' is not one of model, master, optim, buffer, object, rng"):
        LocalShard("model/w", "weights", (4,), Box.full((4,)), torch.zeros(4))
    assert state(0, 1.0).shards[1].kind is Kind.MODEL
    Checkpointer(options=Options(fsync=False)).save(SoloComm(), str(tmp_path), "s1", lambda: state(0, 1.0))
    with open(tmp_path / "s1" / "manifest.json") as f:
        tensors = json.load(f)["tensors"]
    assert {n: e["kind"] for n, e in tensors.items()} == {"master/w": "master", "model/w": "model"}


class Recording(Restore):
    """A Restore that records what the core asked of it; rank ``fails`` cannot stage."""

    def __init__(self, rank: int, fails: int = -1):
        self.rank, self.fails, self.calls = rank, fails, []

    def read(self, reader):
        self.calls.append("read")
        if self.rank == self.fails:
            raise ValueError("this rank cannot stage")
        return reader.read("master/w")

    def apply(self, staged):
        self.calls.append("apply")
        return staged.tolist()

    def undo(self):
        self.calls.append("undo")


def test_nothing_is_applied_until_every_rank_staged_and_a_failed_staging_is_undone_everywhere(tmp_path):
    d = str(tmp_path)

    def job(comm):
        ckpt = Checkpointer(options=Options(fsync=False))
        ckpt.save(comm, d, "s1", lambda: state(comm.rank, 3.0))
        good = Recording(comm.rank)
        result = ckpt.load(comm, d, None, good).result
        bad = Recording(comm.rank, fails=1)
        try:
            ckpt.load(comm, d, None, bad)
            error = None
        except AdaCheckError as e:
            error = str(e)
        return good.calls, result, bad.calls, error

    for rank, (good, result, bad, error) in enumerate(run_ranks(3, job)):
        assert good == ["read", "apply"] and result == [3.0] * 4
        assert bad == ["read", "undo"], (rank, bad)      # applied nowhere, undone on every rank
        assert "rank 1" in error and "this rank cannot stage" in error


def test_a_damaged_checkpoint_names_the_adapters_call_for_the_newest_intact_one(tmp_path):
    d = str(tmp_path)
    ckpt = Checkpointer(options=Options(fsync=False))
    for step in (1, 2):
        ckpt.save(SoloComm(), d, f"s{step}", lambda: state(0, float(step)))
    data = [f for f in os.listdir(tmp_path / "s2") if f.endswith(".safetensors")]
    for name in data:
        with open(tmp_path / "s2" / name, "r+b") as f:
            f.seek(-32, os.SEEK_END)          # the data of both tensors (4 float32 each)
            f.write(b"\xff" * 32)
    applied = []
    restore = Restore.of(lambda r: r.read("master/w"), applied.append,
                         how_to_load=lambda tag, manifest: f"my_trainer.load(tag={tag!r}, step={manifest.step})")
    with pytest.raises(IntegrityError, match=r"my_trainer\.load\(tag='s1', step=1\)"):
        Checkpointer(options=Options(fsync=False)).load(SoloComm(), d, None, restore)
    assert applied == []


def test_the_jobs_checkpointer_has_the_class_its_options_ask_for(tmp_path, monkeypatch):
    from adacheck import jobs
    from adacheck.config import TiersConfig
    from adacheck.errors import ConfigError
    from adacheck.tiers.tiered import TieredCheckpointer
    monkeypatch.setenv("ADACHECK_MEMORY_DIR", str(tmp_path / "shm"))
    plain, tiered = Options(fsync=False), Options(fsync=False, tiers=TiersConfig(memory=True))
    assert type(jobs.checkpointer(plain)) is Checkpointer
    assert type(jobs.checkpointer(tiered)) is TieredCheckpointer
    with pytest.raises(ConfigError, match=r"adacheck\.jobs\.checkpointer"):
        Checkpointer(options=tiered)          # it would save without the memory tier the options ask for
    with pytest.raises(ConfigError, match=r"adacheck\.jobs\.checkpointer"):
        Checkpointer(options=plain).configure(tiered)

    class Owner:
        pass
    owner = Owner()
    first = jobs.kept_on(owner, plain)
    assert jobs.kept_on(owner, plain) is first and jobs.kept(owner) is first
    first.on_saved = print
    second = jobs.kept_on(owner, tiered)      # the memory tier turned on: the other class, the same caches
    assert type(second) is TieredCheckpointer and second.caches is first.caches and jobs.kept(owner) is second
    assert second.on_saved is print
    second.close()
