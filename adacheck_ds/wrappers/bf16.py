"""DeepSpeed's BF16_Optimizer (ZeRO-1 with bf16 and fp32 gradient accumulation): one flat fp32
partition per param group on each data-parallel rank, mapped by DeepSpeed's ``_hp_mapping``."""
from __future__ import annotations

import torch
from deepspeed.runtime import bf16_optimizer

from .base import Frag, Layout, Wrapper, kept, lp_views_whole, relink


class BF16(Wrapper):
    name = "bf16opt"
    flat_partitions = True
    refresh_rebuilds = True

    @staticmethod
    def matches(opt) -> bool:
        return isinstance(opt, bf16_optimizer.BF16_Optimizer)

    def describe(self, stage, names) -> Layout:
        opt = self.opt
        lay = Layout(stage, self, opt.optimizer, groups=[[names[p] for p in g] for g in opt.bf16_groups])
        for g, group in enumerate(opt.bf16_groups):
            for p in group:
                m = getattr(p, "_hp_mapping", None)
                if m is not None:
                    lay.frags.append(Frag(names[p], p, m.lp_fragment_address.start, m.hp_fragment.view(-1),
                                          opt.fp32_groups_flat_partition[g], m.hp_fragment_address.start))
        lp_views_whole(lay, names)
        return lay

    def refresh(self) -> None:
        self.opt.update_lp_params()
        relink(self.opt)

    def refresh_groups(self) -> list:
        return list(self.opt.real_dp_process_group)

    def record_clipping(self, note):
        opt = self.opt
        if not all(g.dtype == torch.float32 for g in opt.fp32_groups_gradient_flat_partition):
            return None

        # BF16_Optimizer clips its fp32 gradient partitions in place right after asking for
        # them with for_clipping=True: record them before that (exact bf16 sums, 2 bytes each)
        def get_grads_for_norm(original, for_clipping=False, *a, **kw):
            out = original(for_clipping, *a, **kw)
            if for_clipping and opt.clip_grad > 0:
                args = {"norm": kept(opt._global_grad_norm), "clip": float(opt.clip_grad), "bf16_clip": True}
                for flat, grad in zip(opt.fp32_groups_flat_partition, opt.fp32_groups_gradient_flat_partition):
                    note(flat, grad, args)
            return out
        return self._wrap("get_grads_for_norm", get_grads_for_norm)

    def clip_as_recorded(self, grad, args) -> None:
        # the function BF16_Optimizer.step calls
        bf16_optimizer.clip_tensors_by_global_norm(input_tensors=[grad], max_norm=self.opt.clip_grad,
                                                   global_norm=args["norm"], mpu=self.opt.mpu)
