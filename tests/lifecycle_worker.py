"""One rank of test_lifecycle.py: a DeepSpeed engine with AdaCheck attached trains a step and
saves, then the script calls destroy_process_group(); prints, as its last line, the process's
threads (/proc/self/task) before and after, torch's is_initialized() and whether AdaCheck's exit
hook will pause for gloo's threads."""
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

import adacheck_ds  # noqa: F401  (the "adacheck" block of the config)
from adacheck.checkpoint import lifecycle


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main(spec_path: str, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(16, 16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "adacheck": {"enabled": True}})
    loss = engine(torch.randn(1, 16)).sum()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    before = threads()
    dist.destroy_process_group()
    print(json.dumps({"before": before, "after": threads(), "initialized": dist.is_initialized(),
                      "settles": lifecycle.settles()}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
