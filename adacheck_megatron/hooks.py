"""The one post-step point of Megatron training: callables run after every ``optimizer.step()``.

    from adacheck_megatron.hooks import add_post_step_hook, wrap_optimizer_step
    wrap_optimizer_step(optimizer)          # once, after the optimizer is built
    add_post_step_hook(fn)                  # fn(optimizer, update_successful: bool)

``wrap_optimizer_step`` replaces ``optimizer.step`` of a megatron-core optimizer
(MegatronOptimizer or ChainedOptimizer, whose ``step()`` returns ``(update_successful,
grad_norm, num_zeros_in_grad)``) by a wrapper that calls the original step, then every
registered hook with ``(optimizer, update_successful)``, and returns the original result
unchanged.  Every call of ``step`` runs the hooks, a skipped one (fp16 loss-scale overflow,
NaN grad norm) too, with ``False``, so that a hook can count iterations.  The hooks run
where the training loop called ``step``: before the learning-rate scheduler advances and
before the gradients are zeroed for the next iteration.

Wrap the optimizer the training loop calls (a ChainedOptimizer, not its parts: wrapping
both runs the hooks twice).  Wrapping is idempotent: a second call on the same optimizer
changes nothing.  The registry is per process and shared by every wrapped optimizer.

Where it is wired in: ``scripts/pretrain_gpt.py`` (``build_optimizer``), Megatron-LM's
``setup_model_and_optimizer`` through ``patches/megatron-lm-core_v0.16.1.patch`` or the
launcher ``python -m adacheck_megatron.launch``.
"""
from __future__ import annotations

import functools
from typing import Callable, List

__all__ = ["add_post_step_hook", "remove_post_step_hook", "post_step_hooks", "wrap_optimizer_step",
           "is_wrapped"]

PostStepHook = Callable[[object, bool], None]

_HOOKS: List[PostStepHook] = []
_WRAPPED = "_adacheck_post_step_wrapped"   # attribute marking a wrapped optimizer


def add_post_step_hook(fn: PostStepHook) -> PostStepHook:
    """Register ``fn(optimizer, update_successful)``; hooks run in registration order.
    Registering the same callable twice keeps one entry. Returns ``fn`` (usable as a decorator)."""
    if not callable(fn):
        raise TypeError(f"post-step hook must be callable, got {fn!r}")
    if fn not in _HOOKS:
        _HOOKS.append(fn)
    return fn


def remove_post_step_hook(fn: PostStepHook) -> bool:
    """Unregister ``fn``; returns whether it was registered."""
    try:
        _HOOKS.remove(fn)
    except ValueError:
        return False
    return True


def post_step_hooks() -> List[PostStepHook]:
    """A copy of the registered hooks, in the order they run."""
    return list(_HOOKS)


def is_wrapped(optimizer) -> bool:
    return bool(getattr(optimizer, _WRAPPED, False))


def _update_successful(result) -> bool:
    first = result[0] if isinstance(result, (tuple, list)) and result else result
    return bool(first)


def wrap_optimizer_step(optimizer):
    """Make ``optimizer.step()`` run the post-step hooks after each call; returns ``optimizer``."""
    if optimizer is None or is_wrapped(optimizer):
        return optimizer
    original = optimizer.step

    @functools.wraps(original)
    def step(*args, **kwargs):
        result = original(*args, **kwargs)
        ok = _update_successful(result)
        for hook in list(_HOOKS):   # a hook may remove itself
            hook(optimizer, ok)
        return result

    optimizer.step = step
    setattr(optimizer, _WRAPPED, True)
    return optimizer
