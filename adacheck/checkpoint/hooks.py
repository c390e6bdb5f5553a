"""A post-step point: callables run after every ``step()`` of a wrapped optimizer.

    from adacheck.checkpoint.hooks import add_post_step_hook, wrap_step
    wrap_step(optimizer, ok_of)             # once, after the optimizer is built
    add_post_step_hook(fn)                  # fn(optimizer, update_successful: bool)

``wrap_step`` replaces ``optimizer.step`` by a wrapper that calls the original step, then
every registered hook with ``(optimizer, ok_of(result))``, and returns the original result
unchanged.  Every call of ``step`` runs the hooks, a skipped one too (``ok_of`` says False),
so that a hook can count iterations; the hooks run where the training loop called ``step``.
Wrap the optimizer the training loop calls, not its parts (wrapping both runs the hooks
twice).  Wrapping is idempotent: a second call on the same optimizer changes nothing.  The
registry is per process and shared by every wrapped optimizer.  An integration says what a
step's result means (``adacheck_megatron.hooks``: megatron-core's ``(update_successful, ...)``).
"""
from __future__ import annotations

import functools
from typing import Callable, List

__all__ = ["add_post_step_hook", "remove_post_step_hook", "post_step_hooks", "wrap_step", "is_wrapped"]

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


def wrap_step(optimizer, ok_of: Callable[[object], bool]):
    """Make ``optimizer.step()`` run the post-step hooks after each call, with whether it
    updated (``ok_of(its result)``); returns ``optimizer``."""
    if optimizer is None or is_wrapped(optimizer):
        return optimizer
    original = optimizer.step

    @functools.wraps(original)
    def step(*args, **kwargs):
        result = original(*args, **kwargs)
        ok = ok_of(result)
        for hook in list(_HOOKS):   # a hook may remove itself
            hook(optimizer, ok)
        return result

    optimizer.step = step
    setattr(optimizer, _WRAPPED, True)
    return optimizer
