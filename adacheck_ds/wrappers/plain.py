"""A plain torch optimizer (ZeRO-0 without a wrapper, or no optimizer): it steps the module's
own parameters, on every data-parallel rank alike."""
from __future__ import annotations

import torch

from adacheck.errors import StateError

from .base import Frag, Layout, Wrapper, lp_views_whole


class Plain(Wrapper):
    name = "plain"
    replicated = True
    has_master = False

    @staticmethod
    def matches(opt) -> bool:
        return True      # the last kind tried

    def describe(self, stage, names) -> Layout:
        opt = self.opt
        base = getattr(opt, "optimizer", opt) if opt is not None else None
        if base is not None and not isinstance(base, torch.optim.Optimizer):
            raise StateError(f"AdaCheck does not know the optimizer wrapper {type(opt).__name__} "
                             "(supported: ZeRO 1/2/3, DeepSpeed's BF16_Optimizer, FP16_Optimizer, "
                             "FP16_UnfusedOptimizer, a plain torch optimizer)")
        if opt is not None and opt is not base and any(p.dtype != torch.float32 for p in names):
            raise StateError(f"{type(opt).__name__} keeps fp32 master weights in a layout AdaCheck does "
                             "not know; supported without ZeRO: a plain torch optimizer, "
                             "FP16_Optimizer and FP16_UnfusedOptimizer (use ZeRO stage 1-3 otherwise)")
        lay = Layout(stage, self, base, groups=[[names[p] for p in g["params"] if p in names]
                                                for g in base.param_groups] if base else [])
        lp_views_whole(lay, names)
        if base is not None:
            in_opt = {id(p) for g in base.param_groups for p in g["params"]}
            for p, n in names.items():
                if id(p) in in_opt:
                    lay.frags.append(Frag(n, p, 0, p.data.view(-1), p, 0))
        return lay

    def optim_replicated(self, name, tp_copy) -> bool:
        return True      # every data-parallel rank holds the whole state
