"""One rank of a Hugging Face Trainer run with DeepSpeed (CPU, gloo) and an ``adacheck`` block in
the DeepSpeed config, as a user writes it: ``import adacheck_ds``, then ``TrainingArguments(
deepspeed=config)``.  A tiny GPT-2 built from a config (no downloads), a synthetic dataset.

spec = {"stage": 2, "adacheck": {...} | null, "output_dir": DIR, "max_steps": N, "save_steps": K,
        "resume": CHECKPOINT_DIR | null, "die_after": STEP | null}
Rank 0 writes result.json: the loss the Trainer logged at each step ({step: loss}).
"""
import json
import logging
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import adacheck_ds  # noqa: E402,F401  (the "adacheck" block is honoured from here on)

VOCAB, SEQ = 96, 16


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Record(TrainerCallback):
    def __init__(self, spec, out):
        self.spec, self.out, self.losses = spec, out, {}

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            if args.process_index == 0:
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
    args = TrainingArguments(output_dir=spec["output_dir"], per_device_train_batch_size=2, max_steps=spec["max_steps"],
                             save_steps=spec["save_steps"], logging_steps=1, learning_rate=3e-3, warmup_steps=2,
                             weight_decay=0.01, max_grad_norm=1.0, seed=0, data_seed=0, deepspeed=ds, report_to=[],
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Record(spec, out)])
    trainer.train(resume_from_checkpoint=spec.get("resume"))


if __name__ == "__main__":
    main()
