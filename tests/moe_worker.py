"""One rank of a real DeepSpeed-MoE (CPU, gloo) training run: ds_worker.py's spec and actions,
with a model whose middle layer is ``deepspeed.moe.layer.MoE``.

run = {"ep": 2, "experts": 2, "stage": 0 | 1 | 2, "dtype": "fp32" | "bf16", "adacheck": {...} | null,
       "actions": [...]}   (actions: ds_worker.py's)

The model: Linear(12, hidden) -> MoE(num_experts, ep_size=ep, top-1 gating) -> Linear(hidden, 5);
its non-expert parameters are data-parallel over every rank, each expert over its
expert-data-parallel group.  The optimizer's param groups are split into expert and
non-expert groups with DeepSpeed's own split_params_into_different_moe_groups_for_optimizer
(what ZeRO needs).  Each rank trains on its own batches; losses include the gate's auxiliary
loss.  A dump gathers every expert (named by its global id, as DeepSpeed's native expert files
name them) from the ranks of its expert-parallel group, through DeepSpeed's safe_get_full_* API.
"""
import os
import re
import sys

import ds_worker
from ds_worker import deepspeed, torch

from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from deepspeed.utils import groups  # noqa: E402


class MoENet(torch.nn.Module):
    def __init__(self, hidden, experts, ep):
        super().__init__()
        self.inp = torch.nn.Linear(12, hidden)
        expert = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU())
        self.moe = MoE(hidden_size=hidden, expert=expert, num_experts=experts, ep_size=ep, k=1,
                       min_capacity=0, capacity_factor=2.0)
        self.out = torch.nn.Linear(hidden, 5)

    def forward(self, x):
        h, aux, _ = self.moe(torch.nn.functional.gelu(self.inp(x)))
        return self.out(h), aux


def make_engine(run):
    torch.manual_seed(run.get("seed", 0))
    model = MoENet(run.get("hidden", 8), run.get("experts", 2), run["ep"])
    # every expert starts from its own weights, the same whichever rank holds it: global expert
    # g's initial weights come from seed 100 + g
    # (DeepSpeed makes the expert-parallel groups of consecutive ranks, checked below once it has)
    ep_rank = torch.distributed.get_rank() % run["ep"]
    local = model.moe.num_local_experts
    for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
        g = torch.Generator().manual_seed(100 + ep_rank * local + i)
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    params = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters()], "name": "params"})
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    cfg = ds_worker.ds_config(run)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    assert groups._get_expert_parallel_rank(model.moe.expert_group_name) == ep_rank
    return engine


def train(engine, n, losses):
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    for _ in range(n):
        x, y = ds_worker.batch(engine.global_steps, engine.global_rank, dtype)
        out, aux = engine(x)
        loss = ((out.float() - y) ** 2).mean() + 0.01 * aux.float()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item())


_LOCAL = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")


def full_state(engine):
    """Every logical tensor through DeepSpeed's API, experts under their global ids, gathered
    over the expert-parallel group (each rank's local experts are other experts)."""
    moe = engine.module.moe
    ep_rank = groups._get_expert_parallel_rank(moe.expert_group_name)
    local = moe.num_local_experts

    def global_name(k):
        m = _LOCAL.match(k)
        return f"{m.group(1)}{ep_rank * local + int(m.group(2))}{m.group(3)}" if m else k
    return ds_worker.merged_state({global_name(k): v for k, v in _stage_state(engine).items()})


_stage_state = ds_worker.full_state
ds_worker.make_engine, ds_worker.train, ds_worker.full_state = make_engine, train, full_state

if __name__ == "__main__":
    sys.argv[0] = os.path.abspath(__file__)
    ds_worker.run_main()
