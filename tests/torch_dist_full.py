"""Every tensor of megatron-core torch_dist checkpoints as a full (unsharded) tensor, read with
megatron-core's own loader only: ``dist_checkpointing.load_tensors_metadata`` gives each key's
global shape, ``dist_checkpointing.load`` assembles it whole.  A test oracle independent of
AdaCheck's save and load code (not used here: adacheck_megatron.cpu only lets megatron-core run
without CUDA).

  python tests/torch_dist_full.py OUT_DIR CKPT [CKPT ...]   ->  OUT_DIR/<i>.safetensors
"""
import os
import sys
import tempfile

import torch


def main():
    out, sources = sys.argv[1], sys.argv[2:]
    from adacheck_megatron.cpu import enable_cpu
    enable_cpu()
    store = tempfile.mkdtemp(prefix="torch-dist-full-")
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}/rendezvous", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    for i, src in enumerate(sources):
        tracker = os.path.join(src, "latest_checkpointed_iteration.txt")
        if os.path.isfile(tracker):
            src = os.path.join(src, f"iter_{int(open(tracker).read().strip()):07d}")
        meta = dist_checkpointing.load_tensors_metadata(src)
        want = {k: ShardedTensor.from_rank_offsets(k, torch.empty(tuple(m.global_shape), dtype=m.dtype), replica_id=0)
                for k, m in meta.items()}
        got = dist_checkpointing.load(want, src)      # (also merges in the common, non-tensor state)
        save_file({k: got[k].contiguous() for k in want}, os.path.join(out, f"{i}.safetensors"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
