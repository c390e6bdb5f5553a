"""One rank of a real DeepSpeed PipelineEngine (CPU, gloo) training run: ds_worker.py's spec and
actions, with a ``PipelineModule`` in ``run["pp"]`` stages trained by ``train_batch``.

run = {"pp": 2, "tp": 1, "stage": 0 | 1, "dtype": "fp32" | "bf16", "tie": true, "layers": 4, "hidden": 16,
       "adacheck": {...} | null, "actions": [...]}   (actions: ds_worker.py's)

The model: an input projection (12 -> hidden), ``layers`` residual blocks, an output projection
(hidden -> 12); with ``tie`` the two projections are one ``TiedLayerSpec`` (the output uses the
input's weight transposed), held whole by the first and the last stage as DeepSpeed ties them.
Layers are seeded by their global index (``seed_layers``), so the initial weights do not depend on
the number of stages.  Every rank of a data-parallel replica sees the same micro-batches; a dump
gathers every stage's tensors (through DeepSpeed's own safe_get_full_* API) to rank 0.
"""
import os
import sys

import ds_worker
from ds_worker import deepspeed, torch

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.register_buffer("gain", torch.linspace(0.9, 1.1, hidden))

    def forward(self, h):
        return h + torch.nn.functional.gelu(self.norm(self.fc(h))) * self.gain.to(h.dtype)


TP_GROUP = None     # the pipeline grid's tensor-parallel (slice) group, once the PipelineModule is built


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, the tensor-parallel ranks' gradients summed backward."""
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        torch.distributed.all_reduce(g, group=TP_GROUP)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the tensor-parallel ranks' partial outputs summed forward, identity backward."""
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        torch.distributed.all_reduce(x, group=TP_GROUP)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _mark(p, dim):
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


class TPBlock(torch.nn.Module):
    """A residual MLP split as Megatron splits one over ``tp`` ranks: fc1 column-parallel (its
    weight and bias cut along dimension 0), fc2 row-parallel (its weight cut along dimension 1,
    its bias and the norm replicated); each rank's slices are cut from the same full weights."""

    def __init__(self, hidden, tp, tp_rank):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        full1, full2 = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)
        part = 2 * hidden // tp
        self.fc1_weight = torch.nn.Parameter(full1.weight.detach()[tp_rank * part:(tp_rank + 1) * part].clone())
        self.fc1_bias = torch.nn.Parameter(full1.bias.detach()[tp_rank * part:(tp_rank + 1) * part].clone())
        self.fc2_weight = torch.nn.Parameter(full2.weight.detach()[:, tp_rank * part:(tp_rank + 1) * part].clone())
        self.fc2_bias = torch.nn.Parameter(full2.bias.detach().clone())
        _mark(self.fc1_weight, 0)
        _mark(self.fc1_bias, 0)
        _mark(self.fc2_weight, 1)

    def forward(self, h):
        x = _CopyToTP.apply(self.norm(h))
        a = torch.nn.functional.gelu(torch.nn.functional.linear(x, self.fc1_weight, self.fc1_bias))
        return h + _ReduceFromTP.apply(torch.nn.functional.linear(a, self.fc2_weight)) + self.fc2_bias


def _untied_output(module, h):
    """The tied projection used backwards: hidden -> 12 with the input projection's weight."""
    return torch.nn.functional.linear(h, module.weight.t())


def _loss(out, y):
    return ((out.float() - y) ** 2).mean()


def layers(run):
    hidden = run.get("hidden", 16)
    specs = [TiedLayerSpec("embed", torch.nn.Linear, 12, hidden, bias=False) if run.get("tie")
             else LayerSpec(torch.nn.Linear, 12, hidden)]
    if run.get("split"):      # tensor-parallel blocks (run["tp"] ranks)
        tp = run["tp"]
        tp_rank = torch.distributed.get_rank() % tp     # (the model axis is the innermost of the grid)
        specs += [LayerSpec(TPBlock, hidden, tp, tp_rank) for _ in range(run.get("layers", 4))]
    else:
        specs += [LayerSpec(Block, hidden) for _ in range(run.get("layers", 4))]
    specs.append(TiedLayerSpec("embed", torch.nn.Linear, 12, hidden, bias=False, forward_fn=_untied_output)
                 if run.get("tie") else LayerSpec(torch.nn.Linear, hidden, 12))
    return specs


def make_engine(run):
    torch.manual_seed(run.get("seed", 0))
    world, tp = torch.distributed.get_world_size(), run.get("tp", 1)
    topo = PipeModelDataParallelTopology(num_pp=run["pp"], num_mp=tp, num_dp=world // (run["pp"] * tp))
    model = PipelineModule(layers(run), topology=topo, loss_fn=_loss, partition_method="uniform",
                           seed_layers=True, base_seed=1234 + run.get("seed", 0))
    global TP_GROUP
    TP_GROUP = model._grid.get_slice_parallel_group()
    cfg = ds_worker.ds_config(run)
    cfg.pop("train_micro_batch_size_per_gpu")
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=run.get("accum", 2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def _batches(engine):
    """The micro-batches of the next step of this rank's data-parallel replica."""
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    dp = engine.grid.data_parallel_id
    for micro in range(engine.gradient_accumulation_steps()):
        g = torch.Generator().manual_seed(100000 * engine.global_steps + 100 * dp + micro)
        yield torch.randn(2, 12, generator=g).to(dtype), torch.randn(2, 12, generator=g)


def train(engine, n, losses):
    for _ in range(n):
        loss = engine.train_batch(data_iter=_batches(engine))
        t = loss.detach().float().clone()   # (the mean over the data-parallel replicas, on every rank)
        losses.append(t.item())


def full_state(engine):
    """Every stage's logical tensors, gathered with DeepSpeed's own API (each rank its stage's,
    tensor-parallel slices side by side), then merged on every rank (the tied weights, held by two
    stages, must agree)."""
    return ds_worker.merged_state(_stage_state(engine))


_stage_state = ds_worker.full_state
ds_worker.make_engine, ds_worker.train, ds_worker.full_state = make_engine, train, full_state

if __name__ == "__main__":
    sys.argv[0] = os.path.abspath(__file__)
    ds_worker.run_main()
