"""ZeRO stages 1 and 2 (DeepSpeedZeroOptimizer): each data-parallel rank's base optimizer steps
one flat fp32 partition per param group, a contiguous run of the group's parameters."""
from __future__ import annotations

import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .base import Frag, Layout, Wrapper, kept, lp_views_whole, relink


class Zero12(Wrapper):
    name = "zero12"
    flat_partitions = True
    refresh_rebuilds = True

    @staticmethod
    def matches(opt) -> bool:
        return isinstance(opt, DeepSpeedZeroOptimizer)

    def describe(self, stage, names) -> Layout:
        opt = self.opt
        lay = Layout(stage, self, opt.optimizer, groups=[[names[p] for p in g] for g in opt.bit16_groups])
        for g, flat in enumerate(opt.single_partition_of_fp32_groups):
            # The flat buffer holds the parameters in round_robin_bit16_groups order at
            # round_robin_bit16_offsets (with round_robin_gradients or parameter_alignment these
            # differ from bit16_groups, and DeepSpeed's own _hp_mapping is then wrong when no
            # alignment padding is used), so the fragments are computed from them directly.
            group_ranks = opt.real_dp_process_group[g]
            lo = torch.distributed.get_rank(group=group_ranks) * opt.partition_size[g]
            hi = lo + flat.numel()
            for p, off in zip(opt.round_robin_bit16_groups[g], opt.round_robin_bit16_offsets[g]):
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a < b:
                    lay.frags.append(Frag(names[p], p, a - off, flat.narrow(0, a - lo, b - a), flat, a - lo))
        lp_views_whole(lay, names)
        return lay

    def refresh(self) -> None:
        self.opt.update_lp_params()     # cast + all-gather of the partitions
        relink(self.opt)

    def refresh_groups(self) -> list:
        return list(self.opt.real_dp_process_group)

    def record_clipping(self, note):
        opt = self.opt

        def unscale_and_clip_grads(original, grad_groups_flat, total_norm, *rest, **kw):
            args = {"norm": kept(total_norm), "clip": float(opt.clip_grad)}
            for g in grad_groups_flat:
                flat = next((f for f in opt.single_partition_of_fp32_groups if f.grad is g), None) \
                    if torch.is_tensor(g) else None
                if flat is not None:
                    note(flat, g, args)
            return original(grad_groups_flat, total_norm, *rest, **kw)
        return self._wrap_clipping(unscale_and_clip_grads)

    def clip_as_recorded(self, grad, args) -> None:
        type(self.opt).unscale_and_clip_grads(self.opt, [grad], args["norm"])   # the class's, not a wrapper
