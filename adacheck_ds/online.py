"""Online gradient deltas for DeepSpeed engines (ZeRO 0-3, fp32 / bf16 / fp16).

The *base optimizer* (the torch optimizer inside DeepSpeed's wrappers) is what turns
gradients into new master weights and moments; an :class:`~adacheck.optimtap.OptimizerTap`
on it sees every call exactly as DeepSpeed makes it (ZeRO 1/2 step one param group at a
time, ZeRO-3 one sub-group flat at a time) with the gradients it consumed (after unscaling
and clipping).  The post-step point is ``engine.step``: when it has advanced
``global_steps`` the step is complete (a step the loss scaler skipped has no calls and
stores only its scalars).

Replay (recovery) makes the same calls again, then refreshes the low-precision weights with
DeepSpeed's own code for that optimizer (cast + all-gather for ZeRO 1/2, partition copy and
persistent-parameter gather for ZeRO-3) and sets the counters, scheduler, loss scaler,
hyper-parameters and RNG recorded after the last step.  No forward or backward pass runs.
Replay needs the saving ZeRO stage, optimizer wrapper and optimizer class.  ZeRO-0's
replicated optimizer replays on any number of data-parallel ranks; so do flat partitions
(ZeRO 1-3, BF16_Optimizer): each base of an online chain records what every rank's partitions
are made of, and a job on another data-parallel size rebuilds the saving ranks' partitions from
the base and steps them with their own records (``_replay_partitions``).  Loading into another
layout (tensor parallelism, stage, optimizer) restores the base and says so.
"""
from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from typing import Optional

import torch

from adacheck import online as O
from adacheck.checkpoint import CheckpointReader
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
        self.recorder = O.OnlineRecorder(self.tap, ac.config.online, self.save_dir, ac.comm, self._take_base,
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
EXPECT = {"counters": (lambda v: isinstance(v, dict) and all(O.is_int(x) for x in v.values()),
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


def recover(ac, ckpt_dir: str, manifest, latest: bool, saved_optimizer: Optional[str] = None) -> Optional[int]:
    """Replay the committed deltas of the base just loaded from ``ckpt_dir`` (collective).
    ``saved_optimizer``: the class of the base optimizer that recorded them (None: not known).
    Returns the step the engine is at afterwards."""
    e = ac.engine
    comm = ac.comm()
    world = int(manifest.topology.get("world_size", 1))
    strict = ac.config.on_corrupt != "fallback"
    steps, why, damage = O.chain(comm, ckpt_dir, manifest.step, world, until=ac.replay_until, strict=strict)
    refused = False
    if steps:
        lay = S.describe(e)
        fw = manifest.framework
        mine = S.class_path(lay.base_optimizer)
        # the same optimizer code makes the same arithmetic: a ZeRO-Offload run (DeepSpeedCPUAdam)
        # resumed without offload (torch's or DeepSpeed's fused Adam) would not replay bit-exactly
        same_optimizer = (fw.get("zero_stage"), fw.get("optimizer"), int(fw.get("tp_world_size", 1))) == \
            (lay.stage, lay.kind, lay.tp[1]) and saved_optimizer in (None, mine)
        # every rank of a replicated optimizer (ZeRO-0) applies the same full gradients, so its
        # deltas replay on any data-parallel size; those of flat partitions (ZeRO 1-3, the BF16
        # optimizer) on the saving ranks' partitions rebuilt here
        maps = _partition_maps(manifest) if lay.kind in S.FLAT_PARTITIONS else None
        if not same_optimizer or (world != comm.world_size and lay.kind not in _REPLICATED and maps is None):
            log.warning("AdaCheck: %s has %d committed delta steps (to step %d), recorded by ZeRO-%s/%s with %s "
                        "on %d ranks (TP=%s); they replay only with that layout and optimizer%s, so this %d-rank "
                        "ZeRO-%d/%s engine with %s (TP=%d) is at the base's step %s. The deltas are kept: load "
                        "with the saving configuration and save to reshape the newest state (or: adacheck "
                        "convert SRC NEW --to adacheck).",
                        ckpt_dir, len(steps), steps[-1].step, fw.get("zero_stage"), fw.get("optimizer"),
                        saved_optimizer or "its optimizer", world, fw.get("tp_world_size", 1),
                        " (ZeRO-0: on any data-parallel size)" if fw.get("optimizer") in _REPLICATED else
                        " (ZeRO 1-3: on any data-parallel size when saved by this version)"
                        if fw.get("optimizer") in S.FLAT_PARTITIONS else "",
                        comm.world_size, lay.stage, lay.kind, mine, lay.tp[1], manifest.step)
            steps, refused = [], True
    last_step = manifest.step
    result = None
    if steps:
        lay, tap = (ac.online.lay, ac.online.tap) if ac.online is not None else _tap(e)
        t0 = time.perf_counter()
        try:
            if world != comm.world_size and lay.kind not in _REPLICATED:
                result = _replay_partitions(ac, tap, lay, ckpt_dir, manifest, steps, maps)
            else:
                result = O.replay(comm, tap, ckpt_dir, steps, verify=ac.config.verify_on_load,
                                  preclip=lambda key, g, a: _preclip(e, g, a),
                                  record_rank=comm.rank if world == comm.world_size else
                                  _record_rank(manifest.layout.get("ranks", []), lay.tp[0], S.data_parallel(e)[0]),
                                  expect=EXPECT)
        finally:
            if ac.online is None:
                tap.remove()
        if result.last is not None:
            _refresh_low_precision(e, lay)
            ac.apply_scalars(result.last)
            if comm.rank < world:   # (as the base load: a rank the saving job did not have keeps its RNG)
                set_rng_state(result.last["rank_state"])
            last_step = result.steps[-1].step
            seconds = time.perf_counter() - t0
            ac.last_replay = {"steps": len(result.steps), "seconds": seconds,
                              "bytes": sum(s.bytes for s in result.steps)}
            O.describe_replay(result.steps, manifest.step, seconds, why)
    if ac.online is not None:
        rec = ac.online.recorder
        # continue that chain only where this job replayed it: going on after the base would
        # replace the committed deltas it could not replay (the next step takes a base instead);
        # a damaged chain is left as it is (the next step takes a base)
        damaged = damage is not None or (result is not None and result.damage is not None)
        if latest and not refused and not damaged and world == comm.world_size and \
                os.path.abspath(os.path.dirname(ckpt_dir)) == os.path.abspath(ac.online.save_dir):
            rec.start_chain(manifest.tag, int(manifest.step), resume_after=last_step)
        else:
            rec.base_step = None     # not the newest chain (or another world): the next step takes a base
        ac.online.tap.reindex()
    (result or O.Replayed([], None)).conclude(strict, ckpt_dir, manifest.step, damage)
    return last_step


def _partition_maps(manifest) -> Optional[list]:
    """Every saving rank's partition map (``S.partition_map``), or None when the base has none."""
    maps = [(ro or {}).get("partitions") for ro in manifest.rank_objects]
    return maps if maps and all(m is not None for m in maps) else None


def _replay_partitions(ac, tap: OptimizerTap, lay: S.Layout, ckpt_dir: str, manifest, steps, maps) -> dict:
    """Replay deltas of flat-partitioned optimizers (ZeRO 1-3, the BF16 optimizer) recorded on
    another number of data-parallel ranks (``O.replay_partitions``): the saving ranks'
    partitions that overlap this rank's (same tensor-parallel rank) are rebuilt from the base,
    stepped with their records, and the part this rank holds now is copied into its own
    partition: master weights and optimizer state.  ``Replayed.last`` is the record of the last
    step this rank follows (its own saving rank's, else the first of its TP rank)."""
    e = ac.engine
    verify = ac.config.verify_on_load
    saved = manifest.layout.get("ranks", [])
    opt = lay.base_optimizer
    dev = lay.frags[0].base_param.device if lay.frags else torch.device("cpu")
    saving = {r: {k: [O.Span(*p) for p in v["pieces"]] for k, v in pm.items()}
              for r, pm in enumerate(maps) if saved[r].get("tp_rank", 0) == lay.tp[0]}
    readers = []

    def rebuild(r: int) -> Shadow:
        if not readers:
            readers.append(CheckpointReader(ckpt_dir, manifest, verify=verify))
        tensors, state = {}, defaultdict(dict)
        for k, v in maps[r].items():
            master, st = S.read_partition(readers[0], lay, int(v["numel"]), saving[r][k])
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

    held = [(O.Span(f.name, f.start, f.numel, f.offset), f) for f in lay.frags]
    return O.replay_partitions(ac.comm(), tap, ckpt_dir, steps, saving, held, rebuild, put,
                               _record_rank(saved, lay.tp[0], S.data_parallel(e)[0]), verify=verify,
                               preclip=lambda key, g, a: _preclip(e, g, a), expect=EXPECT)


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
        holder = grad.view(grad.shape)
        holder.grad = grad
        opt.fp32_partitioned_groups_flat = list(flats) + [None] * (sub + 1 - len(flats))
        opt.fp32_partitioned_groups_flat[sub] = holder
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
