"""The online mode, independent of the framework: chains of deltas on top of base checkpoints.

An integration provides an :class:`~adacheck.optimtap.OptimizerTap` on its torch optimizers,
calls :meth:`OnlineRecorder.after_step` at its post-step point with the step number and the
JSON scalars it needs to restore (counters, scheduler, loss scaler), and
:meth:`OnlineRecorder.start_chain` after every committed base checkpoint.  The recorder
decides when the next base is due (``base_interval`` steps, or "auto": see
:func:`adacheck.deltas.auto_interval`, decided once per chain from the first delta) and
asks the integration to take it.  :func:`replay` is the recovery side.
"""
from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from . import deltas as D
from . import jsontree
from .config import OnlineConfig
from .errors import AdaCheckError, CorruptCheckpointWarning, FormatError, StateError
from .exchange import Comm, agree
from .optimtap import OptimizerTap, Shadow
from .rng import rng_state
from .storage import LOCAL, Storage

log = logging.getLogger("adacheck")


class OnlineRecorder:
    def __init__(self, tap: OptimizerTap, config: OnlineConfig, save_dir: str, comm: Callable[[], Comm],
                 take_base: Callable[[], None], fsync: bool = True, mine: Optional[set] = None,
                 rank_state: Callable[[], dict] = rng_state,
                 preclip: Optional[Callable[[str, object, object], None]] = None, store: Storage = LOCAL):
        self.tap, self.config, self.save_dir, self.store = tap, config, save_dir, store
        self.comm, self.take_base, self.fsync, self.mine = comm, take_base, fsync, mine
        self.rank_state, self.preclip = rank_state, preclip
        # compact: the state a recovery reaches, stepped along with the gradients as stored
        self.shadow: Optional[Shadow] = None
        self._stored: dict = {}
        self.log: Optional[D.DeltaLog] = None
        self.base_step: Optional[int] = None
        self.base_tag: Optional[str] = None
        self.interval: Optional[int] = config.base_interval if config.base_interval != "auto" else None
        self.chain_info: dict = {}
        self._next = 0
        self._warned_slow = False
        self._pre: dict = {}
        tap.on_first_call = self._begin
        tap.on_grad = self._grad

    def _begin(self) -> None:
        if self.log is not None:
            self.log.begin(self._next)

    def _grad(self, key, grad) -> None:
        if key in self._pre:
            return       # its gradient before the framework's unscale/clip is staged already
        self._keep(key, grad)
        if self.log is not None and (self.mine is None or key in self.mine):
            self.log.add(key, grad)

    def _keep(self, key, grad) -> None:
        """compact: the gradient as the log stores it (every rank's own: replay applies them all)."""
        if self.shadow is not None and self.log is not None and not self.log.disabled:
            self._stored[key] = (D.compact_form(grad.detach()), grad.dtype)

    def note_preclip(self, key: str, grad, args) -> None:
        """The framework is about to unscale / clip ``grad`` (of tensor ``key``) in place with
        ``args`` (e.g. the global norm): stage the gradient as it is now (it is often exact in
        bf16, the clipped one is not) and let replay apply the same transform again."""
        if self.tap.replaying:
            return
        self._begin()
        self._pre[key] = args
        self._keep(key, grad)
        if self.log is not None and (self.mine is None or key in self.mine):
            self.log.add(key, grad)

    def expect(self, step: int) -> None:
        """The step the next optimizer calls belong to."""
        self._next = step

    def after_step(self, step: int, scalars: dict) -> None:
        """Step ``step`` is complete: record it, or take a base if one is due (collectively:
        every rank makes the same decision from the same step number)."""
        calls = self.tap.take_calls()
        pre, self._pre = self._pre, {}
        stored, self._stored = self._stored, {}
        self._next = step + 1
        if self.base_step is None or (self.interval is not None and step - self.base_step >= self.interval):
            if self.log is not None:
                self.log.discard()
            self.take_base()
            return
        tree = dict(scalars, calls=calls, preclip=pre, param_groups=self.tap.group_state(),
                    rank_state=self.rank_state())
        enc, tensors = jsontree.encode(tree, "rank/")
        deviation = self._shadow_step(calls, pre, stored) if self.shadow is not None else None
        if self.log is not None:
            self.log.submit(step, enc, dict(tensors), deviation=deviation)
        if self.interval is None and step == self.base_step + 2:
            self._decide_interval()
        if self.log is not None and not self._warned_slow and step - self.base_step >= 10:
            lg = self.log
            wall = time.perf_counter() - lg.started
            if wall > 0 and lg.stall_seconds > 0.1 * wall:
                self._warned_slow = True
                log.warning("AdaCheck online: training waited %.0f%% of the last %.1fs for the delta writer "
                            "(%d steps, %.1f MB written at %.2f GB/s): the storage cannot absorb a delta per "
                            "step at this speed; use faster storage or a larger queue_depth for bursts",
                            100 * lg.stall_seconds / wall, wall, lg.steps_written, lg.bytes_written / 1e6,
                            lg.bytes_written / max(lg.write_seconds, 1e-9) / 1e9)

    def _shadow_step(self, calls, pre: dict, stored: dict) -> Optional[dict]:
        """compact: replay this step on the shadow with the gradients as stored; its distance
        to the live state is what a recovery to this step deviates by (measured, not bounded)."""
        if self.log is None or self.log.disabled:
            return None
        grads = {k: g.to(dtype) for k, (g, dtype) in stored.items()}
        for key, args in pre.items():
            if self.preclip is None:
                raise StateError("compact online deltas with the framework's gradient clipping need the "
                                 "integration's preclip function")
            self.preclip(key, grads[key], args)
        self.tap.replay(calls, grads, shadow=self.shadow)
        return self.shadow.deviation(self.tap)

    def _decide_interval(self) -> None:
        """``base_interval: "auto"``: one collective after the first delta of a chain."""
        mine = {"bytes": 0, "seconds": self.tap.step_seconds}
        if self.log is not None:
            self.log.flush()
            mine["bytes"] = self.log.bytes_written
        allr = self.comm().all_gather_object(mine)
        delta_bytes = sum(a["bytes"] for a in allr)
        base_bytes = int(self.chain_info.get("base_bytes", 0))
        base_seconds = float(self.chain_info.get("base_seconds", 0.0))
        read_seconds = delta_bytes * base_seconds / base_bytes if base_bytes else 0.0
        replay = max(a["seconds"] for a in allr) + read_seconds
        self.interval = D.auto_interval(base_bytes, base_seconds, delta_bytes, replay)
        log.info("AdaCheck online: base_interval auto = %d (base %d B in %.2fs; delta %d B, replay ~%.3fs)",
                 self.interval, base_bytes, base_seconds, delta_bytes, replay)

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()

    def close(self) -> None:
        self.tap.remove()
        if self.log is not None:
            self.log.close()
            self.log = None

    def start_chain(self, tag: str, step: int, base_bytes: int = 0, base_seconds: float = 0.0,
                    resume_after: Optional[int] = None) -> None:
        """Deltas from now on belong to the base ``tag`` of step ``step`` (collective).
        ``resume_after``: continue that base's chain after this (recovered) step instead."""
        comm = self.comm()
        if self.log is not None:
            self.log.close()
            self.log = None
        ckpt_dir = self.store.join(self.save_dir, tag)
        if resume_after is None:
            info = {"base_tag": tag, "base_step": step, "base_bytes": base_bytes,
                    "base_seconds": base_seconds, "world_size": comm.world_size}
            if comm.rank == 0:
                D.write_chain(ckpt_dir, info, fsync=self.fsync, store=self.store)
        else:
            info = D.read_chain(ckpt_dir, self.store) or {"base_bytes": base_bytes, "base_seconds": base_seconds}
            if comm.rank == 0:
                D.remove_steps_after(ckpt_dir, resume_after, self.store)
        nonce = comm.broadcast_object(os.urandom(8).hex() if comm.rank == 0 else None)
        comm.barrier()
        self.chain_info = info
        self.base_tag, self.base_step = tag, step
        self._next = (resume_after if resume_after is not None else step) + 1
        self.tap.step_seconds = 0.0
        if self.config.base_interval == "auto":
            self.interval = None
        self.log = D.DeltaLog(ckpt_dir, comm.rank, nonce, fsync=self.fsync, queue_depth=self.config.queue_depth,
                              compact=self.config.compact, on_error=self.config.on_error, store=self.store)
        self._stored = {}
        self.shadow = Shadow(self.tap) if self.config.compact else None


def committed(comm: Comm, ckpt_dir: str, base_step: int, world: int, until: Optional[int] = None,
              strict: bool = True, store: Storage = LOCAL):
    """The committed steps every rank agrees on (those up to step ``until`` if given), and why
    the log stops.  A damaged record is a FormatError on every rank (``strict``), or where the
    chain stops."""
    steps, why = agree(comm, f"AdaCheck: reading the delta log of {ckpt_dir}",
                       lambda: D.committed_steps(ckpt_dir, base_step, world, strict=strict, store=store))
    n = min(comm.all_gather_object(len(steps)))
    steps = steps[:n]
    if until is not None and steps and steps[-1].step > until:
        steps, why = [s for s in steps if s.step <= until], f"stopped at the requested step {until}"
    return steps, why


def chain(comm: Comm, ckpt_dir: str, base_step: int, world: int, until: Optional[int] = None,
          strict: bool = True, store: Storage = LOCAL) -> Tuple[List[D.Step], str, Optional[AdaCheckError]]:
    """:func:`committed`, with damage of the log returned instead of raised: (the steps to replay,
    why the log stops, the damage or None).  ``strict``: no step is replayed from a damaged log;
    otherwise those before the damage are."""
    try:
        steps, why = committed(comm, ckpt_dir, base_step, world, until, strict=True, store=store)
        return steps, why, None
    except AdaCheckError as e:
        if strict:
            return [], str(e), e
        steps, why = committed(comm, ckpt_dir, base_step, world, until, strict=False, store=store)
        return steps, why, e


@dataclass
class Replayed:
    """What a replay reached: ``steps`` replayed (in order), the record of the last one (``last``:
    the scalars, RNG and hyper-parameters the integration restores; None when no step was), and
    ``damage``: why it stopped before the end of the steps it was given, if it did.  A replay
    that stops on damage has applied whole steps only: the state is that of its last step."""
    steps: List[D.Step]
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


Expect = Dict[str, Tuple[Callable[[object], bool], str]]   # record field -> (test, what it must be)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# what every record holds (OnlineRecorder.after_step), besides the integration's own scalars
COMMON: Expect = {"calls": (lambda v: isinstance(v, list), "a list of optimizer calls"),
                  "param_groups": (lambda v: isinstance(v, list) and all(
                      isinstance(g, list) and all(isinstance(x, dict) for x in g) for g in v),
                      "a list of param-group lists"),
                  "rank_state": (lambda v: isinstance(v, dict), "an object (the RNG states)")}


def check_fields(tree, expect: Expect, where: str) -> None:
    """Raise FormatError unless the record ``tree`` holds each field of ``expect`` as described."""
    if not isinstance(tree, dict):
        raise FormatError(f"{where}: the record is not an object")
    for key, (ok, what) in expect.items():
        if not ok(tree.get(key)):
            raise FormatError(f"{where}: {key} is {str(tree.get(key))[:60]}, expected {what}; the delta record is "
                              "damaged or was written by another integration")


def check_steps(tap: OptimizerTap, ckpt_dir: str, steps: List[D.Step], rank: int, verify: bool, files: dict,
                shadow: Optional[Shadow] = None, expect: Optional[Expect] = None) -> None:
    """Everything about ``steps`` that can be known without reading gradient data: each record
    holds the fields replay and the integration use (``COMMON`` and ``expect``), its calls fit
    this job's optimizers and their hyper-parameter kinds (``OptimizerTap.check_calls``), each
    gradient's recorded size fits its tensor, each delta file's header is valid and lists it as
    recorded.  Run before the first step is applied (local: wrap it in ``agree``)."""
    for st in steps:
        where = f"delta step {st.step} of {ckpt_dir} (rank {rank}'s record)"
        tree, stored = tap.current(D.read_extra(ckpt_dir, st, rank, verify=verify, files=files))
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
            meta, path = D.grad_meta(ckpt_dir, st, stored.get(key, key), rank)
            if math.prod(meta["shape"]) != tensors[key].numel():
                raise FormatError(f"{where}: the gradient of {key} has shape {meta['shape']}, the tensor "
                                  f"{tuple(tensors[key].shape)}; recorded by another model or layout")
            # the file's header is valid (truncation, offsets) and holds the gradient as recorded
            entry = D.open_file(path, files, st.store).entries.get(D.GRAD + stored.get(key, key))
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


def replay(comm: Comm, tap: OptimizerTap, ckpt_dir: str, steps: List[D.Step], verify: bool = True,
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
    done: List[D.Step] = []
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


def _stopped(tap: OptimizerTap, done: List[D.Step], last: Optional[dict], damage) -> Replayed:
    if last is not None:
        tap.set_group_state(last["param_groups"])
    return Replayed(done, last, damage)


def replay_rank(tap: OptimizerTap, ckpt_dir: str, steps: List[D.Step], rank: int, shadow: Shadow,
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


@dataclass(frozen=True)
class Span:
    """Elements [start, start + numel) of the parameter ``name`` (any hashable name the
    integration gives it), lying at ``offset`` of a flat tensor an optimizer steps."""
    name: object
    start: int
    numel: int
    offset: int


def replay_partitions(comm: Comm, tap: OptimizerTap, ckpt_dir: str, steps: List[D.Step],
                      saving: Dict[int, Dict[str, List[Span]]], held: List[Tuple[Span, object]],
                      rebuild: Callable[[int], Shadow], put: Callable[[object, Shadow, str, int, int, int], None],
                      record_rank: int, verify: bool = True,
                      preclip: Optional[Callable[[str, object, object], None]] = None,
                      expect: Optional[Expect] = None) -> Replayed:
    """Replay deltas of a partitioned optimizer (each data-parallel rank steps its own slice of
    the parameters) recorded on another number of data-parallel ranks (collective).

    ``saving``: per saving rank this rank can learn from (the same model-parallel coordinates),
    what each tensor its optimizer stepped is made of (key -> spans).  ``held``: the spans this
    rank's optimizer holds now, each with an integration object (``sink``).  Every saving rank
    whose spans overlap this rank's is rebuilt from the base (``rebuild(rank)``: its tensors and
    optimizer state as a Shadow), stepped with that rank's recorded calls and gradients (the
    same arithmetic on the same tensors: bit-exact), and ``put(sink, shadow, key, src, at, n)``
    copies the ``n`` elements at ``src`` of the shadow tensor ``key`` (and of its state) to
    element ``at`` of the held span, once every overlapping saving rank has replayed (a damaged
    or foreign delta leaves the state as the base left it: ``Replayed.damage``).  Every held
    element must be covered.  ``Replayed.last`` is ``record_rank``'s record of the last step (the
    scalars this rank restores)."""
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
        last = D.read_extra(ckpt_dir, steps[-1], record_rank, verify=verify)
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
            put(sink, shadow, key, p.offset + lo - p.start, lo - h.start, hi - lo)
    tap.set_group_state(last["param_groups"])
    log.info("AdaCheck: rank %d replayed the deltas of %d saving ranks' partitions", comm.rank, len(replayed))
    return Replayed(list(steps), last)


def _read_step(tap: OptimizerTap, ckpt_dir: str, st: D.Step, rank: int, verify: bool, files: dict,
               shadow: Optional[Shadow] = None):
    tree, stored = tap.current(D.read_extra(ckpt_dir, st, rank, verify=verify, files=files))
    if shadow is not None:
        tree = _held_by(tree, shadow)
    keys = tap.grad_keys(tree["calls"], f"delta step {st.step}", shadow)
    return tree, {k: D.read_grad(ckpt_dir, st, stored.get(k, k), rank, verify, files) for k in keys}


def _apply_step(tap: OptimizerTap, st: D.Step, tree: dict, grads: dict, preclip, shadow: Optional[Shadow] = None):
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


def describe_replay(steps: List[D.Step], base_step, seconds: float, why: str) -> None:
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

