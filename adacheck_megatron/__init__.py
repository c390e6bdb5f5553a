"""AdaCheck for Megatron (megatron-core and Megatron-LM training scripts).

- ``flags``: the ``--adacheck*`` command-line flags, generated from the one config object so
  every key of the DeepSpeed block has the same name here (kebab-case);
- ``checkpointing``: ``save_checkpoint`` / ``load_checkpoint`` with Megatron-LM's contract,
  writing and reading AdaCheck checkpoints of megatron-core models and optimizers;
- ``state``: megatron-core sharded state dicts <-> AdaCheck shards;
- ``cpu``: runs megatron-core on CPU with gloo (device redirection) for tests and demos.

``checkpointing`` imports megatron-core; the flags do not.
"""
import ast
import importlib.util
import os
import warnings
from typing import Optional

from adacheck.compat import UntestedVersionWarning, untested
from adacheck.checkpoint.lifecycle import finish_saves as finalize_async_saves

from .flags import add_adacheck_args, config_from_args


def package_info_version(megatron_dir: str) -> Optional[str]:
    """megatron-core's version from ``megatron_dir/core/package_info.py`` read as text (nothing
    is imported); None when it is missing or has no integer MAJOR, MINOR and PATCH."""
    try:
        with open(os.path.join(megatron_dir, "core", "package_info.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    parts = {t.id: node.value.value for node in tree.body
             if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
             for t in node.targets if isinstance(t, ast.Name)}
    if not all(isinstance(parts.get(k), int) for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE') or ''}"


def megatron_core_version() -> Optional[str]:
    """The version of the megatron-core that ``import megatron.core`` would import, from its
    package_info.py (:func:`package_info_version`): a Megatron-LM tree on PYTHONPATH has no pip
    metadata, or shadows an installed megatron-core of another version. None when no
    megatron/core is found."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(folder, "core", "__init__.py")):
            return package_info_version(folder)   # the first portion with a core is imported
    return None


def _warn_if_untested() -> None:
    text = untested("megatron-core", megatron_core_version())   # None: the installed metadata
    if text is not None:
        warnings.warn(text, UntestedVersionWarning, stacklevel=3)


_warn_if_untested()

# finalize_async_saves(block=True): AdaCheck's counterpart of Megatron-LM's
# maybe_finalize_async_save, for training loops that are not Megatron-LM's
__all__ = ["add_adacheck_args", "config_from_args", "save_checkpoint", "load_checkpoint", "finalize_async_saves"]


def __getattr__(name):
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpointing
        return getattr(checkpointing, name)
    raise AttributeError(name)
