"""A save and a load run without Python's automatic garbage collection (adacheck.gcpause): a
collection in the middle of one walks the whole process and, every few calls, makes one rank of
the job wait for a full collection.

Oracle: Python's own gc callbacks, which report every collection with the stack it ran on."""
import gc
import os
import sys

import pytest
import torch

import adacheck
from adacheck.checkpoint import Checkpointer
from adacheck.errors import DistributedError
from adacheck.integration import LocalShard, LocalState, Restore
from adacheck.plan.exchange import SoloComm
from adacheck.types import Box

pytestmark = pytest.mark.unit

PACKAGE = os.path.dirname(adacheck.__file__)


def many_tensors(n=400):
    """A state whose manifest has thousands of objects (boxes, entries): enough for collections."""
    g = torch.Generator().manual_seed(n)
    shards = []
    for i in range(n):
        t = torch.randn(8, 4, generator=g)
        shards += [LocalShard(f"layer{i}/w", "master", (8, 4), Box((0, 0), (4, 4)), t[:4]),
                   LocalShard(f"layer{i}/w", "master", (8, 4), Box((4, 0), (4, 4)), t[4:])]
    return LocalState(shards, objects={"step": 3}, framework={"name": "test"}, step=3)


class Collections:
    """The collections that ran while AdaCheck's code (not the pause's own exit) was on the stack."""

    def __init__(self):
        self.inside = []

    def __call__(self, phase, info):
        if phase != "start":
            return
        f = sys._getframe(1)
        while f is not None:
            path = f.f_code.co_filename
            if path.startswith(PACKAGE) and not path.endswith("gcpause.py"):
                self.inside.append((info["generation"], f.f_code.co_name, path))
                return
            f = f.f_back

    def __enter__(self):
        self.threshold = gc.get_threshold()
        gc.set_threshold(50, 2, 2)          # often, so that a save without the pause meets many
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)
        gc.set_threshold(*self.threshold)


def test_no_collection_runs_inside_a_save_or_a_load_and_the_scripts_setting_is_kept(tmp_path):
    state = many_tensors()
    assert gc.isenabled()
    with Collections() as seen:
        job = Checkpointer()        # (its methods: the module's save() and load() call them, after which
        # a collection put off by the pause may run at once, in their frames)
        m = job.save(SoloComm(), str(tmp_path), "s1", lambda: state)
        got = job.load(SoloComm(), str(tmp_path), "s1",
                       Restore.of(lambda r: {n: r.read(n) for n in r.manifest.tensors}, lambda staged: staged)).result
        assert gc.isenabled()               # on again once the calls returned
        assert seen.inside == [], seen.inside[:5]
        # a script that turned collection off keeps it off
        gc.disable()
        try:
            job.save(SoloComm(), str(tmp_path), "s2", lambda: state)
            assert not gc.isenabled()
        finally:
            gc.enable()

        # a save that fails turns it on again
        def broken():
            raise RuntimeError("collect failed")
        with pytest.raises(DistributedError, match="collect failed"):
            job.save(SoloComm(), str(tmp_path), "s3", broken)
        assert gc.isenabled()
    assert len(m.tensors) == 400
    for s in state.shards[:8]:
        assert torch.equal(got[s.name][s.box.slices()], s.tensor)
