"""One rank of test_tiers.py's test of the peer copy in a save in parts (NodeSpread.move_own): two
ranks on simulated nodes a and b, each sending its files to the other, in three cases: its own
files; a block that also holds names that are not the sender's (one leading out of the
directory); a shard file written for another checkpoint.  Then three rounds of blocks received
into a reused buffer (DeltaSpread's).  Writes what each rank received, or the error it raised,
to <out>/rank<r>.json."""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from adacheck.plan.exchange import TorchComm
from adacheck.tiers import NodeSpread, own_files


def main(spec_path: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    comm, rank = TorchComm(), dist.get_rank()
    spread = NodeSpread(("a", "b"), True)
    result = {}
    for case, shard_tag, extra in (("good", "t1", []), ("foreign", "t1", ["manifest-g0-rank-00007.json", "../evil.json"]),
                                   ("wrong_tag", "other", [])):
        d = os.path.join(out, f"node{rank}", case)
        os.makedirs(d, exist_ok=True)
        save_file({"x": torch.full((4,), float(rank))}, os.path.join(d, own_files(0, rank)[0]),
                  metadata={"format": "pt", "adacheck_tag": shard_tag})
        for name in own_files(0, rank)[1:] + [n for n in extra if "/" not in n]:
            with open(os.path.join(d, name), "w") as f:
                f.write(json.dumps({"rank": rank, "name": name}))
        with open(os.path.join(out, f"node{rank}", "evil.json"), "w") as f:
            f.write(json.dumps({"rank": rank}))

        def names(w, extra=extra):      # (this rank sends its own names and ``extra``; it checks others' strictly)
            return own_files(0, w) + (extra if w == rank else [])

        try:
            spread.move_own(comm, d, "t1", names)
            result[case] = {"error": None}
        except Exception as e:  # noqa: BLE001 - reported to the test
            result[case] = {"error": f"{type(e).__name__}: {e}"}
        result[case]["files"] = sorted(os.listdir(d))
    # DeltaSpread's rounds: blocks sent from and received into buffers kept from round to round
    # (tiers.Reused): each round's block arrives whole, in the buffer given, whatever came before
    from adacheck.tiers import Reused
    sent, incoming, rounds = Reused(), Reused(), []
    for n in (300_000, 200_000, 300_001):
        block = sent(n)
        block.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + rank)))
        got = {}
        comm.transfer([(0, 1), (1, 0)], lambda i, b=block: b, lambda i, data: got.update(data=bytes(data),
                                                                                           at=data.ctypes.data),
                      into=lambda i, n: incoming(n))
        want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + 1 - rank))
        rounds.append({"same": got["data"] == bytes(want.numpy()), "at": got["at"], "buffer": incoming(1).data_ptr()})
    result["reused"] = rounds
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
