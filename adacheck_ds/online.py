"""Online gradient deltas for DeepSpeed engines, ZeRO 0-3, fp32 / bf16 / fp16 (docs/online.md).

Recorded at each ``engine.step`` that advances ``global_steps``: every call of the base optimizer
(the torch optimizer inside DeepSpeed's wrapper) with the gradients it consumed, as an
:class:`~adacheck.online.optimtap.OptimizerTap` sees them; a step the loss scaler skipped stores only
its scalars.  Replayed (:class:`Replay`, for :func:`adacheck.online.recovery.recover`): the same calls
without a forward or backward pass, then DeepSpeed's own code makes the module's weights again
(:meth:`Wrapper.refresh`) and the counters, scheduler, loss scaler and RNG of the last step are
set.  On another data-parallel size, ZeRO-0 follows one saving rank's record and flat partitions
(ZeRO 1-3, BF16_Optimizer) are rebuilt from a base that records them (``Replay._partitions``).
Refused, the base loaded and the refusal logged: another ZeRO stage, optimizer wrapper,
optimizer class or tensor-parallel size than the recording one.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Optional

import torch

from adacheck import integration
from adacheck.online import recorder as online, recovery
from adacheck.errors import ConfigError
from adacheck.plan.exchange import default_comm
from adacheck.online.optimtap import OptimizerTap, Shadow
from adacheck.checkpoint.rng import set_rng_state

from .saved import RankObjects, StepScalars
from .wrappers.base import checkpoint_event
from .state import class_path, data_parallel, data_parallel_ranks, describe, pipeline, read_partition
from .wrappers import Frag

log = logging.getLogger("adacheck")


def _tap(engine) -> tuple:
    lay = describe(engine)
    if lay.base_optimizer is None:
        raise ConfigError("adacheck.online needs an optimizer (the engine has none)")
    # tensor-parallel ranks hold other slices under the same optimizer positions: keys carry the
    # TP rank, so equal keys mean the same tensor
    # and pipeline stages other tensors altogether
    stage, stages = pipeline(engine)
    prefix = (f"tp{lay.tp[0]}." if lay.tp[1] > 1 else "") + (f"pp{stage}." if stages > 1 else "")
    return lay, OptimizerTap([lay.base_optimizer], prefix=prefix, extra=[lay.wrapper.tap_tensors()])


class OnlineDS:
    """The online mode of one engine (``engine.adacheck.online``)."""

    def __init__(self, ac):
        self.ac = ac
        self.engine = e = ac.engine
        if not ac.config.save_dir:
            raise ConfigError("adacheck.online needs adacheck.save_dir: deltas are written after every "
                              "step, before any save_checkpoint call names a directory")
        self.save_dir = ac.config.save_dir
        self.lay, self.tap = _tap(e)
        if self.lay.wrapper.replicated and getattr(e, "has_moe_layers", False):
            raise ConfigError("adacheck.online with DeepSpeed-MoE experts needs ZeRO stage 1-3: without ZeRO, "
                              "AdaCheck stores each gradient once per data-parallel group, but each rank's "
                              "experts are other experts; set zero_optimization.stage to 1 or 2, or disable "
                              "adacheck.online")
        mine, rec = None, ac.checkpointer.recording(default_comm(), self.save_dir)
        if self.lay.wrapper.replicated:   # stored once per data-parallel group (per node), by a balanced choice
            me, group = data_parallel(e)[0], data_parallel_ranks(e)
            mine = online.replica_share(self.tap, sorted(self.tap.tensors), group, group[me], rec.spread)
        self.recorder = online.OnlineRecorder(self.tap, ac.config.online, rec, default_comm, self._take_base,
                                              fsync=ac.config.fsync, mine=mine,
                                              preclip=self.lay.wrapper.preclip)
        # gradients before the wrapper unscales / clips them in place: exact (bf16 sums) where
        # the clipped ones are not
        self._unrecord = self.lay.wrapper.record_clipping(self.recorder.note_preclip_of)

    def after_step(self) -> None:
        """Record the step the engine just completed (AdaCheckDeepSpeed's hook on ``engine.step``;
        a step the loss scaler skipped stores only its scalars)."""
        e = self.engine
        self.recorder.after_step(int(e.global_steps), StepScalars(
            **self.ac.scalars().tree(), skipped=not getattr(e, "_step_applied", True)).tree())

    def _take_base(self) -> None:
        self.ac.save_checkpoint(self.save_dir)   # starts the new chain (see AdaCheckDeepSpeed)

    def flush(self) -> None:
        self.recorder.flush(peers=True)

    def close(self) -> None:
        self.recorder.close()
        if self._unrecord is not None:
            self._unrecord()


class Replay:
    """How this engine replays the deltas of a base it loaded (adacheck.online.recovery.Replaying)."""
    expect = StepScalars.expect()     # the fields of a delta record restore() uses

    def __init__(self, ac, saved_optimizer: Optional[str] = None):
        self.ac, self.engine, self.comm = ac, ac.engine, default_comm()
        self.lay = describe(ac.engine)
        self.preclip = self.lay.wrapper.preclip      # Replaying.preclip: the wrapper's own clipping
        self.saved_optimizer = saved_optimizer   # the base optimizer's class that recorded (None: not known)
        self.saving_world = 0

    def plan(self, manifest) -> integration.ReplayPlan:
        lay, comm, fw = self.lay, self.comm, manifest.framework
        world = self.saving_world = int(manifest.topology.get("world_size", 1))
        mine = class_path(lay.base_optimizer)
        same = world == comm.world_size
        # the same optimizer code makes the same arithmetic: a ZeRO-Offload run (DeepSpeedCPUAdam)
        # resumed without offload (torch's or DeepSpeed's fused Adam) would not replay bit-exactly
        pp = pipeline(self.engine)[1]
        if (fw.get("zero_stage"), fw.get("optimizer"), int(fw.get("tp_world_size", 1)),
                int(fw.get("pp_world_size", 1))) != (lay.stage, lay.wrapper.name, lay.tp[1], pp) \
                or self.saved_optimizer not in (None, mine):
            return integration.ReplayPlan(same, refused=(
                f"they were recorded by ZeRO-{fw.get('zero_stage')}/{fw.get('optimizer')} with "
                f"{self.saved_optimizer or 'its optimizer'} (TP={fw.get('tp_world_size', 1)}, "
                f"PP={fw.get('pp_world_size', 1)}), which this ZeRO-{lay.stage}/{lay.wrapper.name} engine "
                f"with {mine} (TP={lay.tp[1]}, PP={pp}) is not"))
        if same:
            return integration.ReplayPlan(True)
        if getattr(self.engine, "has_moe_layers", False):
            return integration.ReplayPlan(False, refused=f"they were recorded on {world} ranks with DeepSpeed-MoE "
                                                      "experts, which replay only on as many ranks")
        saved = manifest.layout.get("ranks", [])
        # the saving rank at this tensor-parallel rank whose record of the last step this rank restores
        follow = recovery.follow_rank(saved, {"tp_rank": lay.tp[0], "pp_rank": pipeline(self.engine)[0],
                                              "dp_rank": data_parallel(self.engine)[0]}, ("tp_rank", "pp_rank"))
        if lay.wrapper.replicated:
            # every rank of a replicated optimizer (ZeRO-0) applies the same full gradients: its
            # deltas replay on any data-parallel size
            return integration.ReplayPlan(False, record_rank=follow)
        # those of flat partitions (ZeRO 1-3, the BF16 optimizer) on the saving ranks' partitions
        # rebuilt here, from bases that record them
        maps = [RankObjects.of(ro, f"rank {r}'s objects of the base").partitions if ro else None
                for r, ro in enumerate(manifest.rank_objects)]
        if lay.wrapper.flat_partitions and maps and all(m is not None for m in maps):
            return integration.ReplayPlan(False, partitions=lambda: self._partitions(saved, maps, follow))
        return integration.ReplayPlan(False, refused=f"they were recorded on {world} ranks and replay on another number "
                                                  "of data-parallel ranks only from a base saved by this version")

    def tap(self) -> OptimizerTap:
        return _tap(self.engine)[1]

    def restore(self, last: dict, plan: integration.ReplayPlan) -> None:
        with checkpoint_event(self.engine.optimizer):
            self.lay.wrapper.refresh()      # the module's weights from the replayed master weights
        self.ac.apply_scalars(StepScalars.of(last, "the last delta record"))
        if self.comm.rank < self.saving_world:   # as the base load: a rank the saving job did not have keeps its RNG
            set_rng_state(last["rank_state"])

    def _partitions(self, saved: list, maps: list, follow: Optional[int]) -> integration.Partitions:
        """The saving ranks' flat partitions (ZeRO 1-3, the BF16 optimizer) at this rank's
        tensor-parallel rank, rebuilt from the base: master weights and optimizer state."""
        lay = self.lay
        opt = lay.base_optimizer
        dev = lay.frags[0].base_param.device if lay.frags else torch.device("cpu")
        saving = {r: {k: [integration.Span(*p) for p in v["pieces"]] for k, v in pm.items()}
                  for r, pm in enumerate(maps) if saved[r].get("tp_rank", 0) == lay.tp[0]}

        def rebuild(reader, r: int) -> Shadow:
            tensors, state = {}, defaultdict(dict)
            for k, v in maps[r].items():
                master, st = read_partition(reader, lay, int(v["numel"]), saving[r][k])
                tensors[k] = master.to(dev)
                state[tensors[k]] = {n: x.to(dev) if torch.is_tensor(x) and x.dim() else _as_live(opt, n, x)
                                     for n, x in st.items()}
            return Shadow.given(tensors, [state])

        @torch.no_grad()
        def put(f: Frag, shadow: Shadow, key: str, src: int, at: int, n: int) -> None:
            t = shadow.tensors[key]
            f.master.narrow(0, at, n).copy_(t.narrow(0, src, n))
            live = opt.state[f.base_param]
            for name, v in shadow.state[0][t].items():
                if torch.is_tensor(v) and v.dim() >= 1 and v.numel() == t.numel():
                    if name not in live:    # the base had not stepped yet
                        live[name] = torch.zeros_like(f.base_param)
                    live[name].view(-1).narrow(0, f.offset + at, n).copy_(v.view(-1).narrow(0, src, n))
                else:                       # every saving rank has the same step count
                    live[name] = v.clone() if torch.is_tensor(v) else v

        held = [(integration.Span(f.name, f.start, f.numel, f.offset), f) for f in lay.frags]
        return integration.Partitions(saving, held, rebuild, put, follow)


def _as_live(opt, name: str, v):
    """A scalar of the optimizer state (e.g. Adam's step tensor) where the live state keeps it."""
    ref = next((s[name] for s in opt.state.values() if name in s), None)
    if torch.is_tensor(v) and torch.is_tensor(ref):
        return v.to(device=ref.device, dtype=ref.dtype)
    return v
