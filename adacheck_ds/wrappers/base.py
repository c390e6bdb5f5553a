"""What every kind of DeepSpeed optimizer wrapper provides (:class:`Wrapper`), and the layout it
describes (:class:`Layout`: which fragments of which parameters this rank's optimizer holds).

``engine.optimizer`` is a *wrapper* (ZeRO-1/2, ZeRO-3, the BF16 optimizer, the fp16 unfused
optimizer, or a plain torch optimizer) around the *base optimizer*, the torch optimizer that
turns gradients into new master weights and moments.  A wrapper kind says where the master
weights and optimizer state of each parameter live on this rank (:meth:`Wrapper.describe`), how
the module's low-precision weights are made from them again (:meth:`Wrapper.refresh`), and how
it clips gradients (recorded by the online mode before it does, applied again on replay).
Adding a kind is one new module in this package, listed in ``KINDS``.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Dict, List, Optional, Tuple

import torch

from adacheck.types import Box

# the online mode's note of a gradient about to be clipped in place: (the tensor the base
# optimizer steps, its gradient now, the arguments to clip it again on replay)
Note = Callable[[torch.Tensor, torch.Tensor, dict], None]


@dataclass
class Frag:
    """What this rank holds of one parameter's master weights / optimizer state."""

    name: str
    param: torch.nn.Parameter
    start: int                       # flat offset in the parameter
    master: torch.Tensor             # 1-D fp32 view of [start, start+numel)
    base_param: torch.Tensor         # the tensor the base optimizer steps (flat partition or param)
    offset: int                      # where ``master`` starts inside ``base_param`` (flattened)

    @property
    def numel(self) -> int:
        return self.master.numel()


@dataclass
class Layout:
    """Where this rank's part of every parameter lives in one engine."""
    stage: int                      # the ZeRO stage
    wrapper: "Wrapper"
    base_optimizer: Optional[torch.optim.Optimizer]
    frags: List[Frag] = field(default_factory=list)
    lp_views: Dict[str, tuple] = field(default_factory=dict)   # name -> (start, 1-D view of module data)
    groups: List[List[str]] = field(default_factory=list)   # parameter names per optimizer group, in
    # the order DeepSpeed was given them (what a DeepSpeed engine of another layout is built from)
    trained: set = field(init=False)   # names of the parameters the optimizer updates (any rank)
    origin: Dict[str, Tuple[tuple, Box]] = field(default_factory=dict)   # name -> (logical shape,
    # the box of the logical tensor this rank's parameter is: all of it without tensor parallelism)
    tp: Tuple[int, int] = (0, 1)    # tensor-parallel rank, size
    split: Dict[str, int] = field(default_factory=dict)   # tensor-parallel parameters: partition dim

    def __post_init__(self):
        self.trained = {n for g in self.groups for n in g}


def kept(norm):
    """A gradient norm as recorded with a step (a copy: DeepSpeed may reuse the tensor)."""
    return norm.detach().clone() if torch.is_tensor(norm) else norm


class Wrapper:
    """One kind of optimizer wrapper, bound to one engine (``self.engine``, ``self.opt``: its
    ``engine.optimizer``)."""

    #: the kind as checkpoints record it (``framework.optimizer``); never renamed
    name: ClassVar[str]
    #: every data-parallel rank applies the same full gradients to a full copy of the state
    #: (its deltas replay on any data-parallel size, following one saving rank's record)
    replicated: ClassVar[bool] = False
    #: the base optimizer steps flat partitions, one set per data-parallel rank (its deltas
    #: replay on another data-parallel size by rebuilding the saving ranks' partitions)
    flat_partitions: ClassVar[bool] = False
    #: the optimizer keeps fp32 master weights apart from the module's weights
    has_master: ClassVar[bool] = True
    #: :meth:`refresh` makes this rank's module weights from the master weights it holds, exactly
    #: their cast (ZeRO-1/2: cast + all-gather of the partitions; ZeRO-3: each rank's partition):
    #: a load then reads no module weights, only its master partition, unless the all-gather would
    #: go through gloo's sockets (adacheck_ds.state._refreshed)
    refresh_rebuilds: ClassVar[bool] = False
    #: a save runs between the optimizer's checkpoint_event_prologue / _epilogue, where it has them
    save_hooks: ClassVar[bool] = True

    def __init__(self, engine):
        self.engine, self.opt = engine, engine.optimizer

    @staticmethod
    def matches(opt) -> bool:
        """``opt`` (an ``engine.optimizer``) is this kind."""
        raise NotImplementedError

    def describe(self, stage: int, names: Dict[torch.nn.Parameter, str]) -> Layout:
        """This rank's fragments of every parameter (``names``: parameter -> its module name)."""
        raise NotImplementedError

    def model_replicated(self, name: str, tp_copy: set) -> bool:
        """The layout puts the same box of module weight ``name`` on other ranks too
        (``tp_copy``: the parameters every tensor-parallel rank holds whole)."""
        return True

    def optim_replicated(self, name: str, tp_copy: set) -> bool:
        """The same, for the master weights and optimizer state of ``name``."""
        return name in tp_copy

    def tap_tensors(self) -> list:
        """Tensors the base optimizer steps that are not in its param groups between steps."""
        return []

    def stepping(self):
        """A context in which the base optimizer's param groups list what it steps."""
        return contextlib.nullcontext()

    def refresh(self) -> None:
        """The module's weights from the master weights, with DeepSpeed's own code (after a
        load or a replay changed the master weights), within :func:`checkpoint_event`."""

    def refresh_groups(self) -> list:
        """The process groups over which :meth:`refresh` all-gathers the module weights (none
        where it only casts this rank's own)."""
        return []

    def record_clipping(self, note: Note) -> Optional[Callable[[], None]]:
        """Make the wrapper call ``note`` for each gradient just before it unscales / clips it
        in place (the online mode records it as it was: exact where the clipped one is not);
        returns the function that takes this back, or None where nothing is recorded."""
        return None

    def clip_as_recorded(self, grad: torch.Tensor, args: dict) -> None:
        """Unscale / clip ``grad`` in place as the wrapper did while recording (``args``: what
        ``note`` was given), with the wrapper's own code."""
        raise NotImplementedError(f"{self.name} records no clipping")

    def preclip(self, key: str, grad: torch.Tensor, args: dict) -> None:
        """Replay of a recorded pre-clip gradient (of the tensor ``key``, as
        :meth:`adacheck.online.recovery.Replaying.preclip`): :meth:`clip_as_recorded` with the recorded
        ``gradient_clipping`` (a job resumed with another value replays the recorded steps)."""
        current = self.opt.clip_grad
        self.opt.clip_grad = args.get("clip", current)     # records of earlier versions: the engine's value
        if torch.is_tensor(args["norm"]):
            args = dict(args, norm=args["norm"].to(grad.device))
        try:
            self.clip_as_recorded(grad, args)
        finally:
            self.opt.clip_grad = current

    def _wrap_clipping(self, replacement: Callable) -> Optional[Callable[[], None]]:
        """Replace the optimizer's ``unscale_and_clip_grads`` (:meth:`_wrap`); not with fp16, whose
        dynamic loss scale is not replayable (the clipped gradients are recorded instead)."""
        return None if self.engine.fp16_enabled() else self._wrap("unscale_and_clip_grads", replacement)

    def _wrap(self, method: str, replacement: Callable) -> Callable[[], None]:
        """Make the optimizer's ``method`` call ``replacement(original, *args, **kwargs)``, where
        ``original`` is the method it had; returns the function that puts that back."""
        original = getattr(self.opt, method)
        setattr(self.opt, method, functools.partial(replacement, original))
        return lambda: setattr(self.opt, method, original)


@contextlib.contextmanager
def checkpoint_event(optimizer):
    """DeepSpeed's optimizer hooks around reading or writing its state (ZeRO's and the BF16
    optimizer's checkpoint_event_prologue / _epilogue, where they have them)."""
    if hasattr(optimizer, "checkpoint_event_prologue"):
        optimizer.checkpoint_event_prologue()
    try:
        yield
    finally:
        if hasattr(optimizer, "checkpoint_event_epilogue"):
            optimizer.checkpoint_event_epilogue()


def lp_views_whole(lay: Layout, names: Dict[torch.nn.Parameter, str]) -> None:
    """Every parameter's module weights as one flat view (every kind but ZeRO-3)."""
    for p, n in names.items():
        lay.lp_views[n] = (0, p.data.view(-1))


def relink(opt) -> None:
    """DeepSpeed keeps views into the optimizer state per parameter fragment
    (safe_get_full_optimizer_state, universal checkpoints): link them again after the state's
    tensors were replaced."""
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
