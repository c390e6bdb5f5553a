"""Online gradient deltas for DeepSpeed engines (ZeRO 0-3, fp32 / bf16 / fp16).

The *base optimizer* (the torch optimizer inside DeepSpeed's wrappers) is what turns
gradients into new master weights and moments; an :class:`~adacheck.optimtap.OptimizerTap`
on it sees every call exactly as DeepSpeed makes it (ZeRO 1/2 step one param group at a
time, ZeRO-3 one sub-group flat at a time) with the gradients it consumed (after unscaling
and clipping).  The post-step point is ``engine.step``: when it has advanced
``global_steps`` the step is complete (a step the loss scaler skipped has no calls and
stores only its scalars).

Replay (recovery: :func:`adacheck.recovery.recover`, with :class:`Replay` saying how this
engine replays) makes the same calls again, then refreshes the low-precision weights with
DeepSpeed's own code for that optimizer (cast + all-gather for ZeRO 1/2, partition copy and
persistent-parameter gather for ZeRO-3) and sets the counters, scheduler, loss scaler,
hyper-parameters and RNG recorded after the last step.  No forward or backward pass runs.
Replay needs the saving ZeRO stage, optimizer wrapper and optimizer class.  ZeRO-0's
replicated optimizer replays on any number of data-parallel ranks; so do flat partitions
(ZeRO 1-3, BF16_Optimizer): each base of an online chain records what every rank's partitions
are made of, and a job on another data-parallel size rebuilds the saving ranks' partitions from
the base and steps them with their own records (``Replay._partitions``).  Loading into another
layout (tensor parallelism, stage, optimizer) restores the base and says so.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Optional

import torch

from adacheck import online, recovery
from adacheck.errors import ConfigError
from adacheck.optimtap import OptimizerTap, Shadow
from adacheck.planner import place
from adacheck.rng import set_rng_state

from . import state as S

log = logging.getLogger("adacheck")

_REPLICATED = ("plain", "fp16unfused")   # every DP rank applies the same full gradients


def _tap(engine) -> tuple:
    lay = S.describe(engine)
    if lay.base_optimizer is None:
        raise ConfigError("adacheck.online needs an optimizer (the engine has none)")
    # ZeRO-3 puts its fp32 sub-group flats into the groups only inside step()
    extra = [list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or [])]
    # tensor-parallel ranks hold other slices under the same optimizer positions: keys carry the
    # TP rank, so equal keys mean the same tensor
    prefix = f"tp{lay.tp[0]}." if lay.tp[1] > 1 else ""
    return lay, OptimizerTap([lay.base_optimizer], prefix=prefix, extra=extra)


def _record_rank(saved: list, tp_rank: int, dp_rank: int) -> int:
    """Whose record a rank of a replicated optimizer follows when the data-parallel size changed:
    the saving rank at the same tensor-parallel rank, the same data-parallel rank if it had one."""
    same = [r for r, lay in enumerate(saved) if lay.get("tp_rank", 0) == tp_rank]
    return next((r for r in same if saved[r].get("dp_rank") == dp_rank), same[0] if same else 0)


def _kept(norm):
    """A gradient norm as recorded with a step (a copy: DeepSpeed may reuse the tensor)."""
    return norm.detach().clone() if torch.is_tensor(norm) else norm


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
        mine = None
        if self.lay.kind in _REPLICATED:   # stored once per data-parallel group, by a balanced choice
            me, dp = S.data_parallel(e)
            items = [(t.numel() * 4, k, list(range(dp))) for k, t in sorted(self.tap.tensors.items())]
            writers, _ = place(items, dp)
            mine = {k for k, w in writers.items() if w[0] == me}
        self.recorder = online.OnlineRecorder(self.tap, ac.config.online, self.save_dir, ac.comm, self._take_base,
                                         fsync=ac.config.fsync, mine=mine,
                                         preclip=lambda key, g, a: _preclip(e, g, a))
        self._orig_clip = None
        if self.lay.kind in ("zero12", "zero3", "fp16unfused") and not e.fp16_enabled():
            # record gradients before ZeRO unscales/clips them in place: they are exact bf16
            # values where the clipped ones are not (a dynamic fp16 loss scale is not replayable)
            self._orig_clip = e.optimizer.unscale_and_clip_grads
            e.optimizer.unscale_and_clip_grads = self._clip_unfused if self.lay.kind == "fp16unfused" else self._clip
        self._orig_norm_grads = None
        if self.lay.kind == "bf16opt" and all(g.dtype == torch.float32 for g in
                                              e.optimizer.fp32_groups_gradient_flat_partition):
            # BF16_Optimizer clips its fp32 gradient partitions in place right after asking for
            # them with for_clipping=True: record them before that (exact bf16 sums, 2 bytes each)
            self._orig_norm_grads = e.optimizer.get_grads_for_norm
            e.optimizer.get_grads_for_norm = self._bf16_norm_grads
        self._orig_step = e.step
        e.step = self._engine_step
        self._orig_destroy = getattr(e, "destroy", None)
        if self._orig_destroy is not None:
            e.destroy = self._destroy

    def _clip_unfused(self, total_norm, apply_scale=True):
        """FP16_UnfusedOptimizer.unscale_and_clip_grads(total_norm): scales every fp32 gradient."""
        if apply_scale:
            norm, clip = _kept(total_norm), float(self.engine.optimizer.clip_grad)
            for group in self.engine.optimizer.fp32_groups:
                for p in group:
                    key = self.tap.key_of(p)
                    if key is not None and p.grad is not None:
                        self.recorder.note_preclip(key, p.grad, {"norm": norm, "clip": clip, "unfused": True})
        return self._orig_clip(total_norm, apply_scale=apply_scale)

    def _clip(self, first, total_norm, *rest, **kw):
        norm, clip = _kept(total_norm), float(self.engine.optimizer.clip_grad)
        if self.lay.kind == "zero12":
            for g in first:
                key = next((self.tap.key_of(f) for f in self.engine.optimizer.single_partition_of_fp32_groups
                            if f.grad is g), None) if torch.is_tensor(g) else None
                if key is not None:
                    self.recorder.note_preclip(key, g, {"norm": norm, "clip": clip})
        else:
            flat = self.engine.optimizer.fp32_partitioned_groups_flat[first]
            key = self.tap.key_of(flat)
            if key is not None and flat.grad is not None:
                self.recorder.note_preclip(key, flat.grad, {"norm": norm, "clip": clip, "sub": int(first)})
        return self._orig_clip(first, total_norm, *rest, **kw)

    def _bf16_norm_grads(self, for_clipping=False, *args, **kwargs):
        out = self._orig_norm_grads(for_clipping, *args, **kwargs)
        opt = self.engine.optimizer
        if for_clipping and opt.clip_grad > 0:
            norm, clip = _kept(opt._global_grad_norm), float(opt.clip_grad)
            for flat, grad in zip(opt.fp32_groups_flat_partition, opt.fp32_groups_gradient_flat_partition):
                key = self.tap.key_of(flat)
                if key is not None:
                    self.recorder.note_preclip(key, grad, {"norm": norm, "clip": clip, "bf16_clip": True})
        return out

    def _engine_step(self, *args, **kwargs):
        e = self.engine
        before = e.global_steps
        self.recorder.expect(before + 1)
        out = self._orig_step(*args, **kwargs)
        if e.global_steps != before:
            self.recorder.after_step(int(e.global_steps), scalars(self.ac))
        return out

    def _take_base(self) -> None:
        t0 = time.perf_counter()
        self.ac.save_checkpoint(self.save_dir)   # starts the new chain (see AdaCheckDeepSpeed)
        log.info("AdaCheck online: base checkpoint at step %d in %.2fs", self.engine.global_steps,
                 time.perf_counter() - t0)

    def _destroy(self, *args, **kwargs):
        self.close()
        return self._orig_destroy(*args, **kwargs)

    def flush(self) -> None:
        self.recorder.flush()

    def close(self) -> None:
        self.recorder.close()
        self.engine.step = self._orig_step
        if self._orig_clip is not None:
            self.engine.optimizer.unscale_and_clip_grads = self._orig_clip
        if self._orig_norm_grads is not None:
            self.engine.optimizer.get_grads_for_norm = self._orig_norm_grads
        if self._orig_destroy is not None:
            self.engine.destroy = self._orig_destroy


def _optional_dict(v) -> bool:
    return v is None or isinstance(v, dict)


# the fields of a delta record that recover() restores (written by scalars())
EXPECT = {"counters": (lambda v: isinstance(v, dict) and all(recovery.is_int(x) for x in v.values()),
                       "an object of integer counters"),
          "lr_scheduler": (_optional_dict, "the scheduler's state (an object) or null"),
          "loss_scaler": (_optional_dict, "the loss scaler's state (an object) or null")}


def scalars(ac) -> dict:
    e = ac.engine
    return {"counters": {k: int(getattr(e, k)) for k in ("global_steps", "global_samples", "skipped_steps",
                                                          "micro_steps") if hasattr(e, k)},
            "lr_scheduler": (e.lr_scheduler.state_dict() if e.lr_scheduler is not None
                             and hasattr(e.lr_scheduler, "state_dict") else None),
            "loss_scaler": ac.scaler_state(),
            "skipped": not getattr(e, "_step_applied", True)}


class Replay:
    """How this engine replays the deltas of a base it loaded (adacheck.recovery.Replaying)."""
    expect = EXPECT

    def __init__(self, ac, saved_optimizer: Optional[str] = None):
        self.ac, self.engine, self.comm = ac, ac.engine, ac.comm()
        self.lay = S.describe(ac.engine)
        self.saved_optimizer = saved_optimizer   # the base optimizer's class that recorded (None: not known)
        self.saving_world = 0

    def plan(self, manifest) -> recovery.ReplayPlan:
        lay, comm, fw = self.lay, self.comm, manifest.framework
        world = self.saving_world = int(manifest.topology.get("world_size", 1))
        mine = S.class_path(lay.base_optimizer)
        same = world == comm.world_size
        # the same optimizer code makes the same arithmetic: a ZeRO-Offload run (DeepSpeedCPUAdam)
        # resumed without offload (torch's or DeepSpeed's fused Adam) would not replay bit-exactly
        if (fw.get("zero_stage"), fw.get("optimizer"), int(fw.get("tp_world_size", 1))) != \
                (lay.stage, lay.kind, lay.tp[1]) or self.saved_optimizer not in (None, mine):
            return recovery.ReplayPlan(same, refused=(
                f"they were recorded by ZeRO-{fw.get('zero_stage')}/{fw.get('optimizer')} with "
                f"{self.saved_optimizer or 'its optimizer'} (TP={fw.get('tp_world_size', 1)}), which this "
                f"ZeRO-{lay.stage}/{lay.kind} engine with {mine} (TP={lay.tp[1]}) is not"))
        if same:
            return recovery.ReplayPlan(True)
        saved = manifest.layout.get("ranks", [])
        if lay.kind in _REPLICATED:
            # every rank of a replicated optimizer (ZeRO-0) applies the same full gradients: its
            # deltas replay on any data-parallel size
            mine_at = {"tp_rank": lay.tp[0], "dp_rank": S.data_parallel(self.engine)[0]}
            return recovery.ReplayPlan(False, record_rank=recovery.follow_rank(saved, mine_at, ("tp_rank",)))
        # those of flat partitions (ZeRO 1-3, the BF16 optimizer) on the saving ranks' partitions
        # rebuilt here, from bases that record them
        maps = [(ro or {}).get("partitions") for ro in manifest.rank_objects]
        if lay.kind in S.FLAT_PARTITIONS and maps and all(m is not None for m in maps):
            return recovery.ReplayPlan(False, partitions=lambda: self._partitions(saved, maps))
        return recovery.ReplayPlan(False, refused=f"they were recorded on {world} ranks and replay on another number "
                                                  "of data-parallel ranks only from a base saved by this version")

    def tap(self) -> OptimizerTap:
        return _tap(self.engine)[1]

    def preclip(self, key: str, grad: torch.Tensor, args: dict) -> None:
        _preclip(self.engine, grad, args)

    def restore(self, last: dict, plan: recovery.ReplayPlan) -> None:
        _refresh_low_precision(self.engine, self.lay)
        self.ac.apply_scalars(last)
        if self.comm.rank < self.saving_world:   # (as the base load: a rank the saving job did not have keeps its RNG)
            set_rng_state(last["rank_state"])

    def _partitions(self, saved: list, maps: list) -> recovery.Partitions:
        """The saving ranks' flat partitions (ZeRO 1-3, the BF16 optimizer) at this rank's
        tensor-parallel rank, rebuilt from the base: master weights and optimizer state."""
        lay = self.lay
        opt = lay.base_optimizer
        dev = lay.frags[0].base_param.device if lay.frags else torch.device("cpu")
        saving = {r: {k: [recovery.Span(*p) for p in v["pieces"]] for k, v in pm.items()}
                  for r, pm in enumerate(maps) if saved[r].get("tp_rank", 0) == lay.tp[0]}

        def rebuild(reader, r: int) -> Shadow:
            tensors, state = {}, defaultdict(dict)
            for k, v in maps[r].items():
                master, st = S.read_partition(reader, lay, int(v["numel"]), saving[r][k])
                tensors[k] = master.to(dev)
                state[tensors[k]] = {n: x.to(dev) if torch.is_tensor(x) and x.dim() else _as_live(opt, n, x)
                                     for n, x in st.items()}
            return Shadow.given(tensors, [state])

        @torch.no_grad()
        def put(f: S.Frag, shadow: Shadow, key: str, src: int, at: int, n: int) -> None:
            t = shadow.tensors[key]
            f.master.narrow(0, at, n).copy_(t.narrow(0, src, n))
            live = opt.state[f.base_param]
            for name, v in shadow.state[0][t].items():
                if torch.is_tensor(v) and v.dim() >= 1 and v.numel() == t.numel():
                    if name not in live:    # the base had not stepped yet
                        live[name] = torch.zeros_like(f.base_param)
                    live[name].view(-1).narrow(0, f.offset + at, n).copy_(v.view(-1).narrow(0, src, n))
                else:                       # (every saving rank has the same step count)
                    live[name] = v.clone() if torch.is_tensor(v) else v

        held = [(recovery.Span(f.name, f.start, f.numel, f.offset), f) for f in lay.frags]
        mine_at = {"tp_rank": lay.tp[0], "dp_rank": S.data_parallel(self.engine)[0]}
        return recovery.Partitions(saving, held, rebuild, put, recovery.follow_rank(saved, mine_at, ("tp_rank",)))


def _as_live(opt, name: str, v):
    """A scalar of the optimizer state (e.g. Adam's step tensor) where the live state keeps it."""
    ref = next((s[name] for s in opt.state.values() if name in s), None)
    if torch.is_tensor(v) and torch.is_tensor(ref):
        return v.to(device=ref.device, dtype=ref.dtype)
    return v


def _preclip(engine, grad: torch.Tensor, args: dict) -> None:
    """Unscale/clip ``grad`` in place exactly as ZeRO did while recording (its own code, with the
    recorded ``gradient_clipping``: a job resumed with another value replays the recorded steps)."""
    opt = engine.optimizer
    current = opt.clip_grad
    opt.clip_grad = args.get("clip", current)     # (records of earlier versions: the engine's value)
    try:
        _clip_as_recorded(opt, grad, args)
    finally:
        opt.clip_grad = current


def _clip_as_recorded(opt, grad: torch.Tensor, args: dict) -> None:
    norm = args["norm"]
    if torch.is_tensor(norm):
        norm = norm.to(grad.device)
    if args.get("unfused"):      # FP16_UnfusedOptimizer: its scale for that norm, applied as it does
        combined = type(opt).unscale_and_clip_grads(opt, norm, apply_scale=False)
        grad.mul_(1. / combined)
        return
    if args.get("bf16_clip"):    # BF16_Optimizer.step's clipping, with the function it calls
        from deepspeed.runtime import bf16_optimizer
        bf16_optimizer.clip_tensors_by_global_norm(input_tensors=[grad], max_norm=opt.clip_grad,
                                                   global_norm=norm, mpu=opt.mpu)
        return
    clip = type(opt).unscale_and_clip_grads     # the class's, not a recording wrapper
    if "sub" in args:
        # ZeRO-3 scales the .grad of its fp32 sub-group flat number ``sub``: let that be a
        # stand-in holding ``grad`` (a saving rank's partition may have another size than ours)
        sub, flats = args["sub"], opt.fp32_partitioned_groups_flat
        opt.fp32_partitioned_groups_flat = list(flats) + [None] * (sub + 1 - len(flats))
        opt.fp32_partitioned_groups_flat[sub] = recovery.holder(grad)
        try:
            clip(opt, sub, norm)
        finally:
            opt.fp32_partitioned_groups_flat = flats
    else:
        clip(opt, [grad], norm)


@torch.no_grad()
def _refresh_low_precision(engine, lay: S.Layout) -> None:
    """Module weights from the master weights, with DeepSpeed's own code for the wrapper."""
    opt = engine.optimizer
    if lay.kind == "plain":
        return
    if lay.kind == "fp16unfused":
        for lps, masters in zip(opt.fp16_groups, opt.fp32_groups):
            for p, m in zip(lps, masters):
                p.data.copy_(m.data)
    elif lay.kind in ("zero12", "bf16opt"):
        opt.update_lp_params()
    elif lay.kind == "zero3":
        opt._partition_all_parameters()
        for i in range(len(opt.fp32_partitioned_groups_flat)):
            opt._reassign_or_swap_out_partitioned_parameters(i)
        if opt.persistent_parameters:      # small parameters stay gathered between steps
            opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
        opt.invalidate_secondary_tensor()
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
