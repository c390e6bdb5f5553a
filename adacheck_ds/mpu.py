"""A minimal Megatron-DeepSpeed style ``mpu`` (tensor parallelism x data parallelism).

DeepSpeed takes the model-parallel layout of a Megatron-DeepSpeed job from the ``mpu`` object
passed to ``deepspeed.initialize(mpu=...)``: its data-parallel group (gradients are averaged
and ZeRO partitions over it), its model-parallel group (gradient norms) and the model-parallel
rank (the ``mp_rank_XX`` of native checkpoint files).  Training jobs bring their own (Megatron's
``parallel_state``); AdaCheck's conversions, which rebuild DeepSpeed engines of a chosen layout,
use this one.  Ranks are ordered as Megatron orders them: the ``tp`` ranks of one
tensor-parallel group are consecutive, data-parallel groups stride by ``tp``.
"""
from __future__ import annotations

import torch.distributed as dist


class TensorParallel:
    def __init__(self, tp: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if tp < 1 or world % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the {world} ranks")
        self.tp, self.dp = tp, world // tp
        self._tp_rank, self._dp_rank = rank % tp, rank // tp
        self._tp_group = self._dp_group = None
        # every rank creates every group, in the same order (torch.distributed's rule)
        for d in range(self.dp):
            ranks = list(range(d * tp, (d + 1) * tp))
            g = dist.new_group(ranks)
            if rank in ranks:
                self._tp_group, self._tp_ranks = g, ranks
        for t in range(tp):
            ranks = list(range(t, world, tp))
            g = dist.new_group(ranks)
            if rank in ranks:
                self._dp_group, self._dp_ranks = g, ranks

    # tensor (= model) parallel: no pipeline here
    def get_tensor_model_parallel_rank(self):
        return self._tp_rank

    def get_tensor_model_parallel_world_size(self):
        return self.tp

    def get_tensor_model_parallel_group(self):
        return self._tp_group

    def get_tensor_model_parallel_src_rank(self):
        return self._tp_ranks[0]

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return self._dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self._dp_group

    def get_data_parallel_group_ranks(self):
        return list(self._dp_ranks)
