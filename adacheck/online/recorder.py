"""The online mode, independent of the framework: chains of deltas on top of base checkpoints.

An integration provides an :class:`~adacheck.online.optimtap.OptimizerTap` on its torch optimizers,
calls :meth:`OnlineRecorder.after_step` at its post-step point with the step number and the
JSON scalars it needs to restore (counters, scheduler, loss scaler), and
:meth:`OnlineRecorder.start_chain` after every committed base checkpoint.  The recorder
decides when the next base is due (``base_interval`` steps, or "auto": see
:func:`adacheck.online.deltas.auto_interval`, decided once per chain from the first delta) and
asks the integration to take it.  The recovery side is :mod:`adacheck.online.recovery`.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, List, Optional, Sequence

from . import deltas
from . import deltalog
from ..format import jsontree
from ..config import OnlineConfig
from ..errors import StateError
from ..plan.exchange import Comm
from .optimtap import OptimizerTap, Shadow
from ..plan.planner import place
from ..checkpoint.rng import rng_state
from ..storage.backends import LOCAL, Storage

log = logging.getLogger("adacheck")


class OnlineRecorder:
    def __init__(self, tap: OptimizerTap, config: OnlineConfig, where, comm: Callable[[], Comm],
                 take_base: Callable[[], None], fsync: bool = True, mine: Optional[set] = None,
                 rank_state: Callable[[], dict] = rng_state,
                 preclip: Optional[Callable[[str, object, object], None]] = None, store: Storage = LOCAL):
        """``where``: the directory the chains go to (on ``store``), or the Checkpointer's
        :class:`~adacheck.checkpoint.Recording` (its store, directory, spread and bridge)."""
        spread, bridge, spares = None, False, None
        if not isinstance(where, str):
            store, spread, bridge, spares, where = where.store, where.spread, where.bridge, where.spares, where.where
        self.spares = spares      # the memory tier's spare delta files, written over (tiers.spares_of)
        self.tap, self.config, self.save_dir, self.store = tap, config, where, store
        self.spread = spread      # a memory tier across nodes: each node keeps its ranks' chains (tiers.DeltaSpread)
        self.bridge = bridge      # a step that takes a base is also the last delta of the chain before it
        self.comm, self.take_base, self.fsync, self.mine = comm, take_base, fsync, mine
        self.rank_state, self.preclip = rank_state, preclip
        # compact: the state a recovery reaches, stepped along with the gradients as stored
        self.shadow: Optional[Shadow] = None
        self._stored: dict = {}
        self.log: Optional[deltalog.DeltaLog] = None
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
            self._stored[key] = (deltalog.compact_form(grad.detach()), grad.dtype)

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

    def note_preclip_of(self, tensor, grad, args) -> None:
        """:meth:`note_preclip` for a tensor of the tap's (others, and a missing gradient, are not recorded)."""
        key = self.tap.key_of(tensor)
        if key is not None and grad is not None:
            self.note_preclip(key, grad, args)

    def _base(self, step: int) -> None:
        t0 = time.perf_counter()
        self.take_base()
        log.info("AdaCheck online: base checkpoint at step %d in %.2fs", step, time.perf_counter() - t0)

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
        due = self.base_step is None or (self.interval is not None and step - self.base_step >= self.interval)
        if due and not (self.bridge and self.log is not None and self.base_step is not None):
            if self.log is not None:
                self.log.discard()
            self._base(step)
            return
        tree = dict(scalars, calls=calls, preclip=pre, param_groups=self.tap.group_state(),
                    rank_state=self.rank_state())
        enc, tensors = jsontree.encode(tree, "rank/")
        deviation = self._shadow_step(calls, pre, stored) if self.shadow is not None else None
        if self.log is not None:
            self.log.submit(step, enc, dict(tensors), deviation=deviation)
        if due:       # bridge: recorded above, then the base
            self._base(step)
            return
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
        """``base_interval: "auto"``: one collective after the first delta of a chain.  Every rank
        decides from the same numbers (the base's size and time as the slowest rank saw them), so
        all take the next base at the same step: a rank's own save time would differ."""
        mine = {"bytes": 0, "seconds": self.tap.step_seconds, "base_bytes": int(self.chain_info.get("base_bytes", 0)),
                "base_seconds": float(self.chain_info.get("base_seconds", 0.0))}
        if self.log is not None:
            self.log.flush()
            mine["bytes"] = self.log.bytes_written
        comm = self.comm()      # two small reductions; seconds in nanoseconds
        delta_bytes = comm.sum_each([mine["bytes"]])[0]
        base_bytes, base_ns, step_ns = comm.max_each([mine["base_bytes"], round(mine["base_seconds"] * 1e9),
                                                      round(mine["seconds"] * 1e9)])
        base_seconds = base_ns / 1e9
        read_seconds = delta_bytes * base_seconds / base_bytes if base_bytes else 0.0
        replay = step_ns / 1e9 + read_seconds
        self.interval = deltas.auto_interval(base_bytes, base_seconds, delta_bytes, replay)
        log.info("AdaCheck online: base_interval auto = %d (base %d B in %rs; delta %d B, replay ~%rs)",
                 self.interval, base_bytes, base_seconds, delta_bytes, replay)

    def flush(self, peers: bool = False) -> None:
        """Wait until the steps recorded so far are written (and, ``peers``, copied to the next node)."""
        if self.log is not None:
            self.log.flush()
        if peers and self.spread is not None:
            self.spread.flush()

    def close(self) -> None:
        """Stop recording: the steps recorded are written (and copied to the next node)."""
        self.tap.remove()
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.spread is not None:
            self.spread.flush()

    def start_chain(self, tag: str, step: int, base_bytes: int = 0, base_seconds: float = 0.0,
                    resume_after: Optional[int] = None, generation: Optional[int] = None) -> None:
        """Deltas from now on belong to the base ``tag`` of step ``step`` and ``generation``
        (collective).  ``resume_after``: continue that base's chain after this (recovered) step
        instead."""
        comm = self.comm()
        done, self.log = self.log, None      # its staging buffers go on in the new chain's log
        if done is not None:
            done.close()
        ckpt_dir = self.store.join(self.save_dir, tag)
        spread = self.spread
        leads = spread.leads(comm.rank) if spread is not None else comm.rank == 0   # each node's chain file
        if resume_after is None:
            info = {"base_tag": tag, "base_step": step, "base_bytes": base_bytes,
                    "base_seconds": base_seconds, "world_size": comm.world_size}
            if generation is not None:
                info["base_generation"] = generation
            if spread is not None:
                info["nodes"] = list(spread.nodes)
            if leads:
                # (the steps of an earlier save of this tag: never replayed on this base, whose chain file
                # names its generation; gone before that file, so that a crash in between leaves none)
                deltas.remove_steps_after(ckpt_dir, -1, self.store)
                deltas.write_chain(ckpt_dir, info, fsync=self.fsync, store=self.store)
        else:
            # a chain kept per node goes on only where the ranks share nodes as they did (each
            # node stores the gradients its ranks share once): else the next step takes a base
            info = deltas.read_chain(ckpt_dir, self.store) or {}
            same = node_groups(info.get("nodes"), comm.world_size) == node_groups(
                spread.nodes if spread is not None else None, comm.world_size)
            same, info = comm.broadcast_object((same, info) if comm.rank == 0 else None)
            if not same:
                log.info("AdaCheck online: the chain of %s was kept per node by other nodes than this job's; the "
                         "next step takes a base", tag)
                self.base_step = None
                return
            info = info or {"base_bytes": base_bytes, "base_seconds": base_seconds}
            if leads and spread is not None:     # every node's the same, naming the nodes now
                deltas.write_chain(ckpt_dir, dict(info, nodes=list(spread.nodes)), fsync=self.fsync,
                                   store=self.store)
            if leads:
                deltas.remove_steps_after(ckpt_dir, resume_after, self.store)
        nonce = comm.broadcast_object(os.urandom(8).hex() if comm.rank == 0 else None)
        comm.barrier()
        self.chain_info = info
        self.base_tag, self.base_step = tag, step
        self._next = (resume_after if resume_after is not None else step) + 1
        self.tap.step_seconds = 0.0
        if self.config.base_interval == "auto":
            self.interval = None
        self.log = deltalog.DeltaLog(ckpt_dir, comm.rank, nonce, fsync=self.fsync, queue_depth=self.config.queue_depth,
                                   compact=self.config.compact, on_error=self.config.on_error, store=self.store,
                                   on_written=spread.written if spread is not None else None, spares=self.spares,
                                   reuse=done, generation=generation)
        self._stored = {}
        self.shadow = Shadow(self.tap) if self.config.compact else None


def node_groups(nodes: Optional[Sequence[str]], world: int) -> List[List[int]]:
    """The ranks that keep their online deltas together: per node when a chain is kept per node
    (``nodes``, each rank's), else all of them."""
    if not nodes:
        return [list(range(world))]
    return sorted([r for r in range(len(nodes)) if nodes[r] == n] for n in set(nodes))


def replica_share(tap: OptimizerTap, keys: List[str], group: List[int], me: int, spread=None) -> set:
    """The gradients (of ``keys``) rank ``me`` writes when the ranks of ``group`` all hold them,
    under the same keys: each is written by one rank of the group, balanced by size (the
    planner's placement); the recorder's ``mine``.  With a ``spread`` (chains kept per node) the
    group is split by node: each node stores them once."""
    if spread is not None:
        group = [r for r in group if r in spread.group(me)]
    writers, _ = place([(tap.tensors[k].numel() * 4, k, list(range(len(group)))) for k in keys], len(group))
    return {k for k, w in writers.items() if group[w[0]] == me}
