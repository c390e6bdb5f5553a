"""Recovery: the committed online deltas of a base just loaded, replayed to the newest whole step.

One sequence for every integration, :func:`recover`:

1. every rank agrees on the committed delta steps of the base (:func:`chain`; up to a requested
   step, if any);
2. the integration says how they replay in this job (:meth:`Replaying.plan`): each rank its own
   record (the saving layout), a saving rank's record (an optimizer every data-parallel rank
   runs identically, on another number of them), the saving ranks' partitions rebuilt from the
   base (a partitioned optimizer on another number of data-parallel ranks), or not at all;
3. every step is checked, then replayed through the integration's optimizers
   (:func:`replay` / :func:`replay_partitions`: the same optimizer calls on the same inputs,
   so the same bits);
4. the integration restores what the last step's record holds (:meth:`Replaying.restore`:
   derived weights, counters, scheduler, loss scaler, RNG);
5. the online mode of this job, if any, continues that chain where it can, else takes a new
   base at its next step;
6. damage found on the way is raised (after the job holds the last whole step, consistently on
   every rank) or, with ``on_corrupt: "fallback"``, warned about.

An integration implements :class:`Replaying`; the functions below it are the steps.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..storage import commit
from . import deltas
from ..errors import AdaCheckError, ConfigError, CorruptCheckpointWarning, FormatError, StateError
from ..plan.exchange import Comm, agree
from .optimtap import OptimizerTap, Shadow
from ..format.records import Expect, check_fields
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.loading import LoadResult
from ..checkpoint.reader import CheckpointReader
from ..storage.backends import LOCAL, Storage
from ..types import Manifest
from ..integration import Partitions, Replaying

log = logging.getLogger("adacheck")

@dataclass
class Recovered:
    """What :func:`recover` reached: the ``step`` the job holds (the base's, or the last
    replayed), how many delta steps were replayed, in how many seconds, reading how many bytes."""
    step: int
    steps: int = 0
    seconds: float = 0.0
    bytes: int = 0


def recover(comm: Comm, ckpt_dir: str, manifest: Manifest, job: Replaying, *, latest: bool,
            until: Optional[int] = None, strict: bool = True, verify: bool = True,
            recorder=None, store: Storage = LOCAL) -> Recovered:
    """Replay the committed deltas of the base ``manifest`` just loaded from ``ckpt_dir``
    (collective; see the module's docstring).  ``latest``: the base is its directory's newest
    checkpoint (only then may the chain continue); ``until``: stop at this step (a step the
    deltas do not reach, or reach only in another layout, is a ConfigError); ``strict``: damaged
    deltas fail the load once the job holds the last whole step before them (else a warning);
    ``verify`` every hash read; ``recorder``: this job's :class:`~adacheck.online.OnlineRecorder`,
    if it records, whose tap replays and which continues the chain or takes a new base."""
    base = int(manifest.step)
    world = int(manifest.topology.get("world_size", 1))
    latest = not comm.any(not latest)   # across nodes' memories: each node's own "latest"
    steps, why, damage = chain(comm, ckpt_dir, base, world, until=until, strict=strict, store=store,
                               same_layout=lambda: job.plan(manifest).same_layout,
                               generation=manifest.framework.get("generation"))
    if until is not None and damage is None and until != (steps[-1].step if steps else base):
        raise ConfigError(f"{ckpt_dir} (step {base}) does not reach step {until} with committed online deltas")
    plan = job.plan(manifest) if steps or recorder is not None else None
    if steps and plan.refused:
        if until is not None and until != base:
            raise ConfigError(f"step {until} is reached by replaying the online deltas of {ckpt_dir}, and "
                              f"{plan.refused}: load it in that layout (and save, to reshape)")
        log.warning("AdaCheck: %s has %d committed delta steps (to step %d), and %s; so this job holds the base's "
                    "step %d. The deltas are kept: load in the saving layout and save, to reshape the newest "
                    "state (or: adacheck convert SRC NEW --to adacheck).",
                    ckpt_dir, len(steps), steps[-1].step, plan.refused, base)
        steps = []
    result, done = Replayed([], None), Recovered(base)
    if steps:
        tap = recorder.tap if recorder is not None else job.tap()
        t0 = time.perf_counter()
        try:
            if plan.same_layout or plan.record_rank is not None:
                result = replay(comm, tap, ckpt_dir, steps, verify=verify, preclip=job.preclip,
                                record_rank=comm.rank if plan.same_layout else plan.record_rank, expect=job.expect)
            else:
                parts = plan.partitions()
                result = replay_partitions(comm, tap, ckpt_dir, manifest, steps, parts, verify=verify,
                                           preclip=job.preclip, expect=job.expect, store=store)
        finally:
            if recorder is None:
                tap.remove()
        if result.last is not None:
            job.restore(result.last, plan)
            done = Recovered(result.steps[-1].step, len(result.steps), time.perf_counter() - t0,
                             sum(s.bytes for s in result.steps))
            describe_replay(result.steps, base, done.seconds, why)
    if recorder is not None:
        # continue the chain only where this job replayed all of it, in its layout, into the
        # directory it records to: going on after the base would replace committed deltas it
        # could not replay (the next step takes a base instead); a damaged chain is left as it is
        damaged = damage is not None or result.damage is not None
        here = store.canonical(store.parent(ckpt_dir)) == store.canonical(recorder.save_dir)
        if latest and until is None and plan.same_layout and not plan.refused and not damaged and here:
            recorder.start_chain(manifest.tag, base, resume_after=done.step,
                                 generation=manifest.framework.get("generation"))
        else:
            recorder.base_step = None
        recorder.tap.reindex()
    result.conclude(strict, ckpt_dir, base, damage)
    return done


def after_load(comm: Comm, job: Checkpointer, loaded: LoadResult, replaying: Optional[Replaying], *,
               without: str, until: Optional[int] = None, recorder=None) -> Recovered:
    """The recovery of every integration, after ``job.load`` returned ``loaded``: :func:`recover`
    with ``job``'s options, from the tier it loaded from (the base's chain continues only where it
    is that directory's newest checkpoint).

    Args:
        comm: the job's ranks (collective).
        job: the checkpointer that loaded the base.
        loaded: what its load returned.
        replaying: the integration's :class:`~adacheck.integration.Replaying`; None when the
            load did not take what a replay needs (:func:`not_replayed`): the job holds the
            base's step.
        without: what that load left out, for messages ("the optimizer state").
        until: stop at this step (default: the newest committed one).
        recorder: this job's online recorder, if it records (its chain continues or restarts).

    Returns:
        :class:`Recovered`: the step the job holds, and what the replay cost.
    """
    ckpt_dir, manifest, store, where = loaded.ckpt_dir, loaded.manifest, loaded.store, loaded.load_dir
    if replaying is None:
        not_replayed(ckpt_dir, manifest.step, until, without, store)
        return Recovered(manifest.step)
    return recover(comm, ckpt_dir, manifest, replaying, latest=commit.latest_or_none(where, store) == manifest.tag,
                   until=until, strict=job.options.on_corrupt != "fallback", verify=job.options.verify,
                   recorder=recorder, store=store)


def not_replayed(ckpt_dir: str, base_step: int, until: Optional[int], without: str, store: Storage = LOCAL) -> None:
    """A load that does not replay deltas (``without``: what it did not load, e.g. "the optimizer
    state"): a requested later step is a ConfigError, deltas it leaves aside a warning."""
    if until is not None and until != base_step:
        raise ConfigError(f"step {until} is reached by replaying online deltas, which needs {without}")
    if deltas.step_dirs(ckpt_dir, store):
        log.warning("AdaCheck: %s has online gradient deltas; they are not replayed without %s (the state of "
                    "step %s)", ckpt_dir, without, base_step)


def same_coords(saved_rank: dict, mine: dict, coords: Sequence[str]) -> bool:
    """``saved_rank`` (a saving rank's entry of ``manifest.layout["ranks"]``) is at ``mine``'s
    ranks ``coords``; a coordinate the saving job did not record is not compared (bases of
    earlier versions record fewer)."""
    return all(saved_rank.get(c) == mine.get(c) for c in coords if c in saved_rank)


def follow_rank(saved: List[dict], mine: dict, coords: Sequence[str]) -> Optional[int]:
    """The saving rank whose record a rank of an optimizer that every data-parallel rank runs
    identically follows, on another number of data-parallel ranks: one at the same
    model-parallel ranks ``coords`` (:func:`same_coords`), at the same ``dp_rank`` if the saving
    job had one, else the lowest; None if no saving rank is at those coordinates."""
    same = [r for r, s in enumerate(saved) if same_coords(s, mine, coords)]
    return next((r for r in same if saved[r].get("dp_rank") == mine.get("dp_rank")),
                min(same, key=lambda r: saved[r].get("dp_rank", 0), default=None))


def holder(grad: torch.Tensor) -> torch.Tensor:
    """A tensor whose ``.grad`` is ``grad``: the frameworks' clipping functions take parameters."""
    h = grad.view(grad.shape)
    h.grad = grad
    return h


def node_group(comm: Comm, ckpt_dir: str, world: int, store: Storage = LOCAL,
               same_layout: Callable[[], bool] = lambda: True) -> Optional[List[int]]:
    """The saving ranks whose records make a step committed for this rank: with a chain kept per
    node (its chain file names every rank's node: the memory tier across nodes), the ranks that
    shared this rank's node, when every rank reads the same nodes and the job replays in the
    saving layout; else None (every rank's).  Collective."""
    info = deltas.read_chain(ckpt_dir, store)
    saved = info.get("nodes") if isinstance(info, dict) else None
    saved = saved if isinstance(saved, list) and len(saved) == world == comm.world_size else None
    if comm.any(saved is None) or not comm.same(_digest(saved)):
        return None
    return [r for r in range(world) if saved[r] == saved[comm.rank]] if same_layout() else None


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def committed(comm: Comm, ckpt_dir: str, base_step: int, world: int, until: Optional[int] = None,
              strict: bool = True, store: Storage = LOCAL, same_layout: Callable[[], bool] = lambda: True,
              generation: Optional[int] = None):
    """The committed steps every rank agrees on (those up to step ``until`` if given), and why
    the log stops.  A damaged record is a FormatError on every rank (``strict``), or where the
    chain stops.  A chain kept per node (:func:`node_group`) is read on each node: the ranks
    agree on the steps and on the run that recorded each."""
    ranks = node_group(comm, ckpt_dir, world, store, same_layout)
    steps, why = agree(comm, f"AdaCheck: reading the delta log of {ckpt_dir}",
                       lambda: deltas.committed_steps(ckpt_dir, base_step, world, strict=strict, store=store,
                                                      ranks=ranks, generation=generation))
    n = -comm.max_each([-len(steps)])[0]
    held = [(s.step, s.nonce) for s in steps]
    parted = False
    if not comm.same(_digest(held[:n])):
        # chains kept per node by different runs: where they part, from every rank's list; rare
        seen = comm.all_gather_object(held[:n])
        n, parted = next((i for i in range(n) if any(v[i] != seen[0][i] for v in seen)), n), True
    if n < len(steps):
        why = (f"step {steps[n].step} was recorded by different runs on different nodes" if parted
               else f"step {steps[n].step} is not committed for every rank (on every node)")
        log.warning("AdaCheck: rank %d holds the online deltas of %s up to step %d, but %s: every rank stops at "
                    "step %d", comm.rank, ckpt_dir, steps[-1].step, why, steps[n - 1].step if n else base_step)
    steps = steps[:n]
    if until is not None and steps and steps[-1].step > until:
        steps, why = [s for s in steps if s.step <= until], f"stopped at the requested step {until}"
    return steps, why


def chain(comm: Comm, ckpt_dir: str, base_step: int, world: int, until: Optional[int] = None,
          strict: bool = True, store: Storage = LOCAL, same_layout: Callable[[], bool] = lambda: True,
          generation: Optional[int] = None) -> Tuple[List[deltas.Step], str, Optional[AdaCheckError]]:
    """:func:`committed`, with damage of the log returned instead of raised: (the steps to replay,
    why the log stops, the damage or None).  ``strict``: no step is replayed from a damaged log;
    otherwise those before the damage are."""
    try:
        steps, why = committed(comm, ckpt_dir, base_step, world, until, strict=True, store=store,
                               same_layout=same_layout, generation=generation)
        return steps, why, None
    except AdaCheckError as e:
        if strict:
            return [], str(e), e
        steps, why = committed(comm, ckpt_dir, base_step, world, until, strict=False, store=store,
                               same_layout=same_layout, generation=generation)
        return steps, why, e


@dataclass
class Replayed:
    """What a replay reached: ``steps`` replayed (in order), the record of the last one (``last``:
    the scalars, RNG and hyper-parameters the integration restores; None when no step was), and
    ``damage``: why it stopped before the end of the steps it was given, if it did.  A replay
    that stops on damage has applied whole steps only: the state is that of its last step."""
    steps: List[deltas.Step]
    last: Optional[dict]
    damage: Optional[AdaCheckError] = None

    def conclude(self, strict: bool, ckpt_dir: str, base_step, damage: Optional[AdaCheckError] = None) -> None:
        """Raise the damage (``strict``) or warn about it on every rank; the caller has restored
        ``last`` first.  ``damage``: found before the replay (see :func:`chain`), if any."""
        damage = self.damage or damage
        if damage is None:
            return
        reached = self.steps[-1].step if self.steps else base_step
        if strict:
            held = (f"the base's, step {base_step}: no delta step was applied" if reached == base_step else
                    f"the base {base_step} and the delta steps before the damage")
            damage.args = (f"{damage}\nThe job now holds the state of step {reached} ({held}), consistently.",)
            raise damage
        warnings.warn(f"AdaCheck: the delta log of {ckpt_dir} is damaged; recovered step {reached} instead of the "
                      f"newest (on_corrupt: fallback): {damage}", CorruptCheckpointWarning, stacklevel=2)


# what every record holds (OnlineRecorder.after_step), besides the integration's own scalars
COMMON: Expect = {"calls": (lambda v: isinstance(v, list), "a list of optimizer calls"),
                  "param_groups": (lambda v: isinstance(v, list) and all(
                      isinstance(g, list) and all(isinstance(x, dict) for x in g) for g in v),
                      "a list of param-group lists"),
                  "rank_state": (lambda v: isinstance(v, dict), "an object (the RNG states)")}


def check_steps(tap: OptimizerTap, ckpt_dir: str, steps: List[deltas.Step], rank: int, verify: bool, files: dict,
                shadow: Optional[Shadow] = None, expect: Optional[Expect] = None) -> None:
    """Everything about ``steps`` that can be known without reading gradient data: each record
    holds the fields replay and the integration use (``COMMON`` and ``expect``), its calls fit
    this job's optimizers and their hyper-parameter kinds (``OptimizerTap.check_calls``), each
    gradient's recorded size fits its tensor, each delta file's header is valid and lists it as
    recorded.  Run before the first step is applied (local: wrap it in ``agree``)."""
    for st in steps:
        where = f"delta step {st.step} of {ckpt_dir} (rank {rank}'s record)"
        tree, stored = tap.current(deltas.read_extra(ckpt_dir, st, rank, verify=verify, files=files))
        check_fields(tree, dict(COMMON, **(expect or {})), where)
        if shadow is not None:
            tree = _held_by(tree, shadow)
        tap.check_calls(tree.get("calls"), where, shadow)
        pre = tree.get("preclip") or {}
        if not isinstance(pre, dict):
            raise FormatError(f"{where}: preclip is not an object")
        tensors = tap.tensors if shadow is None else shadow.tensors
        for key in tap.grad_keys(tree["calls"], where, shadow) + list(pre):
            if key not in tensors:
                raise FormatError(f"{where}: clips a gradient of {key!r}, which this job does not have")
            meta, path = deltas.grad_meta(ckpt_dir, st, stored.get(key, key), rank)
            if math.prod(meta["shape"]) != tensors[key].numel():
                raise FormatError(f"{where}: the gradient of {key} has shape {meta['shape']}, the tensor "
                                  f"{tuple(tensors[key].shape)}; recorded by another model or layout")
            # the file's header is valid (truncation, offsets) and holds the gradient as recorded
            entry = deltas.open_file(path, files, st.store).entries.get(deltas.GRAD + stored.get(key, key))
            if entry is None or entry[0] != meta["stored"] or list(entry[1]) != list(meta["shape"]):
                raise FormatError(f"{path}: holds the gradient of {key} as "
                                  f"{f'{entry[0]}{list(entry[1])}' if entry else 'nothing'}, its record says "
                                  f"{meta['stored']}{meta['shape']}")


def _held_by(tree: dict, shadow: Shadow) -> dict:
    """The calls (and pre-clip entries) of the optimizers whose tensors the shadow holds (a rebuild
    may take one of a rank's optimizers: its dense and expert parameters belong to different
    replica groups)."""
    return dict(tree, calls=[c for c in tree["calls"] if any(k in shadow.tensors for g in c[1] for k in g[2])],
                preclip={k: v for k, v in (tree.get("preclip") or {}).items() if k in shadow.tensors})


def replay(comm: Comm, tap: OptimizerTap, ckpt_dir: str, steps: List[deltas.Step], verify: bool = True,
           preclip: Optional[Callable[[str, object, object], None]] = None,
           record_rank: Optional[int] = None, expect: Optional[Expect] = None) -> Replayed:
    """Replay ``steps`` through ``tap``'s optimizers (collective per step: read, then apply).
    ``preclip(key, grad, args)`` re-applies a recorded unscale/clip (note_preclip) in place.
    ``record_rank``: whose record of each step this rank follows (default: its own rank; another
    when the recording world had other ranks, for optimizers every rank runs identically).
    ``expect``: the integration's own fields of a record (see :func:`check_fields`).
    Every step is checked (:func:`check_steps`) before the first is applied; gradient data that
    fails its hash stops the replay after the last whole step (``Replayed.damage``).  The
    integration then restores the last step's scalars, refreshes the low-precision weights and
    sets ``rank_state`` (the RNG), and calls ``Replayed.conclude``."""
    files: dict = {}
    tap.reindex()
    me = comm.rank if record_rank is None else record_rank
    try:
        agree(comm, f"AdaCheck: checking {len(steps)} delta steps of {ckpt_dir}",
              lambda: check_steps(tap, ckpt_dir, steps, me, verify, files, expect=expect))
    except AdaCheckError as e:      # nothing applied: the state is the base's
        return Replayed([], None, e)
    done: List[deltas.Step] = []
    last = None
    for st in steps:
        try:
            tree, grads = agree(comm, f"AdaCheck replay of delta step {st.step} from {ckpt_dir} (read)",
                                lambda st=st: _read_step(tap, ckpt_dir, st, me, verify, files))
        except AdaCheckError as e:
            return _stopped(tap, done, last, e)
        _apply_step(tap, st, tree, grads, preclip)
        done.append(st)
        last = tree
    return _stopped(tap, done, last, None)


def _stopped(tap: OptimizerTap, done: List[deltas.Step], last: Optional[dict], damage) -> Replayed:
    if last is not None:
        tap.set_group_state(last["param_groups"])
    return Replayed(done, last, damage)


def replay_rank(tap: OptimizerTap, ckpt_dir: str, steps: List[deltas.Step], rank: int, shadow: Shadow,
                verify: bool = True, preclip: Optional[Callable[[str, object, object], None]] = None,
                expect: Optional[Expect] = None) -> dict:
    """Replay saving rank ``rank``'s record of ``steps`` on ``shadow`` (that rank's tensors and
    optimizer state, rebuilt by the integration) with this job's optimizer objects: the same
    calls on the same inputs.  Local (no collective).  Returns the last step's record."""
    files: dict = {}
    tap.reindex()
    check_steps(tap, ckpt_dir, steps, rank, verify, files, shadow, expect)
    last = None
    for st in steps:
        tree, grads = _read_step(tap, ckpt_dir, st, rank, verify, files, shadow)
        _apply_step(tap, st, tree, grads, preclip, shadow)
        last = tree
    return last


def replay_partitions(comm: Comm, tap: OptimizerTap, ckpt_dir: str, manifest: Manifest, steps: List[deltas.Step],
                      parts: Partitions, verify: bool = True,
                      preclip: Optional[Callable[[str, object, object], None]] = None,
                      expect: Optional[Expect] = None, store: Storage = LOCAL) -> Replayed:
    """Replay deltas of a partitioned optimizer recorded on another number of data-parallel ranks
    (collective; see :class:`Partitions`).

    Every saving rank whose spans overlap this rank's is rebuilt from the base ``manifest``
    (``parts.rebuild``), stepped with that rank's recorded calls and gradients (the same
    arithmetic on the same tensors: bit-exact), and its part of this rank's spans copied in
    (``parts.put``) once every overlapping saving rank has replayed (a damaged or foreign delta
    leaves the state as the base left it: ``Replayed.damage``).  Every held element must be
    covered.  ``Replayed.last`` is ``parts.record_rank``'s record of the last step."""
    saving, held = parts.saving, parts.held
    readers: List[CheckpointReader] = []

    def rebuild(r: int) -> Shadow:
        if not readers:
            readers.append(CheckpointReader(ckpt_dir, manifest, verify=verify, store=store))
        return parts.rebuild(readers[0], r)

    by_name: Dict[object, list] = {}
    for h, sink in held:
        by_name.setdefault(h.name, []).append((h, sink))

    def run():
        # every overlapping saving rank is replayed before any element is copied into this rank's
        # state: a failure (damaged delta data) leaves the state as the base left it
        replayed, covered = [], 0
        for r in sorted(saving):
            pairs = [(key, p, h, sink) for key, ps in saving[r].items() for p in ps
                     for h, sink in by_name.get(p.name, ())
                     if p.start < h.start + h.numel and h.start < p.start + p.numel]
            if not pairs:
                continue
            shadow = rebuild(r)
            replay_rank(tap, ckpt_dir, steps, r, shadow, verify=verify, preclip=preclip, expect=expect)
            replayed.append((pairs, shadow))
            covered += sum(min(p.start + p.numel, h.start + h.numel) - max(p.start, h.start) for _, p, h, _ in pairs)
        need = sum(h.numel for h, _ in held)
        if covered != need:
            raise StateError(f"the saving ranks' partitions cover {covered} of the {need} optimizer elements "
                             f"this rank holds; {ckpt_dir} does not describe this model's optimizer")
        last = deltas.read_extra(ckpt_dir, steps[-1], parts.record_rank, verify=verify)
        check_fields(last, dict(COMMON, **(expect or {})), f"delta step {steps[-1].step} of {ckpt_dir}")
        return replayed, last

    try:
        replayed, last = agree(comm, f"AdaCheck replay of {len(steps)} delta steps of {len(saving)} saving "
                                     f"ranks' partitions from {ckpt_dir} on {comm.world_size} ranks", run)
    except AdaCheckError as e:      # damaged or foreign deltas: nothing applied, the state is the base's
        return Replayed([], None, e)
    for pairs, shadow in replayed:
        for key, p, h, sink in pairs:
            lo, hi = max(p.start, h.start), min(p.start + p.numel, h.start + h.numel)
            parts.put(sink, shadow, key, p.offset + lo - p.start, lo - h.start, hi - lo)
    tap.set_group_state(last["param_groups"])
    log.info("AdaCheck: rank %d replayed the deltas of %d saving ranks' partitions", comm.rank, len(replayed))
    return Replayed(list(steps), last)


def _read_step(tap: OptimizerTap, ckpt_dir: str, st: deltas.Step, rank: int, verify: bool, files: dict,
               shadow: Optional[Shadow] = None):
    tree, stored = tap.current(deltas.read_extra(ckpt_dir, st, rank, verify=verify, files=files))
    if shadow is not None:
        tree = _held_by(tree, shadow)
    keys = tap.grad_keys(tree["calls"], f"delta step {st.step}", shadow)
    return tree, {k: deltas.read_grad(ckpt_dir, st, stored.get(k, k), rank, verify, files) for k in keys}


def _apply_step(tap: OptimizerTap, st: deltas.Step, tree: dict, grads: dict, preclip, shadow: Optional[Shadow] = None):
    tensors = tap.tensors if shadow is None else shadow.tensors
    for key, args in (tree.get("preclip") or {}).items():
        if preclip is None:
            raise StateError(f"delta step {st.step} needs the framework's gradient clipping to be "
                             "replayed, and this integration did not provide it")
        # on the device of the tensor it belongs to, where the framework clipped it while
        # recording (its kernels; Megatron's accept only CUDA tensors on a GPU)
        grads[key] = grads[key].to(tensors[key].device)
        preclip(key, grads[key], args)    # in place, with the framework's own code
    tap.replay(tree["calls"], grads, shadow=shadow)


def describe_replay(steps: List[deltas.Step], base_step, seconds: float, why: str) -> None:
    log.warning("AdaCheck: replayed %d gradient deltas (steps %d-%d) on base step %s in %.2fs%s",
                len(steps), steps[0].step, steps[-1].step, base_step, seconds,
                "" if why == "end of the log" else f"; the log stops there: {why}")
    lossy = [s for s in steps if s.lossy]
    if lossy:
        dev = steps[-1].deviation()
        log.warning("AdaCheck: APPROXIMATE recovery: %d of these deltas were stored in compact (lossy bf16) "
                    "form; largest gradient rounding error %.3g; %s", len(lossy), max(s.max_abs_error() for s in lossy),
                    "this state deviates from the recording run's at step %d by at most %.3g in the weights and "
                    "%.3g in the optimizer state (measured while recording)" % (steps[-1].step, dev["weights"],
                                                                                   dev["state"])
                    if dev is not None else "its deviation from the recording run was not measured")


