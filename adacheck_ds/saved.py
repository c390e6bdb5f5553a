"""What a DeepSpeed checkpoint keeps besides its tensors, as typed records (adacheck.format.records):
the engine's objects (saved once per checkpoint), each saving rank's objects, and the scalars of
one online step.  engine.py and online.py write them; engine.py, online.py, native.py and
convert.py read them, all through these classes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from adacheck.format.records import Record, entry, number_map, of_kind, optional


@dataclass
class Scalars(Record):
    """What a step changes besides tensors: in every checkpoint and every online delta record."""
    # numbers as the engine keeps them: with sequence parallelism DeepSpeed counts samples in floats
    counters: Dict[str, float] = entry(number_map, "an object of counters (global_steps, ...), numbers")
    lr_scheduler: Optional[dict] = entry(optional(dict), "the LR scheduler's state (an object) or null",
                                         default=None)
    loss_scaler: Optional[dict] = entry(optional(dict), "the loss scaler's state (an object) or null",
                                        default=None)


@dataclass
class StepScalars(Scalars):
    """An online step's scalars (its delta record): ``skipped`` when the optimizer skipped the
    update (an fp16 overflow)."""
    skipped: bool = entry(of_kind(bool), "true or false", default=False)


@dataclass
class SavedModel(Record):
    """What a DeepSpeed engine of another layout is built from (adacheck_ds.native)."""
    parameters: List[list] = entry(of_kind(list), "a list of [name, trainable] pairs in module order")
    buffers: List[str] = entry(of_kind(list), "a list of buffer names")
    groups: List[List[str]] = entry(of_kind(list), "a list of parameter-name lists, one per optimizer group")
    optimizer: Optional[str] = entry(optional(str), "the optimizer's class path or null", default=None)
    tensor_parallel: dict = entry(of_kind(dict), "an object {size, partition_dims}",
                                  default_factory=lambda: {"size": 1, "partition_dims": {}})
    ds_config: Optional[dict] = entry(optional(dict), "the DeepSpeed config (an object) or null", default=None)
    # tied weights, as DeepSpeed's shared_params: alias -> the name in ``parameters`` (null: a
    # checkpoint saved before AdaCheck recorded them)
    shared: Optional[Dict[str, str]] = entry(optional(dict), "an object {alias: name} or null",
                                             default=None)
    # a PipelineEngine's layers and stages (adacheck_ds.state.pipeline_layers); null otherwise
    pipeline: Optional[dict] = entry(optional(dict), "an object {parts, layers} or null", default=None)
    # DeepSpeed-MoE layers (adacheck_ds.state.moe_layers); null without any
    moe: Optional[list] = entry(optional(list), "a list of MoE layers or null", default=None)

    @property
    def partition_dims(self) -> Dict[str, int]:
        """Tensor-parallel parameters: the dimension each is split along."""
        return {n: int(d) for n, d in (self.tensor_parallel.get("partition_dims") or {}).items()}


@dataclass
class Objects(Scalars):
    """A checkpoint's objects."""
    param_groups: Optional[List[dict]] = entry(optional(list), "the optimizer's param groups (a list) or null",
                                               default=None)
    client_state: dict = entry(of_kind(dict), "the client state (an object)", default_factory=dict)
    model_spec: Optional[dict] = entry(optional(dict), "the model description (an object) or null", default=None)

    def model(self, where: str) -> Optional[SavedModel]:
        return SavedModel.of(self.model_spec, f"{where}: model_spec") if self.model_spec else None


@dataclass
class RankObjects(Record):
    """A saving rank's objects: its RNG states, and with an online base of a partitioned optimizer
    what its partitions are made of (state.partition_map)."""
    rng: dict = entry(of_kind(dict), "the rank's RNG states (an object)")
    partitions: Optional[dict] = entry(optional(dict), "the rank's partition map (an object) or null",
                                       default=None)

