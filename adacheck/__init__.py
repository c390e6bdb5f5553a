"""AdaCheck core: framework-free checkpoint format, planning, commit and reading.

The names below are imported on first use (``from adacheck import save``), so that importing
the package, and ``adacheck --help``, do not import torch."""
import importlib

from .compat import warn_if_untested
from .errors import (AdaCheckError, ConfigError, DistributedError, FormatError, IntegrityError,
                     NotFoundError, StateError, TagMismatchError)

__version__ = "0.1.0"
__all__ = ["AdaCheckConfig", "AdaCheckError", "Box", "CheckpointReader", "Checkpointer", "ConfigError",
           "DistributedError", "FormatError", "IntegrityError", "Kind", "LoadResult", "LocalShard", "LocalState",
           "NotFoundError", "Options", "Restore", "StateError", "TagMismatchError", "load", "save"]

_LAZY = {"CheckpointReader": "checkpoint", "Checkpointer": "checkpoint", "LoadResult": "checkpoint",
         "Options": "checkpoint", "load": "checkpoint", "save": "checkpoint", "Kind": "integration",
         "LocalShard": "integration", "LocalState": "integration", "Restore": "integration",
         "AdaCheckConfig": "config", "Box": "types"}

# torch has no upper bound in the requirements (a user's CUDA torch stays): a minor version the
# tests did not run with is named here, once per process, for the core, the CLI and both
# integrations (they import this package). Reads torch's metadata; does not import torch.
warn_if_untested("torch")


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'adacheck' has no attribute {name!r}")
