"""A DeepSpeed training script written the way users write them: it ends however it ends, with
no ``engine.destroy()`` and no ``destroy_process_group()``.  Run under torchrun.

  --ckpt DIR       checkpoint directory (AdaCheck's save_dir); loaded at start if it holds one
  --until N        train until global step N
  --mode M         native (no AdaCheck), plain (AdaCheck, save at the end), async (the same with
                   "async": true: the last save is still in flight when the script ends), async_thread
                   (the same with "async_writer": "thread") or online
                   (AdaCheck online deltas after every step, bases only every 100 steps)
  --losses FILE    rank 0 appends one JSON line per step: {"step": s, "loss": l}

The model has dropout, so a resume is exact only when the RNG state is restored.
"""
import argparse
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402

import adacheck_ds  # noqa: E402,F401  (AdaCheck for engines whose config has the block)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--until", type=int, required=True)
    ap.add_argument("--mode", choices=("native", "plain", "async", "async_thread", "online"), required=True)
    ap.add_argument("--losses", required=True)
    a = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
           "log_level": "info"}     # (DeepSpeed's logger shows its INFO lines, AdaCheck's save line among them)
    asynchronous = a.mode.startswith("async")
    if a.mode != "native":
        cfg["adacheck"] = {"enabled": True, "save_dir": a.ckpt, "async": asynchronous,
                           "online": {"enabled": a.mode == "online", "base_interval": 100}}
        if a.mode == "async_thread":
            cfg["adacheck"]["async_writer"] = "thread"
    if asynchronous:
        # state the model does not use, new at every save (so never referenced: written each time):
        # the background persist then takes long enough to be in flight when the script ends
        model.register_buffer("ballast", torch.zeros(16 << 20))
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    if a.mode != "native":
        engine.load_checkpoint(a.ckpt)
    while engine.global_steps < a.until:
        g = torch.Generator().manual_seed(1000 * engine.global_steps + engine.global_rank)
        x = torch.randn(4, 16, generator=g).bfloat16()
        y = torch.randn(4, 4, generator=g)
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        if engine.global_rank == 0:
            with open(a.losses, "a") as f:
                f.write(json.dumps({"step": engine.global_steps, "loss": t.item()}) + "\n")
    if asynchronous:
        engine.module.ballast.copy_(torch.randn(16 << 20, generator=torch.Generator().manual_seed(engine.global_steps)))
    if a.mode in ("plain", "async", "async_thread"):
        engine.save_checkpoint(a.ckpt)


if __name__ == "__main__":
    main()
