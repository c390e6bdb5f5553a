"""DeepSpeed's FP16_UnfusedOptimizer (ZeRO-0 with fp16 / bf16 and an optimizer it does not
fuse): fp32 master copies of every parameter, on every data-parallel rank alike."""
from __future__ import annotations

from .base import Frag, Layout, Wrapper, kept, lp_views_whole, relink


class FP16Unfused(Wrapper):
    name = "fp16unfused"
    replicated = True

    @staticmethod
    def matches(opt) -> bool:
        return opt is not None and type(opt).__name__ == "FP16_UnfusedOptimizer"

    def describe(self, stage, names) -> Layout:
        opt = self.opt
        lay = Layout(stage, self, opt.optimizer, groups=[[names[p] for p in g] for g in opt.fp16_groups])
        for lps, masters in zip(opt.fp16_groups, opt.fp32_groups):
            for p, m in zip(lps, masters):
                lay.frags.append(Frag(names[p], p, 0, m.data.view(-1), m, 0))
        lp_views_whole(lay, names)
        return lay

    def refresh(self) -> None:
        for lps, masters in zip(self.opt.fp16_groups, self.opt.fp32_groups):
            for p, m in zip(lps, masters):
                p.data.copy_(m.data)
        relink(self.opt)

    def record_clipping(self, note):
        opt = self.opt

        def unscale_and_clip_grads(original, total_norm, apply_scale=True):
            # scales every fp32 gradient by one factor for that norm
            if apply_scale:
                args = {"norm": kept(total_norm), "clip": float(opt.clip_grad), "unfused": True}
                for group in opt.fp32_groups:
                    for p in group:
                        if p.grad is not None:
                            note(p, p.grad, args)
            return original(total_norm, apply_scale=apply_scale)
        return self._wrap_clipping(unscale_and_clip_grads)

    def clip_as_recorded(self, grad, args) -> None:
        combined = type(self.opt).unscale_and_clip_grads(self.opt, args["norm"], apply_scale=False)
        grad.mul_(1. / combined)
