"""Online gradient deltas for DeepSpeed engines (ZeRO 0-3, fp32 / bf16 / fp16).

Where the deltas come from: the *base optimizer* (the torch optimizer inside DeepSpeed's
wrappers) is what turns gradients into new master weights and moments.  A step pre-hook
on it (``register_step_pre_hook``) sees every call exactly as DeepSpeed makes it (ZeRO
1/2 step one param group at a time, ZeRO-3 one sub-group flat at a time): which groups
were active, their hyper-parameters at that moment, which tensors were in them, and the
gradients they carried (after unscaling and clipping: what was consumed).  The post-step
point is ``engine.step``: when it has advanced ``global_steps`` the step is complete and
its delta is handed to the writer (a step the loss scaler skipped has no calls and
stores only its scalars).

Replay (recovery) makes the same calls on the same base optimizer with the same gradients
and hyper-parameters, then refreshes the low-precision weights with DeepSpeed's own code
for that optimizer (cast + all-gather for ZeRO 1/2, partition copy for ZeRO-3), and sets
the counters, scheduler, loss scaler, hyper-parameters and RNG recorded after the last
step.  No forward or backward pass runs.  Replay needs the saving layout (same ZeRO stage,
optimizer wrapper and data-parallel size); loading into another layout restores the base.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Dict, List, Optional

import torch

from adacheck import deltas as D
from adacheck import jsontree
from adacheck.errors import ConfigError, StateError
from adacheck.planner import place
from adacheck.rng import rng_state, set_rng_state

from . import state as S

log = logging.getLogger("adacheck")

_REPLICATED = ("plain", "fp16unfused")   # every DP rank applies the same full gradients


class Replayer:
    """The base optimizer's tensors under stable keys, and the replay of recorded steps."""

    def __init__(self, ac):
        self.ac = ac
        self.engine = e = ac.engine
        self.lay = S.describe(e)
        if self.lay.base_optimizer is None:
            raise ConfigError("adacheck.online needs an optimizer (the engine has none)")
        self.base = self.lay.base_optimizer
        self.tensors: Dict[str, torch.Tensor] = {}
        self._key_of: Dict[int, str] = {}
        self.reindex()
        for gi, g in enumerate(self._groups):
            for j, p in enumerate(g["params"]):
                self._name(p, f"g{gi}.p{j}")
        for k, flat in enumerate(getattr(e.optimizer, "fp32_partitioned_groups_flat", None) or []):
            self._name(flat, f"sub{k}")          # ZeRO-3 puts these into the groups only inside step()
        self.replicated = self.lay.kind in _REPLICATED
        self.rank, self.world = _rank_world()
        self.replaying = False

    def reindex(self) -> None:
        """Know the base optimizer's param-group dicts again (load_state_dict replaces them)."""
        self._groups = list(self.base.param_groups)
        self._group_index = {id(g): i for i, g in enumerate(self._groups)}

    def _name(self, t: torch.Tensor, key: str) -> None:
        self._key_of.setdefault(id(t), key)
        self.tensors.setdefault(key, t)

    def read_step(self, ckpt_dir: str, st: D.Step, verify: bool, files: dict):
        """(this rank's decoded record, {key: gradient}) of one step; changes nothing."""
        tree = D.read_extra(ckpt_dir, st, self.rank, verify=verify)
        grads = {}
        for call in tree["calls"]:
            for gi, hyper, keys, with_grad in call:
                if gi >= len(self._groups) or any(k not in self.tensors for k in keys):
                    raise StateError(f"delta step {st.step} names optimizer tensors this engine does not "
                                     "have; it was recorded by a different model or optimizer")
                for k in with_grad:
                    g = D.read_grad(ckpt_dir, st, k, self.rank, verify, files)
                    if g.numel() != self.tensors[k].numel():
                        raise StateError(f"delta step {st.step}: gradient {k} has {g.numel()} elements, "
                                         f"the engine's tensor {self.tensors[k].numel()}")
                    grads[k] = g
        return tree, grads

    def apply_step(self, tree: dict, grads: dict) -> None:
        self.replaying = True
        try:
            for call in tree["calls"]:
                self._replay_call(call, grads)
        finally:
            self.replaying = False

    def finish(self, last: dict) -> None:
        """After the last replayed step: module weights, counters, scheduler, RNG."""
        _refresh_low_precision(self.engine, self.lay)
        self.ac._apply_scalars(last)
        for g, saved in zip(self._groups, last["param_groups"]):
            g.update(saved)
        set_rng_state(last["rng"])

    def _replay_call(self, call, grads) -> None:
        saved_groups = self.base.param_groups
        saved_params = [(g, g["params"]) for g in self._groups]
        try:
            active = []
            for gi, hyper, keys, with_grad in call:
                g = self._groups[gi]
                g.update(hyper)
                g["params"] = [self.tensors[k] for k in keys]
                for k in with_grad:
                    t = self.tensors[k]
                    t.grad = grads[k].to(t.device).view(t.shape)
                active.append(g)
            self.base.param_groups = active
            self.base.step()
        finally:
            self.base.param_groups = saved_groups
            for g, params in saved_params:
                for p in g["params"]:
                    p.grad = None
                g["params"] = params


class OnlineDS(Replayer):
    """The online mode of one engine (``engine.adacheck.online``)."""

    def __init__(self, ac):
        super().__init__(ac)
        e = self.engine
        self.config = ac.config.online
        if not ac.config.save_dir:
            raise ConfigError("adacheck.online needs adacheck.save_dir: deltas are written after every "
                              "step, before any save_checkpoint call names a directory")
        self.save_dir = ac.config.save_dir
        self.mine = self._plan()
        self.calls: List[list] = []
        self.step_seconds = 0.0
        self._t0 = None
        self.log: Optional[D.DeltaLog] = None
        self.base_step: Optional[int] = None
        self.base_tag: Optional[str] = None
        self.interval: Optional[int] = (self.config.base_interval
                                        if self.config.base_interval != "auto" else None)
        self.chain_info: dict = {}
        self._pre = self.base.register_step_pre_hook(self._pre_step)
        self._post = self.base.register_step_post_hook(self._post_step)
        self._orig_step = e.step
        e.step = self._engine_step
        self._orig_destroy = getattr(e, "destroy", None)
        if self._orig_destroy is not None:
            e.destroy = self._destroy

    def _destroy(self, *args, **kwargs):
        self.close()
        return self._orig_destroy(*args, **kwargs)

    def _plan(self) -> Optional[set]:
        """Keys whose gradients this rank stores (None: all it applies, nothing replicated)."""
        if not self.replicated:
            return None
        items = [(t.numel() * 4, k, list(range(self.world))) for k, t in sorted(self.tensors.items())]
        writers, _ = place(items, self.world)
        return {k for k, w in writers.items() if w[0] == self.rank}

    def close(self) -> None:
        self._pre.remove()
        self._post.remove()
        self.engine.step = self._orig_step
        if self._orig_destroy is not None:
            self.engine.destroy = self._orig_destroy
        if self.log is not None:
            self.log.close()
            self.log = None

    # ------------------------------------------------------------------ recording
    def _pre_step(self, opt, args, kwargs):
        if self.replaying:
            return
        self._t0 = time.perf_counter()
        if self.log is not None:
            self.log.begin(self.engine.global_steps + 1)
        call = []
        for g in opt.param_groups:
            gi = self._group_index.get(id(g))
            if gi is None:
                raise StateError("AdaCheck online: the optimizer stepped a param group it did not have "
                                 "when the engine was built; online deltas cannot follow that")
            keys, grads = [], []
            for p in g["params"]:
                k = self._key_of.get(id(p))
                if k is None:
                    raise StateError("AdaCheck online: the optimizer stepped a tensor unknown at start-up")
                keys.append(k)
                if p.grad is not None:
                    grads.append(k)
                    if self.log is not None and (self.mine is None or k in self.mine):
                        self.log.add(k, p.grad)
            call.append([gi, {k: v for k, v in g.items() if k != "params"}, keys, grads])
        self.calls.append(call)

    def _post_step(self, opt, args, kwargs):
        if not self.replaying and self._t0 is not None:
            self.step_seconds += time.perf_counter() - self._t0
            self._t0 = None

    def _engine_step(self, *args, **kwargs):
        e = self.engine
        before = e.global_steps
        out = self._orig_step(*args, **kwargs)
        if e.global_steps != before:
            self._after_step()
        return out

    def _scalars(self) -> dict:
        e = self.engine
        return {"counters": {k: int(getattr(e, k)) for k in ("global_steps", "global_samples",
                                                              "skipped_steps", "micro_steps") if hasattr(e, k)},
                "lr_scheduler": (e.lr_scheduler.state_dict() if e.lr_scheduler is not None
                                 and hasattr(e.lr_scheduler, "state_dict") else None),
                "loss_scaler": self.ac._scaler_state(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self._groups],
                "skipped": not getattr(e, "_step_applied", True)}

    def _after_step(self) -> None:
        step = self.engine.global_steps
        calls, self.calls = self.calls, []
        if self.base_step is None or self._base_due(step):
            if self.log is not None:
                self.log.discard()
            self._take_base()
            return
        tree = dict(self._scalars(), calls=calls, rng=rng_state())
        enc, tensors = jsontree.encode(tree, "rank/")
        if self.log is not None:
            self.log.submit(step, enc, dict(tensors))
        if self.interval is None and step == self.base_step + 2:
            self._decide_interval()

    def _base_due(self, step: int) -> bool:
        return self.interval is not None and step - self.base_step >= self.interval

    def _take_base(self) -> None:
        t0 = time.perf_counter()
        self.ac.save_checkpoint(self.save_dir)   # starts the new chain (start_chain)
        log.info("AdaCheck online: base checkpoint at step %d in %.2fs", self.engine.global_steps,
                 time.perf_counter() - t0)

    def _decide_interval(self) -> None:
        """``base_interval: "auto"``: one collective after the first delta of a chain."""
        from adacheck.deltas import auto_interval
        comm = self.ac.comm()
        mine = {"bytes": 0, "seconds": self.step_seconds}
        if self.log is not None:
            self.log.flush()
            mine["bytes"] = self.log.bytes_written
        allr = comm.all_gather_object(mine)
        delta_bytes = sum(a["bytes"] for a in allr)
        info = self.chain_info
        base_bytes, base_seconds = info.get("base_bytes", 0), info.get("base_seconds", 0.0)
        read_seconds = delta_bytes * base_seconds / base_bytes if base_bytes else 0.0
        replay = max(a["seconds"] for a in allr) + read_seconds
        self.interval = auto_interval(base_bytes, base_seconds, delta_bytes, replay)
        log.info("AdaCheck online: base_interval auto = %d (base %d B in %.2fs; delta %d B, "
                 "replay ~%.3fs per step)", self.interval, base_bytes, base_seconds, delta_bytes, replay)

    # ------------------------------------------------------------------ chains
    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()

    def start_chain(self, tag: str, step: int, base_bytes: int, base_seconds: float,
                    resume_after: Optional[int] = None) -> None:
        """Deltas from now on belong to the base ``tag`` (collective)."""
        comm = self.ac.comm()
        if self.log is not None:
            self.log.close()
            self.log = None
        ckpt_dir = os.path.join(self.save_dir, tag)
        if resume_after is None:
            info = {"base_tag": tag, "base_step": step, "base_bytes": base_bytes,
                    "base_seconds": base_seconds, "world_size": self.world}
            if comm.rank == 0:
                D.write_chain(ckpt_dir, info, fsync=self.ac.config.fsync)
        else:
            info = D.read_chain(ckpt_dir) or {"base_bytes": base_bytes, "base_seconds": base_seconds}
            if comm.rank == 0:
                D.remove_steps_after(ckpt_dir, resume_after)
        nonce = comm.broadcast_object(os.urandom(8).hex() if comm.rank == 0 else None)
        comm.barrier()
        self.chain_info = info
        self.base_tag, self.base_step = tag, step
        self.step_seconds = 0.0
        if self.config.base_interval == "auto":
            self.interval = None
        self.log = D.DeltaLog(ckpt_dir, self.rank, nonce, fsync=self.ac.config.fsync,
                              queue_depth=self.config.queue_depth, compact=self.config.compact,
                              on_error=self.config.on_error)



def recover(ac, ckpt_dir: str, manifest, latest: bool) -> Optional[int]:
    """Replay the committed deltas of the base just loaded from ``ckpt_dir`` (collective).
    Returns the step the engine is at afterwards."""
    from adacheck.exchange import agree
    e = ac.engine
    comm = ac.comm()
    world = int(manifest.topology.get("world_size", 1))
    steps, why = D.committed_steps(ckpt_dir, manifest.step, world)
    n = min(comm.all_gather_object(len(steps)))      # every rank replays the same steps
    steps = steps[:n]
    rep = ac.online
    if rep is not None:
        rep.reindex()
    if steps:
        lay = S.describe(e)
        fw = manifest.framework
        if (world, fw.get("zero_stage"), fw.get("optimizer")) != (comm.world_size, lay.stage, lay.kind):
            log.warning("AdaCheck: %s has %d committed delta steps (to step %d), recorded by ZeRO-%s/%s on %d "
                        "ranks; they replay only in that layout, so this %d-rank ZeRO-%d/%s engine is at the "
                        "base's step %s. Load with the saving layout and save to reshape the newest state.",
                        ckpt_dir, len(steps), steps[-1].step, fw.get("zero_stage"), fw.get("optimizer"),
                        world, comm.world_size, lay.stage, lay.kind, manifest.step)
            steps = []
    last_step = manifest.step
    if steps:
        if rep is None:
            rep = Replayer(ac)
        rep.reindex()
        t0 = time.perf_counter()
        files: dict = {}
        verify = ac.config.verify_on_load
        last = None
        for st in steps:
            tree, grads = agree(comm, f"AdaCheck replay of delta step {st.step} from {ckpt_dir} (read)",
                                lambda: rep.read_step(ckpt_dir, st, verify, files))
            rep.apply_step(tree, grads)
            last = tree
        rep.finish(last)
        last_step = steps[-1].step
        ac.last_replay = {"steps": len(steps), "seconds": time.perf_counter() - t0,
                          "bytes": sum(s.bytes for s in steps)}
        lossy = [s for s in steps if s.lossy]
        log.warning("AdaCheck: replayed %d gradient deltas (steps %d-%d) on base step %s in %.2fs%s",
                    len(steps), steps[0].step, last_step, manifest.step, time.perf_counter() - t0,
                    "" if why == "end of the log" else f"; the log stops there: {why}")
        if lossy:
            log.warning("AdaCheck: APPROXIMATE recovery: %d of these deltas were stored in compact (lossy "
                        "bf16) form; largest gradient rounding error %.3g", len(lossy),
                        max(s.max_abs_error() for s in lossy))
    if ac.online is not None:
        if latest and os.path.abspath(os.path.dirname(ckpt_dir)) == os.path.abspath(ac.online.save_dir):
            ac.online.start_chain(manifest.tag, int(manifest.step), 0, 0.0, resume_after=last_step)
        else:
            ac.online.base_step = None     # not the newest chain: the next step takes a base
    return last_step


def _rank_world():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
