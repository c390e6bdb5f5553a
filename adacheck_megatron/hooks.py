"""The one post-step point of Megatron training (:mod:`adacheck.checkpoint.hooks`): callables run after
every ``optimizer.step()`` of a megatron-core optimizer.

    from adacheck_megatron.hooks import add_post_step_hook, wrap_optimizer_step
    wrap_optimizer_step(optimizer)          # once, after the optimizer is built
    add_post_step_hook(fn)                  # fn(optimizer, update_successful: bool)

A MegatronOptimizer's or ChainedOptimizer's ``step()`` returns ``(update_successful,
grad_norm, num_zeros_in_grad)``; a skipped step (fp16 loss-scale overflow, NaN grad norm)
runs the hooks with False.  They run before the learning-rate scheduler advances and before
the gradients are zeroed.  Wrap the ChainedOptimizer the training loop calls, not its parts.
Wired in by ``scripts/pretrain_gpt.py`` (``build_optimizer``), and in Megatron-LM's
``setup_model_and_optimizer`` by ``patches/megatron-lm-core_v0.16.1.patch`` or the launcher
``python -m adacheck_megatron.launch``.
"""
from __future__ import annotations

from adacheck.checkpoint.hooks import add_post_step_hook, is_wrapped, post_step_hooks, remove_post_step_hook, wrap_step

__all__ = ["add_post_step_hook", "remove_post_step_hook", "post_step_hooks", "wrap_optimizer_step",
           "is_wrapped"]


def update_successful(result) -> bool:
    """Whether a megatron-core optimizer's step updated the weights (the first of its results)."""
    first = result[0] if isinstance(result, (tuple, list)) and result else result
    return bool(first)


def wrap_optimizer_step(optimizer):
    """Make ``optimizer.step()`` run the post-step hooks after each call; returns ``optimizer``."""
    return wrap_step(optimizer, update_successful)
