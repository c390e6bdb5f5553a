"""A small real DeepSpeed training (CPU, gloo) as a user would write it, with AdaCheck.

Run under torchrun.  --save-at N saves at step N natively and with AdaCheck; --die-at N
SIGKILLs the job after step N; --resume loads the AdaCheck checkpoint first.  Per-step
losses go to --out as JSON.
"""
import argparse
import json
import os
import signal

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402

import adacheck_ds  # noqa: E402,F401  registers AdaCheck with DeepSpeed


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=512, dim=256, layers=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for b in self.blocks:
            h = b(h, src_mask=mask.to(h.dtype), is_causal=True)
        return self.head(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--die-at", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=a.config)
    losses = {}
    if a.resume:
        engine.load_checkpoint(os.path.join(a.ckpt, "adacheck"))
    rank = engine.global_rank
    while engine.global_steps < a.steps:
        g = torch.Generator().manual_seed(10_000 * engine.global_steps + rank)
        tokens = torch.randint(0, 512, (4, 33), generator=g)
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 512), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses[engine.global_steps] = t.item() / engine.world_size
        if rank == 0:
            print(f"step {engine.global_steps:3d}  loss {losses[engine.global_steps]:.6f}", flush=True)
        if engine.global_steps == a.save_at:
            engine.save_checkpoint(os.path.join(a.ckpt, "adacheck"))
            adacheck_ds.save_native(engine, os.path.join(a.ckpt, "native"))
        if rank == 0:
            with open(a.out, "w") as f:
                json.dump(losses, f)
        if engine.global_steps == a.die_at:
            torch.distributed.barrier()
            if rank == 0:
                print(f"step {a.die_at}: simulating a crash (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    # leave the process group, as a tidy script does. This does not stop the gloo threads of the
    # groups DeepSpeed's engine holds; AdaCheck's exit hook pauses for them either way
    # (adacheck/lifecycle.py: their race with the interpreter's exit can abort it, SIGABRT)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
