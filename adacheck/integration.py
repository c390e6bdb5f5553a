"""What an integration implements: the contract between AdaCheck's core and a framework adapter.

An adapter (``adacheck_ds``, ``adacheck_megatron``, or one of your own) does four things, each
with a type of this module:

- **save**: describe what this rank holds as a :class:`LocalState` of :class:`LocalShard` boxes
  (each of a :class:`Kind`), returned by the ``collect`` callable given to
  :meth:`adacheck.Checkpointer.save`;
- **load**: a :class:`Restore` given to :meth:`adacheck.Checkpointer.load`: stage this rank's
  part from a :class:`~adacheck.checkpoint.reader.CheckpointReader`, then apply it;
- **replay** online deltas (optional): a :class:`Replaying` given to
  :func:`adacheck.online.recovery.after_load`, which answers with a :class:`ReplayPlan`
  (a :class:`Partitions` for a partitioned optimizer on another number of ranks);
- **convert** (optional): a :class:`Converter` registered under the ``adacheck.converters``
  entry point, which ``adacheck convert --from/--to`` finds.

Nothing here imports a framework; the core never imports an adapter."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .types import Box, Kind, KINDS, Manifest
from .errors import StateError

if TYPE_CHECKING:
    from .checkpoint.reader import CheckpointReader
    from .format.records import Expect
    from .online.optimtap import OptimizerTap, Shadow

__all__ = ["Converter", "Kind", "LocalShard", "LocalState", "Partitions", "ReplayPlan", "Replaying", "Restore",
           "Span"]


# ---------------------------------------------------------------------------------------- save
@dataclass
class LocalShard:
    """A box of a logical tensor held by this rank (what an integration reports, one per box).

    Attributes:
        name: the layout-free name (``model/...``, ``master/...``, ``optim/<state>/...``), the
            same on every rank and in every parallel layout.
        kind: a :class:`Kind` (its value, "model", ..., is accepted too).
        shape: the whole logical tensor's shape.
        box: the region of it this rank holds.
        tensor: the box's elements, of shape ``box.lengths`` (a torch tensor, or a
            :class:`Deferred` one that is read when hashed and again when written).
        derive: the name of a tensor this one may be a cast of (a bf16 weight of its fp32
            master): not stored, but rebuilt from that one on load, when every holder proved
            the cast and no replica diverged.
        derive_ok: this rank proved the cast on the part of the source it can see.
        replicated: declared: other holders of the same box hold the same bytes (a replica
            whose hash differs is warned about, and every variant kept).
    """

    name: str
    kind: str
    shape: tuple
    box: Box
    tensor: torch.Tensor
    derive: Optional[str] = None
    derive_ok: bool = False
    replicated: bool = True

    def __post_init__(self):
        if not isinstance(self.kind, Kind):
            if self.kind not in KINDS:
                raise StateError(f"{self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)} "
                                 "(adacheck.integration.Kind)")
            self.kind = Kind(self.kind)


@dataclass
class LocalState:
    """All this rank holds for one save: its ``shards``, the job's ``objects`` (JSON-able trees
    with tensors; rank 0's copy is saved), its own ``rank_objects`` (e.g. RNG states), its
    ``layout`` and the ``framework`` description (kept in the manifest), and the training ``step``."""
    shards: List[LocalShard]
    objects: dict = field(default_factory=dict)       # global state; rank 0's copy is saved
    rank_objects: dict = field(default_factory=dict)  # this rank's own state (e.g. RNG)
    layout: dict = field(default_factory=dict)        # this rank's framework layout
    framework: dict = field(default_factory=dict)
    step: Optional[int] = None



# ---------------------------------------------------------------------------------------- load
class Restore:
    """How an integration loads a checkpoint into its training state: given to
    :meth:`adacheck.Checkpointer.load`, which opens the checkpoint, lets every rank :meth:`read`
    (stage) its part, and only once every rank staged without error lets each :meth:`apply` it.

    Subclass it and implement :meth:`read` and :meth:`apply`; the rest has defaults.
    :meth:`of` makes one from two functions."""

    #: saving ranks whose objects :meth:`read` looks up besides this rank's own (megatron-core's
    #: ShardedObjects whose main replica another rank saved); from the memory tier across nodes
    #: each node is sent them first
    reads_objects_of: Sequence[int] = ()

    def read(self, reader: "CheckpointReader") -> object:
        """Stage this rank's part of the checkpoint from ``reader``, changing no training state (a
        load calls it a second time when a box read the first time does not match its hash).

        Args:
            reader: the opened checkpoint (every read verified against the manifest).

        Returns:
            What :meth:`apply` is given.
        """
        raise NotImplementedError

    def apply(self, staged: object) -> object:
        """Put what :meth:`read` staged into the training state (every rank staged its part).

        Returns:
            The load's ``result`` (:attr:`adacheck.LoadResult.result`).
        """
        raise NotImplementedError

    def how_to_load(self, tag: str, manifest: Manifest) -> str:
        """The framework's call or flag that loads checkpoint ``tag`` (of ``manifest``): named in
        the error about a damaged checkpoint, with the newest intact one."""
        return f"tag={tag!r}"

    def undo(self) -> None:
        """Take back what :meth:`read` had to touch (megatron-core builds optimizer state to load
        into), on every rank, when staging failed on any."""

    @staticmethod
    def of(read: Callable[["CheckpointReader"], object], apply: Callable[[object], object] = lambda staged: staged,
           how_to_load: Optional[Callable[[str, Manifest], str]] = None) -> "Restore":
        """A Restore whose :meth:`read`, :meth:`apply` (default: the staged value is the result)
        and :meth:`how_to_load` are these functions."""
        return _Functions(read, apply, how_to_load)


class _Functions(Restore):
    def __init__(self, read, apply, how_to_load):
        self._read, self._apply, self._how = read, apply, how_to_load

    def read(self, reader):
        return self._read(reader)

    def apply(self, staged):
        return self._apply(staged)

    def how_to_load(self, tag, manifest):
        return self._how(tag, manifest) if self._how is not None else super().how_to_load(tag, manifest)


# -------------------------------------------------------------------------------------- replay
@dataclass(frozen=True)
class Span:
    """Elements [start, start + numel) of the parameter ``name`` (any hashable name the
    integration gives it), lying at ``offset`` of a flat tensor an optimizer steps."""
    name: object
    start: int
    numel: int
    offset: int


@dataclass
class Partitions:
    """A partitioned optimizer (each data-parallel rank steps its own slice of the parameters)
    whose deltas were recorded on another number of data-parallel ranks: what
    :func:`replay_partitions` needs from the integration.

    - ``saving``: per saving rank this rank can learn from (the same model-parallel
      coordinates), what each tensor its optimizer stepped is made of (tensor key -> spans);
    - ``held``: the spans this rank's optimizer holds now, each with an object of the
      integration's (its *sink*: where ``put`` copies to);
    - ``rebuild(reader, rank)``: that saving rank's tensors and optimizer state as the base holds
      them (read with ``reader``, the base's), as a :class:`~adacheck.online.optimtap.Shadow` keyed
      like ``saving[rank]``;
    - ``put(sink, shadow, key, src, at, n)``: copy the ``n`` elements at ``src`` of the shadow
      tensor ``key``, and of its optimizer state, to element ``at`` of the held span ``sink``;
    - ``record_rank``: the saving rank whose record of the last step holds the scalars this rank
      restores."""
    saving: Dict[int, Dict[str, List[Span]]]
    held: List[Tuple[Span, object]]
    rebuild: Callable[[CheckpointReader, int], Shadow]
    put: Callable[[object, Shadow, str, int, int, int], None]
    record_rank: int


@dataclass
class ReplayPlan:
    """How this job replays the deltas of a base: the integration's answer to
    :meth:`Replaying.plan`.

    - ``same_layout``: this job runs the layout that recorded them; every rank replays its own
      record, and the online mode may continue the chain;
    - ``record_rank``: otherwise, for an optimizer every data-parallel rank runs identically
      (the same full gradients), the saving rank whose record this rank follows;
    - ``partitions``: otherwise, for a partitioned optimizer, a function giving
      :class:`Partitions` (called only when there are steps to replay);
    - ``refused``: why the deltas do not replay in this job at all (the job then holds the base;
      the deltas are kept).  Set when none of the above applies, or when the optimizer itself
      differs (other code makes other arithmetic)."""
    same_layout: bool
    record_rank: Optional[int] = None
    partitions: Optional[Callable[[], Partitions]] = None
    refused: Optional[str] = None

    def __post_init__(self):
        if self.refused is None and not self.same_layout and self.record_rank is None and self.partitions is None:
            raise ValueError("a ReplayPlan for another layout needs record_rank, partitions or refused")


class Replaying(Protocol):
    """What an integration provides to :func:`recover` (one object per load, made after the base
    was loaded into the framework's objects)."""

    #: the fields of a delta record this integration restores, besides ``COMMON``: checked on
    #: every record before anything is applied (a damaged or foreign record fails cleanly)
    expect: Expect

    def plan(self, manifest: Manifest) -> ReplayPlan:
        """How the deltas of the base ``manifest`` replay in this job (see :class:`ReplayPlan`)."""

    def tap(self) -> OptimizerTap:
        """A tap on this job's optimizers, naming their tensors as the recording job did (used
        when the job has no online mode of its own, and removed after the replay)."""

    def preclip(self, key: str, grad: torch.Tensor, args: dict) -> None:
        """Unscale / clip ``grad`` (of tensor ``key``) in place with the framework's own code and
        the recorded ``args`` (the norm, the clipping limit), as it did while recording."""

    def restore(self, last: dict, plan: ReplayPlan) -> None:
        """After the replay: the derived weights (low-precision or model weights from the master
        weights, gathered where the framework gathers them) and what ``last``, the record of the
        last step replayed, holds: counters, scheduler, loss scaler, RNG state (``rank_state``;
        where the ranks are the saving job's)."""



# ------------------------------------------------------------------------------------- convert
class Converter:
    """A checkpoint format ``adacheck convert`` reads or writes (``--from NAME`` / ``--to NAME``).

    ``name``: the format's name; ``summary``: one line for ``--help``; ``framework``: the
    AdaCheck checkpoints whose online deltas it can materialise (``manifest.framework["name"]``)
    or None.  Each operation returns (the path written, a sentence saying what it is) and raises
    NotImplementedError where the format has no such direction.  ``options`` is the command line
    namespace: the core options (``tag``, ``no_verify``, ``json``) and those ``add_arguments``
    declared."""

    name = ""
    summary = ""
    framework: Optional[str] = None

    def add_arguments(self, parser) -> None:
        """Declare this format's own command-line options on ``parser`` (an argparse parser)."""

    def write(self, ckpt_dir: str, out: str, options, progress) -> Tuple[str, str]:
        """The AdaCheck checkpoint ``ckpt_dir`` in this format under ``out``."""
        raise NotImplementedError

    def read(self, src: str, out: str, options, progress) -> Tuple[str, str]:
        """The checkpoint ``src`` of this format as an AdaCheck checkpoint under ``out``."""
        raise NotImplementedError

    def materialise(self, src: str, out: str, options, progress) -> Tuple[str, str]:
        """The AdaCheck checkpoint ``src`` (a base and its online deltas) as one new base under
        ``out``, at its newest committed step or the one the options name."""
        raise NotImplementedError
