"""AdaCheck core: framework-free checkpoint format, planning, commit and reading."""
from .checkpoint import CheckpointReader, LocalShard, LocalState, load, save
from .config import AdaCheckConfig
from .errors import (AdaCheckError, ConfigError, DistributedError, FormatError, IntegrityError,
                     NotFoundError, StateError)
from .types import Box

__version__ = "0.1.0"
__all__ = ["AdaCheckConfig", "AdaCheckError", "Box", "CheckpointReader", "ConfigError",
           "DistributedError", "FormatError", "IntegrityError", "LocalShard", "LocalState",
           "NotFoundError", "StateError", "load", "save"]
