"""AdaCheck for Megatron (megatron-core and Megatron-LM training scripts).

- ``flags``: the ``--adacheck*`` command-line flags, generated from the one config object so
  every key of the DeepSpeed block has the same name here (kebab-case);
- ``checkpointing``: ``save_checkpoint`` / ``load_checkpoint`` with Megatron-LM's contract,
  writing and reading AdaCheck checkpoints of megatron-core models and optimizers;
- ``state``: megatron-core sharded state dicts <-> AdaCheck shards;
- ``cpu``: runs megatron-core on CPU with gloo (device redirection) for tests and demos.

``checkpointing`` imports megatron-core; the flags do not.
"""
from adacheck.compat import warn_if_untested
from adacheck.lifecycle import finish_saves as finalize_async_saves

from .flags import add_adacheck_args, config_from_args

warn_if_untested("megatron-core")

# finalize_async_saves(block=True): AdaCheck's counterpart of Megatron-LM's
# maybe_finalize_async_save, for training loops that are not Megatron-LM's
__all__ = ["add_adacheck_args", "config_from_args", "save_checkpoint", "load_checkpoint", "finalize_async_saves"]


def __getattr__(name):
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpointing
        return getattr(checkpointing, name)
    raise AttributeError(name)
