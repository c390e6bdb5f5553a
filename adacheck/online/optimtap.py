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
into a group only while stepping (DeepSpeed ZeRO-3's fp32 sub-group flats).  The prefix may
differ per optimizer; ``aliases`` gives, per optimizer, the prefix an earlier version named its
tensors with, so that records written then still replay (:meth:`OptimizerTap.current`).
"""
from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import FormatError, StateError


class OptimizerTap:
    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], prefix: Union[str, Sequence[str]] = "",
                 extra: Optional[Sequence[Sequence[torch.Tensor]]] = None,
                 aliases: Optional[Sequence[Optional[str]]] = None):
        self.optimizers = list(optimizers)
        prefixes = [prefix] * len(self.optimizers) if isinstance(prefix, str) else list(prefix)
        olds = list(aliases) if aliases is not None else [None] * len(self.optimizers)
        if len(prefixes) != len(self.optimizers) or len(olds) != len(self.optimizers):
            raise ValueError("one prefix (and alias) per optimizer")
        self.tensors: Dict[str, torch.Tensor] = {}
        self.aliases: Dict[str, str] = {}     # a key of an earlier version's records -> the key now
        self._key_of: Dict[int, str] = {}
        self.reindex()
        for oi, groups in enumerate(self._groups):
            for gi, g in enumerate(groups):
                for j, p in enumerate(g["params"]):
                    self._name(p, prefixes[oi], olds[oi], f"o{oi}.g{gi}.p{j}")
        for oi, ts in enumerate(extra or []):
            for k, t in enumerate(ts):
                self._name(t, prefixes[oi], olds[oi], f"o{oi}.x{k}")
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

    def _name(self, t: torch.Tensor, prefix: str, old: Optional[str], rest: str) -> None:
        key = prefix + rest
        self._key_of.setdefault(id(t), key)
        self.tensors.setdefault(key, t)
        if old is not None and old != prefix:
            self.aliases[old + rest] = key

    def key_of(self, t: torch.Tensor) -> Optional[str]:
        return self._key_of.get(id(t))

    def current(self, tree: dict) -> Tuple[dict, Dict[str, str]]:
        """A recorded step (``calls``, ``preclip``) with this tap's keys where an earlier version
        recorded it under an alias, and for each key so renamed, the name its gradient is stored
        under."""
        if not self.aliases:
            return tree, {}
        stored: Dict[str, str] = {}

        def name(k: str) -> str:
            new = self.aliases.get(k)
            if new is None:
                return k
            stored[new] = k
            return new
        calls = [[oi, [[gi, hyper, [name(k) for k in keys], [name(k) for k in with_grad]]
                       for gi, hyper, keys, with_grad in groups]] for oi, groups in tree["calls"]]
        preclip = {name(k): v for k, v in (tree.get("preclip") or {}).items()}
        return dict(tree, calls=calls, preclip=preclip), stored

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
    def check_calls(self, calls, what: str, shadow: Optional["Shadow"] = None) -> None:
        """Raise FormatError unless ``calls`` (a recorded step's) is a list of ``[optimizer,
        [[group, hyper-parameters, keys, keys with a gradient], ...]]`` that names this job's
        optimizers, groups and tensors (or ``shadow``'s), with hyper-parameters of the kinds the
        live groups hold (a number where the group has a number, a pair where it has a pair...):
        what replay will do is known to be possible before any of it is done."""
        tensors = self.tensors if shadow is None else shadow.tensors
        if not isinstance(calls, list):
            raise FormatError(f"{what}: calls is not a list")
        for call in calls:
            if not (isinstance(call, list) and len(call) == 2 and _index(call[0], len(self._groups))
                    and isinstance(call[1], list)):
                raise FormatError(f"{what}: optimizer call {str(call)[:80]} is not [optimizer, groups] of this job")
            oi, groups = call
            for group in groups:
                if not (isinstance(group, list) and len(group) == 4 and _index(group[0], len(self._groups[oi]))
                        and isinstance(group[1], dict) and all(isinstance(x, list) for x in group[2:])):
                    raise FormatError(f"{what}: param group {str(group)[:80]} of optimizer {oi} is not "
                                      "[group, hyper-parameters, keys, keys with gradients] of this job")
                gi, hyper, keys, with_grad = group
                if not all(isinstance(k, str) for k in keys + with_grad) or not set(with_grad) <= set(keys):
                    raise FormatError(f"{what}: group {gi} of optimizer {oi} lists malformed tensor keys")
                if any(k not in tensors for k in keys):
                    raise StateError(f"{what} names optimizer tensors this job does not have; it was "
                                     "recorded by a different model or optimizer")
                live = self._groups[oi][gi]
                for name, value in hyper.items():
                    if name == "params" or (name in live and not _same_kind(value, live[name])):
                        raise FormatError(
                            f"{what}: hyper-parameter {name!r} of group {gi} of optimizer {oi} is "
                            f"{type(value).__name__} {str(value)[:40]}, the optimizer holds a "
                            f"{type(live.get(name)).__name__} there; the record is damaged or from another optimizer")

    def grad_keys(self, calls, what: str, shadow: Optional["Shadow"] = None) -> List[str]:
        """Keys of the gradients ``calls`` need (checked against this optimizer set, or against
        the tensors of ``shadow`` that they will step instead)."""
        tensors = self.tensors if shadow is None else shadow.tensors
        out = []
        for oi, groups in calls:
            for gi, _, keys, with_grad in groups:
                if oi >= len(self._groups) or gi >= len(self._groups[oi]) or any(k not in tensors for k in keys):
                    raise StateError(f"{what} names optimizer tensors this job does not have; it was "
                                     "recorded by a different model or optimizer")
                out += with_grad
        return out

    def replay(self, calls, grads: Dict[str, torch.Tensor], shadow: Optional["Shadow"] = None) -> None:
        """Make the recorded ``calls`` again with ``grads`` (key -> gradient); on ``shadow``'s
        copies of the tensors and their optimizer state instead of the real ones if given."""
        self.replaying = True
        try:
            for oi, groups in calls:
                self._replay_call(oi, groups, grads, shadow)
        finally:
            self.replaying = False

    def _replay_call(self, oi, groups, grads, shadow) -> None:
        opt, all_groups = self.optimizers[oi], self._groups[oi]
        tensors = self.tensors if shadow is None else shadow.tensors
        saved_groups, saved_state = opt.param_groups, opt.state
        saved_hyper = [{k: v for k, v in g.items() if k != "params"} for g in all_groups] if shadow else None
        saved_params = [(g, g["params"]) for g in all_groups]
        given = []      # (tensor, the .grad it had): ZeRO-Offload keeps a persistent gradient buffer there
        try:
            active = []
            for gi, hyper, keys, with_grad in groups:
                g = all_groups[gi]
                g.update(hyper)
                g["params"] = [tensors[k] for k in keys]
                for k in with_grad:
                    t = tensors[k]
                    if grads[k].numel() != t.numel():
                        raise StateError(f"gradient {k} has {grads[k].numel()} elements, the tensor {t.numel()}")
                    given.append((t, t.grad))
                    t.grad = grads[k].to(device=t.device).view(t.shape)
                active.append(g)
            opt.param_groups = active
            if shadow is not None:
                opt.state = shadow.state[oi]
            opt.step()
        finally:
            opt.param_groups, opt.state = saved_groups, saved_state
            for t, before in reversed(given):
                t.grad = before
            for g, params in saved_params:
                g["params"] = params
            for g, hyper in zip(all_groups, saved_hyper or []):
                g.update(hyper)     # a shadow step leaves the live hyper-parameters as they are


def _index(i, n: int) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n


def _same_kind(recorded, live) -> bool:
    """A recorded hyper-parameter may stand where the live one does: the same kind of value
    (numbers and one-element tensors are one kind; sequences element by element)."""
    if live is None or isinstance(live, bool):
        return type(recorded) is type(live)
    if isinstance(live, (int, float)) or (torch.is_tensor(live) and live.numel() == 1):
        return (isinstance(recorded, (int, float)) and not isinstance(recorded, bool)) or (
            torch.is_tensor(recorded) and recorded.numel() == 1)
    if isinstance(live, (tuple, list)):
        return (isinstance(recorded, (tuple, list)) and len(recorded) == len(live)
                and all(_same_kind(a, b) for a, b in zip(recorded, live)))
    if torch.is_tensor(live):
        return torch.is_tensor(recorded) and recorded.shape == live.shape
    return type(recorded) is type(live)


class Shadow:
    """A copy of the tensors an :class:`OptimizerTap` steps and of their optimizer state, taken
    when a chain of lossy (compact) deltas starts and stepped by :meth:`OptimizerTap.replay`
    with exactly the gradients the log stores: it is bit for bit the state a recovery will
    reach, so its distance to the live state is the recovery's deviation, measured."""

    def __init__(self, tap: Optional[OptimizerTap]):
        self.tensors: Dict[str, torch.Tensor] = {}
        self.state: List[dict] = []
        if tap is None:
            return
        self.tensors = {k: t.detach().clone() for k, t in tap.tensors.items()}
        for opt in tap.optimizers:
            st = defaultdict(dict)
            for k, t in tap.tensors.items():
                if t in opt.state and opt.state[t]:
                    st[self.tensors[k]] = {n: v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
                                           for n, v in opt.state[t].items()}
            self.state.append(st)

    @classmethod
    def given(cls, tensors: Dict[str, torch.Tensor], state: List[dict]) -> "Shadow":
        """Tensors (key -> tensor) and, per optimizer, their state (tensor -> dict) built by the
        caller: e.g. another rank's partitions, stepped here with that rank's recorded calls."""
        sh = cls(None)
        sh.tensors, sh.state = tensors, state
        return sh

    def deviation(self, tap: OptimizerTap) -> Dict[str, float]:
        """Largest absolute difference from the live tensors ("weights") and from their
        optimizer state ("state"); inf where one side is not finite and the other differs."""
        out = {"weights": 0.0, "state": 0.0}
        for k, t in tap.tensors.items():
            out["weights"] = max(out["weights"], _maxdiff(self.tensors[k], t))
            for oi, opt in enumerate(tap.optimizers):
                live = opt.state.get(t) if t in opt.state else None
                mine = self.state[oi].get(self.tensors[k]) if self.tensors[k] in self.state[oi] else None
                for n in set(live or {}) | set(mine or {}):
                    a, b = (live or {}).get(n), (mine or {}).get(n)
                    if torch.is_tensor(a) and torch.is_tensor(b) and a.numel() == b.numel():
                        out["state"] = max(out["state"], _maxdiff(a, b))
                    elif torch.is_tensor(a) or torch.is_tensor(b) or a != b:
                        out["state"] = math.inf
        return out


_CHUNK = 1 << 18      # elements per piece of a CPU difference (stays in cache: ~4x faster than whole)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in fp32 arithmetic; equal non-finite values count as equal."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1).to(a.device)
    if not a.numel():
        return 0.0
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        a, b = a.float(), b.float()
    if a.is_cuda:
        m = float(torch.sub(a, b).abs_().max())
    else:
        buf, tops = torch.empty(min(_CHUNK, a.numel())), []
        for i in range(0, a.numel(), _CHUNK):
            piece = buf[:min(_CHUNK, a.numel() - i)]
            torch.sub(a[i:i + _CHUNK], b[i:i + _CHUNK], out=piece)
            tops.append(piece.abs_().max())
        m = float(torch.stack(tops).max())
    if math.isfinite(m):
        return m
    d = (a - b).abs()
    d = torch.where((a == b) | (a.isnan() & b.isnan()), torch.zeros_like(d), d)
    m = float(d.max())
    return m if math.isfinite(m) else math.inf
