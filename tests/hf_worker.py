"""One rank of a Hugging Face Trainer run with DeepSpeed (CPU, gloo) and an ``adacheck`` block in
the DeepSpeed config, as a user writes it: ``import adacheck_ds``, then ``TrainingArguments(
deepspeed=config, use_cpu=True)``.  A tiny GPT-2 built from a config (no downloads), a synthetic
dataset.  ``use_cpu=True`` is what makes the Trainer (through Accelerate) see the job's ranks on
CPU: without it every rank believes it is the only process (world size 1) while DeepSpeed runs
them all.

spec = {"stage": 2, "adacheck": {...} | null, "output_dir": DIR, "max_steps": N, "save_steps": K,
        "resume": CHECKPOINT_DIR | null, "die_after": STEP | null}
Rank 0 writes result.json: {"losses": {step: the loss the Trainer logged}, and once training ends
"ranks": [per rank, what the Trainer, Accelerate and torch.distributed say of the job and what
engine trained (see facts())]}.
"""
import json
import logging
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import adacheck_ds  # noqa: E402,F401  (the "adacheck" block is honoured from here on)

VOCAB, SEQ = 96, 16


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class AdaCheckLogs(TrainerCallback):
    """docs/deepspeed.md's callback: each AdaCheck save's numbers in the Trainer's logs."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        ac = getattr(self.trainer.model_wrapped, "adacheck", None)
        if ac is not None and ac.last_save is not None:
            self.trainer.log({f"adacheck/{k}": v for k, v in ac.last_save.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)})


class Record(TrainerCallback):
    def __init__(self, spec, out):
        self.spec, self.out, self.losses, self.saves = spec, out, {}, {}

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "adacheck/stored_bytes" in logs:
            self.saves[state.global_step] = {k: v for k, v in logs.items() if k.startswith("adacheck/")}
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            if torch.distributed.get_rank() == 0:
                with open(self.out, "w") as f:
                    json.dump({"losses": self.losses}, f)

    def on_step_end(self, args, state, control, **kw):
        if self.spec.get("die_after") == state.global_step:      # a crash once this step is done
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("adacheck").setLevel(logging.INFO)      # (what AdaCheck loaded, and from where)
    spec = json.load(open(sys.argv[1]))
    out = os.path.join(sys.argv[2], spec.get("result", "result.json"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=0, eos_token_id=0))
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": spec["stage"]},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                                              "warmup_max_lr": "auto"}}}
    if spec.get("adacheck") is not None:
        ds["adacheck"] = spec["adacheck"]
    # use_cpu=True: Accelerate's state, and so the Trainer's world size and data sharding, has
    # the job's ranks on CPU; the Trainer's Accelerator still runs DeepSpeed
    args = TrainingArguments(output_dir=spec["output_dir"], per_device_train_batch_size=2, max_steps=spec["max_steps"],
                             save_steps=spec["save_steps"], logging_steps=1, learning_rate=3e-3, warmup_steps=2,
                             weight_decay=0.01, max_grad_norm=1.0, seed=0, data_seed=0, deepspeed=ds, report_to=[],
                             dataloader_num_workers=0, disable_tqdm=True, use_cpu=True)
    record = Record(spec, out)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[record])
    trainer.add_callback(AdaCheckLogs(trainer))
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, facts(trainer))
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"losses": record.losses, "ranks": ranks, "saves": record.saves}, f)


def facts(trainer) -> dict:
    """What this rank's Trainer, its Accelerate state and torch.distributed say of the job, and
    whether the model trained in a DeepSpeedEngine that AdaCheck is attached to."""
    state, engine = trainer.accelerator.state, trainer.model_wrapped
    return {"dist_world_size": torch.distributed.get_world_size(),
            "dist_rank": torch.distributed.get_rank(),
            "accelerate_num_processes": state.num_processes,
            "accelerate_process_index": state.process_index,
            "distributed_type": state.distributed_type.name,
            "args_world_size": trainer.args.world_size,
            "args_process_index": trainer.args.process_index,
            "deepspeed_engine": isinstance(engine, DeepSpeedEngine),
            "adacheck_attached": getattr(engine, "adacheck", None) is not None}


if __name__ == "__main__":
    main()
