"""ZeRO stage 3 (DeepSpeedZeroOptimizer_Stage3): every parameter is partitioned over the
data-parallel ranks; each rank's base optimizer steps fp32 sub-group flats of its own slices,
and the module's weights are partitions too (gathered for each forward)."""
from __future__ import annotations

import contextlib

import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from adacheck.online.recovery import holder

from .base import Frag, Layout, Wrapper, kept, relink


class Zero3(Wrapper):
    name = "zero3"
    flat_partitions = True
    refresh_rebuilds = True
    # a save reads the partitions (fp32 flats, ds_tensor), which DeepSpeed keeps current at every
    # step; the hooks would release the persistent parameters and all-gather them again
    save_hooks = False

    @staticmethod
    def matches(opt) -> bool:
        return isinstance(opt, DeepSpeedZeroOptimizer_Stage3)

    def describe(self, stage, names) -> Layout:
        opt = self.opt
        lay = Layout(stage, self, opt.optimizer, groups=[[names[p] for p in g] for g in opt.fp16_groups])
        for g, group in enumerate(opt.fp16_groups):
            flat = opt.fp32_partitioned_groups_flat[g]
            for p in group:
                _, off, ps = opt.grad_position[opt.get_param_id(p)]
                rank = torch.distributed.get_rank(group=p.ds_process_group)
                start = rank * ps
                valid = max(0, min(p.ds_numel - start, ps))
                if valid:
                    lay.frags.append(Frag(names[p], p, start, flat.narrow(0, off, valid), flat, off))
        for p, n in names.items():
            rank = torch.distributed.get_rank(group=p.ds_process_group)
            ps = p.ds_tensor.ds_numel
            start = min(rank * ps, p.ds_numel)   # trailing ranks may hold only padding
            valid = max(0, min(p.ds_numel - start, ps))
            lay.lp_views[n] = (start, p.ds_tensor.data.view(-1).narrow(0, 0, valid))
        return lay

    def model_replicated(self, name, tp_copy) -> bool:
        return name in tp_copy      # the module's weights are partitioned too

    def tap_tensors(self) -> list:
        return list(getattr(self.opt, "fp32_partitioned_groups_flat", None) or [])

    @contextlib.contextmanager
    def stepping(self):
        # ZeRO-3 lists its fp32 partitions in the base optimizer's groups only around step()
        self.opt._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            self.opt._clear_fp32_optimizer_param_groups()

    def refresh(self) -> None:
        # the checkpoint event's prologue partitioned every parameter; its epilogue all-gathers
        # the persistent ones (small parameters stay gathered between steps) from the partitions
        # cast here (once: on gloo each of their 0.3-1 ms gathers counts)
        opt = self.opt
        for i in range(len(opt.fp32_partitioned_groups_flat)):
            opt._reassign_or_swap_out_partitioned_parameters(i)
        relink(opt)

    def record_clipping(self, note):
        opt = self.opt

        def unscale_and_clip_grads(original, sub_group_id, total_norm, *rest, **kw):
            flat = opt.fp32_partitioned_groups_flat[sub_group_id]
            if flat.grad is not None:
                note(flat, flat.grad, {"norm": kept(total_norm), "clip": float(opt.clip_grad),
                                       "sub": int(sub_group_id)})
            return original(sub_group_id, total_norm, *rest, **kw)
        return self._wrap_clipping(unscale_and_clip_grads)

    def clip_as_recorded(self, grad, args) -> None:
        # ZeRO-3 scales the .grad of its fp32 sub-group flat number ``sub``: let that be a
        # stand-in holding ``grad`` (a saving rank's partition may have another size than ours)
        opt, sub = self.opt, args["sub"]
        flats = opt.fp32_partitioned_groups_flat
        opt.fp32_partitioned_groups_flat = list(flats) + [None] * (sub + 1 - len(flats))
        opt.fp32_partitioned_groups_flat[sub] = holder(grad)
        try:
            type(opt).unscale_and_clip_grads(opt, sub, args["norm"])
        finally:
            opt.fp32_partitioned_groups_flat = flats
