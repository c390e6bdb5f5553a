"""DeepSpeed's FP16_Optimizer (ZeRO-0 with fp16, or bf16 with bf16 gradient accumulation, and an
optimizer it fuses: DeepSpeed's FusedAdam, the config's "Adam"): one flat fp32 master per param
group, on every data-parallel rank alike.  The module's weights are views into one flat
low-precision buffer per group, in the group's order, without padding; the master is its copy."""
from __future__ import annotations

from torch._utils import _unflatten_dense_tensors
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

from .base import Frag, Layout, Wrapper, kept, lp_views_whole, relink


class FP16Fused(Wrapper):
    name = "fp16fused"
    replicated = True

    @staticmethod
    def matches(opt) -> bool:
        return isinstance(opt, FP16_Optimizer)

    def describe(self, stage, names) -> Layout:
        opt = self.opt
        lay = Layout(stage, self, opt.optimizer, groups=[[names[p] for p in g] for g in opt.fp16_groups])
        for lps, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            offset = 0          # _flatten_dense_tensors: the group's parameters back to back
            for p in lps:
                lay.frags.append(Frag(names[p], p, 0, flat.data.narrow(0, offset, p.numel()), flat, offset))
                offset += p.numel()
        lp_views_whole(lay, names)
        return lay

    def refresh(self) -> None:
        # what FP16_Optimizer.step does after the base optimizer's step
        opt = self.opt
        for lps, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            for p, q in zip(lps, _unflatten_dense_tensors(flat, lps)):
                p.data.copy_(q.data)
        relink(opt)

    def record_clipping(self, note):
        opt = self.opt

        def unscale_and_clip_grads(original, grad_groups_flat, total_norm, apply_scale=True):
            # step() hands the flat gradient of each group (fp32_groups_flat[i].grad) to be
            # scaled in place by one factor for that norm
            if apply_scale:
                args = {"norm": kept(total_norm), "clip": float(opt.clip_grad)}
                for flat in opt.fp32_groups_flat:
                    if any(flat.grad is g for g in grad_groups_flat):
                        note(flat, flat.grad, args)
            return original(grad_groups_flat, total_norm, apply_scale=apply_scale)
        return self._wrap_clipping(unscale_and_clip_grads)

    def clip_as_recorded(self, grad, args) -> None:
        type(self.opt).unscale_and_clip_grads(self.opt, [grad], args["norm"])   # the class's, not a wrapper
