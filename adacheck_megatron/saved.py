"""What a Megatron checkpoint keeps besides its tensors, as typed records (adacheck.format.records):
the job's objects (saved once per checkpoint), each saving rank's objects, and the scalars of
one online step.  checkpointing.py, online.py and convert.py write them; checkpointing.py,
replay.py and convert.py read them, all through these classes."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from adacheck.format.records import Record, entry, is_int, is_number, of_kind, optional


@dataclass
class Objects(Record):
    """A checkpoint's objects."""
    common: dict = entry(of_kind(dict), "the common (not sharded) state dict (an object)")
    iteration: int = entry(is_int, "an integer")
    opt_param_scheduler: Optional[dict] = entry(optional(dict), "the scheduler's state (an object) or null",
                                                default=None)
    num_floating_point_operations_so_far: float = entry(is_number, "a number", default=0.0)
    args: dict = entry(of_kind(dict), "the training arguments (an object)", default_factory=dict)
    extra_state: dict = entry(of_kind(dict), "an object", default_factory=dict)
    # per sub-optimizer of a DistributedOptimizer: param groups, step, grad scaler (null: none)
    distributed_optimizer: Optional[list] = entry(optional(list), "a list of optimizer states or null",
                                                  default=None)
    # per torch optimizer: no update applied yet (its state is empty, not zeros)
    optimizer_never_stepped: List[bool] = entry(of_kind(list), "a list of booleans", default_factory=list)


@dataclass
class RankObjects(Record):
    """A saving rank's objects: its RNG states, megatron-core's sharded objects it holds (unique
    key -> value), and with an online base of a distributed optimizer what its shards are made
    of (state.distopt_partition_map)."""
    rng: Optional[dict] = entry(optional(dict), "the rank's RNG states (an object)", default=None)
    sharded_objects: dict = entry(of_kind(dict), "an object of sharded objects", default_factory=dict)
    partitions: Optional[dict] = entry(optional(dict), "the rank's partition map (an object) or null",
                                       default=None)


@dataclass
class StepScalars(Record):
    """An online step's scalars (its delta record)."""
    iteration: int = entry(is_int, "an integer")
    increment: int = entry(is_int, "an integer")      # samples consumed (0: a skipped update)
    update_successful: bool = entry(of_kind(bool), "true or false", default=True)
    scheduler: Optional[dict] = entry(optional(dict), "the scheduler's state (an object) or null", default=None)
    grad_scalers: Optional[list] = entry(optional(list), "a list of loss-scaler states or null", default=None)


def tracked_checkpoint(save_dir: str) -> Optional[str]:
    """The checkpoint directory Megatron-LM's ``latest_checkpointed_iteration.txt`` in ``save_dir``
    names (``iter_NNNNNNN`` or ``release``), None without one."""
    tracker = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        it = f.read().strip()
    return os.path.join(save_dir, "release" if it == "release" else f"iter_{int(it):07d}")
