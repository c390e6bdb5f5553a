"""Facts of megatron-core's parallel layout that saving, loading and the online mode share: this
rank's place (``topology``), the sharded state dict as Megatron-LM builds it, the RNG states a
rank keeps (host generators, the device generator, the model-parallel tracker), the scheduler's
exact reload, and the communicator AdaCheck uses.  checkpointing, replay and online import it;
it imports none of them."""
from __future__ import annotations

from typing import List

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from adacheck.format import jsontree
from adacheck.plan.exchange import default_comm
from adacheck.checkpoint.rng import rng_state, set_rng_state

from .state import distributed_optimizers

comm = default_comm      # torch.distributed's world when it is initialized, else a world of one


# Keys of a ChainedOptimizer's state without a per-optimizer prefix, so that logical names do
# not depend on how the parameters were split into optimizers.
OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True}


def topology() -> dict:
    """This rank's place in megatron-core's parallel state."""
    vp = ps.get_virtual_pipeline_model_parallel_world_size()
    return {
        "tp": ps.get_tensor_model_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_world_size(), "dp_rank": ps.get_data_parallel_rank(),
        "cp": ps.get_context_parallel_world_size(), "cp_rank": ps.get_context_parallel_rank(),
        "ep": ps.get_expert_model_parallel_world_size(), "ep_rank": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_world_size(), "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "edp": ps.get_expert_data_parallel_world_size(),
        "vp": vp or 1,
    }


SIZES = ("tp", "pp", "dp", "cp", "ep", "etp", "vp")


def layout_name(topo: dict) -> str:
    return " ".join(f"{k.upper()}={topo.get(k, '?')}" for k in SIZES) if topo else "an unknown layout"


def chunk_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def unwrap(chunk):
    """The module whose sharded_state_dict names the parameters (inside DDP / Float16Module)."""
    return chunk.module if hasattr(chunk, "module") else chunk


def sharded_state_dict(model: List, optimizer, is_loading: bool, with_optimizer: bool = True) -> dict:
    """{"model" | "model<i>": ..., "optimizer": ...} as Megatron-LM builds it; without the
    optimizer when it is a DistributedOptimizer (see state.distopt_describe)."""
    model = list(model)
    sd = {}
    for i, chunk in enumerate(model):
        if len(model) > 1:
            ps.set_virtual_pipeline_model_parallel_rank(i)
        sd[chunk_key(i, len(model))] = unwrap(chunk).sharded_state_dict()
    if len(model) > 1:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    if with_optimizer and optimizer is not None and not distributed_optimizers(optimizer):
        model_sd = sd if len(model) > 1 else sd["model"]
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                       metadata=dict(OPTIMIZER_METADATA))
    return sd


def _device() -> bool:
    """Whether the device generator is in use: CUDA, or megatron-core's CPU shim's own."""
    from .cpu import is_enabled
    return is_enabled() or (torch.cuda.is_available() and torch.cuda.is_initialized())


def rank_state() -> dict:
    """This rank's RNG states: host generators, the device generator and megatron-core's
    model-parallel tracker (each apart: dropout draws from the device generator and the tracker)."""
    return dict(rng_state(device=_device()), tracker=_tracker_states())


def set_rank_state(state: dict) -> None:
    set_rng_state(state, device=_device())
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _tracker_states() -> dict:
    return {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}


def json_args(args) -> dict:
    """The arguments that are plain values (for the record and for `adacheck inspect`)."""
    return jsontree.saveable(dict(sorted(vars(args).items())), "args", strict=False, quiet=True, tensors=False)


def sync_params(model) -> None:
    """With the distributed optimizer and ``overlap_param_gather``, a step updates only each
    rank's own shard of the weights; the rest arrive in the next forward pass.  All-gather
    them now (as Megatron-LM does before its saves), or a save right after a step (an online
    base, taken in the post-step hook) holds the previous step's weights outside each shard."""
    for chunk in model:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is not None and ddp.use_distributed_optimizer and ddp.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def load_scheduler(scheduler, state: dict) -> None:
    """``OptimizerParamScheduler.load_state_dict`` *adds* the saved step count to the current
    one (it expects a fresh scheduler); start from zero so loading into a scheduler that
    has already stepped restores the saved state exactly."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def _replica_groups() -> List[List[int]]:
    """Its tensor- and data-parallel group (with context parallelism; its pipeline stage), then with
    expert parallelism its expert data-parallel group, each in ascending order."""
    groups = [ps.get_tensor_and_data_parallel_group(with_context_parallel=True)]
    if ps.get_expert_model_parallel_world_size() > 1 or ps.get_expert_tensor_parallel_world_size() > 1:
        groups.append(ps.get_expert_data_parallel_group())
    return [sorted(torch.distributed.get_process_group_ranks(g)) for g in groups]


def replica_ranks() -> List[int]:
    """The global ranks that may hold replicas of this rank's state (:func:`_replica_groups`; main
    replicas are on the lowest ranks)."""
    return [r for g in _replica_groups() for r in g]


def main_replica_ranks() -> List[int]:
    """The lowest rank of each replica group: where the main replicas of the ShardedObjects this
    rank loads were saved (a load with the memory tier across nodes sends their objects first)."""
    return [g[0] for g in _replica_groups()]


COORDS = ("tp_rank", "pp_rank", "cp_rank", "ep_rank", "etp_rank")


def is_same_layout(saved: List[dict], topo: dict, world: int, rank: int = 0) -> bool:
    """The saving job's ranks (``manifest.layout["ranks"]``) ran this job's layout ``topo`` on
    ``world`` ranks (told by saving rank ``rank``'s entry: a format 5 manifest reads only it)."""
    return len(saved) == world and 0 <= rank < world and all(saved[rank].get(k) == topo[k] for k in SIZES)
