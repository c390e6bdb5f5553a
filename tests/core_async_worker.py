"""One rank of a job whose process group met in a FileStore (``init_method="file://..."``), not
a TCP store: an async save asks for writer processes (the default) and gets the thread, with a
warning, and commits the state at the call.  ``python core_async_worker.py SPEC OUT_DIR``.

``spec["backend"]`` (default gloo) names the default group's backend: ``cuda:gloo`` makes a
default group that carries no CPU tensors, as a GPU job's NCCL group, on a machine without one;
a synchronous save, then the async one, must work over it."""
import json
import logging
import os
import sys
import warnings

import torch


def main():
    spec, out = json.load(open(sys.argv[1])), sys.argv[2]
    logging.basicConfig(level=logging.WARNING)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group(spec.get("backend", "gloo"), init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    from adacheck.checkpoint import CheckpointReader, Checkpointer
    from adacheck.integration import LocalShard, LocalState
    from adacheck.plan.exchange import default_comm
    from adacheck.types import Box
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    at_call = w.clone()
    job = Checkpointer()
    state = LocalState([LocalShard("master/w", "master", (4 * world, 3), Box((4 * rank, 0), (4, 3)), w)], step=1)
    job.save(default_comm(), spec["dir"], "s0", lambda: state)
    job.save_async(default_comm(), spec["dir"], "s1", lambda: state)
    w.add_(1)                        # training goes on
    manifest = job.finish()
    got = CheckpointReader(os.path.join(spec["dir"], "s1")).read("master/w")[4 * rank:4 * rank + 4]
    got0 = CheckpointReader(os.path.join(spec["dir"], "s0")).read("master/w")[4 * rank:4 * rank + 4]
    # A failure after the commit: 'latest' cannot be written (a directory stands in its place), so
    # the save fails with its manifest committed, and says so (not "goes on from the previous one").
    default_comm().barrier()
    if rank == 0:
        os.remove(os.path.join(spec["dir"], "latest"))
        os.makedirs(os.path.join(spec["dir"], "latest", "in-the-way"))
    default_comm().barrier()
    at_call2 = w.clone()
    job.save_async(default_comm(), spec["dir"], "s2", lambda: state)
    w.add_(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failed = job.finish()
    got2 = CheckpointReader(os.path.join(spec["dir"], "s2")).read("master/w")[4 * rank:4 * rank + 4]
    with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
        json.dump({"committed": manifest is not None and manifest.tag == "s1", "writer": job.writer is not None,
                   "equal": bool(torch.equal(got, at_call) and torch.equal(got0, at_call)),
                   "after_commit": {"returned": failed is not None, "warnings": [str(c.message) for c in caught],
                                    "equal": bool(torch.equal(got2, at_call2))}}, f)


if __name__ == "__main__":
    main()
