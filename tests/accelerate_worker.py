"""One rank of a Hugging Face Accelerate training loop (no Trainer) with DeepSpeed (CPU, gloo) and
an ``adacheck`` block in the DeepSpeed config, as a user writes it: ``import adacheck_ds``,
``PartialState(cpu=True)``, then ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=
config))``, ``accelerator.prepare`` and ``accelerator.save_state`` / ``load_state``.  A tiny MLP
on a synthetic regression set, a torch AdamW and a torch LambdaLR warm-up (Accelerate hands the
optimizer to DeepSpeed and saves the scheduler itself).

spec = {"mode": "deepspeed" | "cpu", "stage": 2, "steps": N, "save_at": [K, ...],
        "save_dir": DIR, "resume": DIR | null}
  "deepspeed": trains up to step N; ``save_state(save_dir)`` after each step K (the same
               directory each time, as a loop that saves every K steps does); with ``resume``,
               ``load_state(resume)`` first and continues from the step the engine was saved at
               (skipping the batches done before it).
  "cpu":       ``Accelerator(cpu=True, deepspeed_plugin=...)`` instead (no PartialState first):
               one step, then ``save_state(save_dir)``, to show what that combination runs.
Rank 0 writes result.json: {"losses": {step: [the loss of each rank]}, "ranks": [per rank, what
Accelerate and torch.distributed say of the job, what the model became (see facts())]}.
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

import adacheck_ds  # noqa: E402,F401  (the "adacheck" block is honoured from here on)

SAMPLES, WIDTH, MICRO_BATCH = 64, 16, 4


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    y = x[:, :4].sin() + 0.1 * torch.randn(SAMPLES, 4, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main():
    spec = json.load(open(sys.argv[1]))
    out = os.path.join(sys.argv[2], spec.get("result", "result.json"))
    ds = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "zero_optimization": {"stage": spec["stage"]},
          "adacheck": {"enabled": True}}
    plugin = DeepSpeedPlugin(hf_ds_config=ds)
    if spec["mode"] == "cpu":
        accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin)
    else:
        PartialState(cpu=True)          # (first: the job's ranks on CPU, a gloo group)
        accelerator = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    loader = torch.utils.data.DataLoader(data(), batch_size=MICRO_BATCH)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    start = 0
    if spec.get("resume"):
        accelerator.load_state(spec["resume"])
        start = model.global_steps                  # (the DeepSpeed engine's step, restored)
    steps = 1 if spec["mode"] == "cpu" else spec["steps"]
    losses = {}
    for step, (x, y) in enumerate(accelerator.skip_first_batches(loader, start), start + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses[step] = loss.item()
        if step in spec.get("save_at", []) or spec["mode"] == "cpu":
            accelerator.save_state(spec["save_dir"])
        if step == steps:
            break
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (losses, facts(accelerator, model, start)))
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"losses": {s: [lo[s] for lo, _ in everyone] for s in losses},
                       "ranks": [f for _, f in everyone]}, f)


def facts(accelerator, model, start: int) -> dict:
    """What this rank's Accelerate state and torch.distributed say of the job, what ``prepare``
    made of the model (a DeepSpeedEngine with AdaCheck attached?), and the step it started at."""
    state = accelerator.state
    return {"dist_world_size": torch.distributed.get_world_size(),
            "dist_rank": torch.distributed.get_rank(),
            "accelerate_num_processes": state.num_processes,
            "accelerate_process_index": state.process_index,
            "distributed_type": state.distributed_type.name,
            "model": type(model).__name__,
            "deepspeed_engine": isinstance(model, DeepSpeedEngine),
            "adacheck_attached": getattr(model, "adacheck", None) is not None,
            "start": start}


if __name__ == "__main__":
    main()
