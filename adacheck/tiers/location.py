"""Where a job's memory tier lives on a node: its root (``$ADACHECK_MEMORY_DIR``, the config, or
/dev/shm/adacheck), one location per checkpoint directory, the spare delta files, and the names
of the marker files kept there."""
from __future__ import annotations

import hashlib
import os
import re
from typing import Optional

from ..errors import ConfigError
from ..storage.backends import LOCAL, Storage
from ..storage.lease import JOB_ENV, named_job

DEFAULT_MEMORY_DIR = "/dev/shm/adacheck"


MEMORY_ENV = "ADACHECK_MEMORY_DIR"


PERSIST_TIMEOUT_S = 600.0


SOURCE_NAME = "SOURCE"          # in a memory location: the checkpoint directory it stands for


CHAIN_COPIED = ".deltas-persisted-rank"     # in a memory checkpoint: this rank's deltas are in durable storage


def memory_root(configured: Optional[str]) -> str:
    return os.environ.get(MEMORY_ENV) or configured or DEFAULT_MEMORY_DIR


def durable_key(store: Storage, save_dir: str) -> str:
    """The checkpoint directory ``save_dir`` on ``store``, as one string (kept in SOURCE_NAME)."""
    return f"{store.describe()}|{store.canonical(save_dir)}"


DELTA_FILE = re.compile(r"^rank\d+\.safetensors$")


SPARES = ".spare-deltas"        # in a job's memory directory: delta files of retired chains, to write over


def spares_of(mem: str) -> str:
    """The directory of spare delta files (:class:`~adacheck.storage.direct.SpareFiles`) of the memory
    directory ``mem``."""
    return os.path.join(mem, SPARES)


def memory_location(store: Storage, save_dir: str, memory_dir: Optional[str] = None) -> str:
    """Where this job's memory tier keeps the checkpoints of ``save_dir`` (on ``store``)."""
    job, _ = named_job()
    if job is None:
        raise ConfigError(f"the memory tier keeps a job's checkpoints under the job's identity, and this job has "
                          f"none: set ${JOB_ENV} (the same value for a restarted job) or start it with torchrun")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job)[:100] or "_"
    key = hashlib.sha256(durable_key(store, save_dir).encode()).hexdigest()[:16]
    return os.path.join(memory_root(memory_dir), safe, key)


def remove_job_memory(mem: str) -> None:
    """The memory directory ``mem`` of one checkpoint directory goes, and the job's directory
    above it once that is empty."""
    LOCAL.remove_tree(mem)
    try:
        LOCAL.remove_dir(os.path.dirname(mem))
    except OSError:
        pass        # the interpreter may be exiting: the empty directory stays
