"""Record and replay the ``step()`` calls of torch optimizers (the heart of the online mode).

A framework's optimizer wrapper (DeepSpeed ZeRO, Megatron's mixed-precision and distributed
optimizers) eventually calls ``step()`` of plain torch optimizers on fp32 tensors.  Each
such call is fully described by: which param groups were active, their hyper-parameters
at that moment, which tensors were in them, and the gradients those tensors carried.  A
step pre-hook (``register_step_pre_hook``, a public torch API) records exactly that;
``replay`` makes the same call again with the same inputs, so the arithmetic (and the
result, bit for bit) is the optimizer's own.

Tensors get stable keys ``<prefix>o<optimizer>.g<group>.p<index>`` from the param groups at
start-up, and ``<prefix>o<optimizer>.x<index>`` for ``extra`` tensors that a wrapper puts
into a group only while stepping (DeepSpeed ZeRO-3's fp32 sub-group flats).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .errors import StateError


class OptimizerTap:
    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], prefix: str = "",
                 extra: Optional[Sequence[Sequence[torch.Tensor]]] = None):
        self.optimizers = list(optimizers)
        self.tensors: Dict[str, torch.Tensor] = {}
        self._key_of: Dict[int, str] = {}
        self.reindex()
        for oi, groups in enumerate(self._groups):
            for gi, g in enumerate(groups):
                for j, p in enumerate(g["params"]):
                    self._name(p, f"{prefix}o{oi}.g{gi}.p{j}")
        for oi, ts in enumerate(extra or []):
            for k, t in enumerate(ts):
                self._name(t, f"{prefix}o{oi}.x{k}")
        self.calls: List[list] = []
        self.replaying = False
        self.on_grad: Optional[Callable[[str, torch.Tensor], None]] = None   # called with each gradient
        self.on_first_call: Optional[Callable[[], None]] = None              # before the first call of a step
        self.step_seconds = 0.0          # time spent inside the optimizers' step() (for the "auto" rule)
        self._t0: Optional[float] = None
        self._handles = []
        for oi, opt in enumerate(self.optimizers):
            self._handles.append(opt.register_step_pre_hook(self._pre_hook(oi)))
            self._handles.append(opt.register_step_post_hook(self._post_hook))

    def _name(self, t: torch.Tensor, key: str) -> None:
        self._key_of.setdefault(id(t), key)
        self.tensors.setdefault(key, t)

    def reindex(self) -> None:
        """Know the param-group dicts again (``Optimizer.load_state_dict`` replaces them)."""
        self._groups = [list(o.param_groups) for o in self.optimizers]
        self._group_index = [{id(g): i for i, g in enumerate(gs)} for gs in self._groups]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ recording
    def _pre_hook(self, oi: int):
        def hook(opt, args, kwargs):
            if self.replaying:
                return
            if not self.calls and self.on_first_call is not None:
                self.on_first_call()
            self._t0 = time.perf_counter()
            groups = []
            for g in opt.param_groups:
                gi = self._group_index[oi].get(id(g))
                if gi is None:
                    raise StateError("AdaCheck online: an optimizer stepped a param group it did not have "
                                     "at start-up; the online mode cannot follow that")
                keys, with_grad = [], []
                for p in g["params"]:
                    k = self._key_of.get(id(p))
                    if k is None:
                        raise StateError("AdaCheck online: an optimizer stepped a tensor unknown at start-up")
                    keys.append(k)
                    if p.grad is not None:
                        with_grad.append(k)
                        if self.on_grad is not None:
                            self.on_grad(k, p.grad)
                groups.append([gi, {k: v for k, v in g.items() if k != "params"}, keys, with_grad])
            self.calls.append([oi, groups])
        return hook

    def _post_hook(self, opt, args, kwargs):
        if not self.replaying and self._t0 is not None:
            self.step_seconds += time.perf_counter() - self._t0
            self._t0 = None

    def take_calls(self) -> List[list]:
        calls, self.calls = self.calls, []
        return calls

    def group_state(self) -> List[List[dict]]:
        """Every group's hyper-parameters now (after the step and the scheduler)."""
        return [[{k: v for k, v in g.items() if k != "params"} for g in gs] for gs in self._groups]

    def set_group_state(self, saved: List[List[dict]]) -> None:
        for gs, sv in zip(self._groups, saved):
            for g, s in zip(gs, sv):
                g.update(s)

    # ------------------------------------------------------------------ replay
    def grad_keys(self, calls, what: str) -> List[str]:
        """Keys of the gradients ``calls`` need (checked against this optimizer set)."""
        out = []
        for oi, groups in calls:
            for gi, _, keys, with_grad in groups:
                if oi >= len(self._groups) or gi >= len(self._groups[oi]) or any(k not in self.tensors for k in keys):
                    raise StateError(f"{what} names optimizer tensors this job does not have; it was "
                                     "recorded by a different model or optimizer")
                out += with_grad
        return out

    def replay(self, calls, grads: Dict[str, torch.Tensor]) -> None:
        """Make the recorded ``calls`` again with ``grads`` (key -> gradient)."""
        self.replaying = True
        try:
            for oi, groups in calls:
                self._replay_call(self.optimizers[oi], self._groups[oi], groups, grads)
        finally:
            self.replaying = False

    def _replay_call(self, opt, all_groups, groups, grads) -> None:
        saved_groups = opt.param_groups
        saved_params = [(g, g["params"]) for g in all_groups]
        try:
            active = []
            for gi, hyper, keys, with_grad in groups:
                g = all_groups[gi]
                g.update(hyper)
                g["params"] = [self.tensors[k] for k in keys]
                for k in with_grad:
                    t = self.tensors[k]
                    if grads[k].numel() != t.numel():
                        raise StateError(f"gradient {k} has {grads[k].numel()} elements, the tensor {t.numel()}")
                    t.grad = grads[k].to(device=t.device).view(t.shape)
                active.append(g)
            opt.param_groups = active
            opt.step()
        finally:
            opt.param_groups = saved_groups
            for g, params in saved_params:
                for p in g["params"]:
                    p.grad = None
                g["params"] = params
