"""AdaCheck behind DeepSpeedEngine.save_checkpoint / load_checkpoint."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Dict, Optional

import deepspeed
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import logger as ds_logger

import adacheck
from adacheck import checkpoint as core, jobs
from adacheck.integration import LocalState, Restore
from adacheck.format import jsontree
from adacheck.checkpoint import lifecycle
from adacheck.storage import pointer
from adacheck.online import recovery
from adacheck.storage.commit import latest_or_none, leave_file
from adacheck.config import AdaCheckConfig
from adacheck.plan.exchange import default_comm
from adacheck.checkpoint.rng import rng_state, set_rng_state
from adacheck.storage.backends import is_url

from . import zero_to_fp32
from .online import OnlineDS, Replay
from .saved import Objects, RankObjects, SavedModel, Scalars
from .wrappers import wrapper_of
from .wrappers.base import checkpoint_event
from .state import (Staged, apply_load, class_path, collect_shards, data_parallel, describe, module_names, named,
                    moe_layers, partition_map, pipeline, pipeline_layers, refuse_engine, stage_load,
                    tied_parameters)

log = logging.getLogger("adacheck")

# ZeRO's loss scaler (DynamicLossScaler / LossScaler) and the fp16 optimizers' LossScaleConfig
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_factor",
                  "scale_window", "min_scale", "delayed_shift", "consecutive_hysteresis", "dynamic",
                  "dynamic_loss_scale", "min_loss_scale")
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


def _counter(v):
    """An engine counter as it keeps it: an int, or a float (DeepSpeed's sample count under
    sequence parallelism, whose batch size it divides by the sequence-parallel size)."""
    return float(v) if isinstance(v, float) else int(v)


def _plain(v):
    """A one-element tensor of a loss scaler as the number it holds."""
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


# DeepSpeedEngine's own methods that adacheck_ds.install() replaced, by name (filled there)
DEEPSPEED_METHODS: dict = {}


def _native(method: str):
    """DeepSpeed's own DeepSpeedEngine method: the one adacheck_ds.install() replaced (another
    wrapper put over the engine's method later, e.g. with functools.wraps, is skipped: through
    it the native load would call AdaCheck's again, without end)."""
    if method in DEEPSPEED_METHODS:
        return DEEPSPEED_METHODS[method]
    found = getattr(DeepSpeedEngine, method)
    return getattr(found, "__wrapped__", found)


def save_native(engine, *args, **kwargs):
    """DeepSpeed's own save_checkpoint, whatever is attached."""
    return _native("save_checkpoint")(engine, *args, **kwargs)


def load_native(engine, *args, **kwargs):
    """DeepSpeed's own load_checkpoint, whatever is attached."""
    return _native("load_checkpoint")(engine, *args, **kwargs)


def leave_script(store, save_dir: str) -> None:
    """``zero_to_fp32.py`` in the save directory (once), as DeepSpeed leaves its own there: it
    writes the fp32 weights of the checkpoints beside it with only AdaCheck's core installed."""
    with open(zero_to_fp32.__file__, "rb") as f:
        leave_file(save_dir, "zero_to_fp32.py", f.read(), store)


def param_dict(config_class) -> Optional[dict]:
    """The DeepSpeed config as given (a DeepSpeedConfig's ``_param_dict``), or None."""
    raw = getattr(config_class, "_param_dict", None)
    return raw if isinstance(raw, dict) else None


def _native_checkpoint(load_dir: str, tag) -> Optional[str]:
    """The directory of a native DeepSpeed checkpoint that ``load_checkpoint(load_dir, tag)``
    means (DeepSpeed's 'latest' and AdaCheck's have the same name and content), or None."""
    if is_url(load_dir):
        return None      # DeepSpeed's loader reads local files only
    tag = str(tag) if tag is not None else latest_or_none(load_dir)   # damaged: AdaCheck's load reports it
    if tag is None or os.path.basename(tag) != tag or tag in ("", ".", ".."):
        return None
    d = os.path.join(load_dir, tag)
    if not os.path.isdir(d) or os.path.exists(os.path.join(d, "manifest.json")):
        return None
    return d if any(f.endswith("model_states.pt") for f in os.listdir(d)) else None


def _latest_universal(load_dir: str) -> Optional[str]:
    """The tag DeepSpeed's load takes with ``checkpoint.load_universal`` and no tag: what
    ``load_dir/latest_universal`` names (DeepSpeed's universal conversion writes it), or None."""
    path = os.path.join(load_dir, "latest_universal")
    if is_url(load_dir) or not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def agreed_tag(engine, tag: str) -> str:
    """The one tag of this save, as DeepSpeed's ``checkpoint.tag_validation`` asks when ranks
    name different tags: "FAIL" raises a TagMismatchError (an AssertionError, as DeepSpeed
    raises) on every rank; "WARN" and "IGNORE" save under rank 0's tag, with a warning for
    "WARN" (DeepSpeed's own save writes each rank's files under its own tag: AdaCheck's
    checkpoint is one for all ranks)."""
    tags = default_comm().all_gather_object(tag)
    if len(set(tags)) == 1:
        return tag
    named = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags[:8])) + (", ..." if len(tags) > 8 else "")
    if engine.checkpoint_tag_validation_fail():
        raise adacheck.TagMismatchError(
            f"the ranks named different checkpoint tags ({named}), and checkpoint.tag_validation is FAIL: "
            "pass the same tag on every rank (a tag with rank-specific parts cannot be loaded into another "
            "number of ranks)")
    if engine.checkpoint_tag_validation_enabled():
        log.warning("AdaCheck: the ranks named different checkpoint tags (%s); saving under rank 0's, %r "
                    "(checkpoint.tag_validation: WARN)", named, tags[0])
    return tags[0]


class _Load(Restore):
    """One ``engine.load_checkpoint`` of an AdaCheck checkpoint: every rank stages its part of the
    engine's state (``read``), then applies it with the counters, scheduler, loss scaler and RNG
    state (``apply``), as the load's arguments ask."""

    def __init__(self, ada, load_dir: str, want_optim: bool, strict: bool, module_only: bool,
                 with_scheduler: bool, everywhere):
        self.ada, self.load_dir, self.want_optim, self.strict = ada, load_dir, want_optim, strict
        self.module_only, self.with_scheduler, self.everywhere = module_only, with_scheduler, everywhere

    def read(self, reader) -> Staged:
        e = self.ada.engine
        return stage_load(e, reader, self.want_optim, self.strict, default_comm().rank, self.everywhere)

    def apply(self, st: Staged) -> Objects:
        e = self.ada.engine
        with checkpoint_event(e.optimizer):
            apply_load(e, st)
        if not self.module_only:
            self.ada.apply_scalars(st.objects, self.with_scheduler)
            if st.rank_objects is not None:
                set_rng_state(st.rank_objects.rng)
        return st.objects

    def how_to_load(self, tag: str, manifest) -> str:
        return f"engine.load_checkpoint({self.load_dir!r}, tag={tag!r})"


class AdaCheckDeepSpeed:
    """The AdaCheck checkpointer attached to one engine (``engine.adacheck``)."""

    def __init__(self, engine, config: AdaCheckConfig):
        refuse_engine(engine)   # at deepspeed.initialize, not at the first save
        self.engine = engine
        self.config = config
        self.checkpointer = jobs.checkpointer(core.Options.from_config(config))   # this engine's job
        self.checkpointer.on_saved = self._said
        lifecycle.register()      # writers closed and gloo settled when the script ends
        self.last_replay = None     # {"steps", "seconds", "bytes"} of the last load's delta replay
        self.replay_until = None    # load replays committed deltas up to this step (None: all)
        if config.save_dir:
            self.checkpointer.check_writable(default_comm(), config.save_dir)   # not hours later
        self.online = OnlineDS(self) if config.online.enabled else None
        if self.online is not None or config.async_save or config.tiers.memory:
            # one hook on the engine's step and destroy: the online mode records each step, a
            # finished background save is reported at the next step (cheap when none is), and
            # destroy waits for it while the process groups still exist (with the memory tier:
            # and persists the newest memory checkpoint, then frees the memory).  A PipelineEngine
            # steps inside train_batch (its own step() refuses to be called)
            self._stepper = "train_batch" if isinstance(engine, PipelineEngine) else "step"
            self._step, self._destroy = getattr(engine, self._stepper), getattr(engine, "destroy", None)
            setattr(engine, self._stepper, self._on_step)
            if self._destroy is not None:
                engine.destroy = self._finish_and_destroy

    def _on_step(self, *args, **kwargs):
        before, online = self.engine.global_steps, self.online
        if online is not None:
            online.recorder.expect(before + 1)
        out = self._step(*args, **kwargs)
        if online is not None and self.engine.global_steps != before:
            online.after_step()
        self.checkpointer.poll()     # one attribute test when no save is in flight
        return out

    def _finish_and_destroy(self, *args, **kwargs):
        self.finish()
        if self.checkpointer.has_tiers:
            if self.online is not None:
                self.online.flush()       # its last steps go to durable storage with their base
            self.checkpointer.tier.close()
        if self.online is not None:
            self.online.close()
        setattr(self.engine, self._stepper, self._step)
        self.engine.destroy = self._destroy
        return self._destroy(*args, **kwargs)

    def _said(self, report: dict) -> None:
        """A save committed: its line in DeepSpeed's log too (rank 0), unless the "adacheck"
        logger already shows it."""
        if self.engine.global_rank == 0 and not (log.isEnabledFor(logging.INFO) and log.hasHandlers()):
            ds_logger.info(core.describe_save(report))

    @property
    def last_save(self) -> Optional[dict]:
        """What the last committed save cost (an asynchronous one: once reported): ``tag``,
        ``step``, ``dir``, ``async``, ``stored_bytes`` (written by it), ``logical_bytes`` (of the
        state), ``held_bytes`` (all ranks' copies), ``stall_s`` (the training loop waited),
        ``commit_s`` (from the call to its commit); None before the first."""
        return self.checkpointer.last_save

    @property
    def last_manifest(self):
        """The manifest of the last save that committed (an asynchronous one: once reported)."""
        return self.checkpointer.last_committed

    def finish(self):
        """Wait for the asynchronous save in flight (if any) and report it."""
        return self.checkpointer.finish()

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        """``engine.save_checkpoint``, saved by AdaCheck (collective, as DeepSpeed's).

        Args:
            save_dir: the checkpoint directory; with ``adacheck.save_dir`` set, another directory
                (a Trainer's ``checkpoint-N``) that gets a pointer to the save there.
            tag: the checkpoint's name (default ``global_step<N>``); ranks that name different
                tags are handled as ``checkpoint.tag_validation`` says.
            client_state: JSON-able values and tensors kept with it, returned by the load.
            save_latest: point ``latest`` at it once committed.
            exclude_frozen_parameters: leave out parameters without gradients.

        Returns:
            True, as DeepSpeed's save (with ``async_save`` once the snapshot is taken: the
            commit follows in the background).
        """
        e = self.engine
        given, save_dir = save_dir, self.config.directory(save_dir, "save_checkpoint",
                                                          "pass one or set adacheck.save_dir")
        tag = agreed_tag(e, str(tag) if tag is not None else f"global_step{e.global_steps}")
        if given and default_comm().rank == 0:
            # a save into another directory, e.g. a Hugging Face Trainer's checkpoint-N: it holds a pointer
            pointer.leave(self.checkpointer.where, given, save_dir, tag, e.global_steps)
        collect = lambda: self._collect(client_state, exclude_frozen_parameters)   # noqa: E731
        hooks = checkpoint_event(e.optimizer) if wrapper_of(e).save_hooks else contextlib.nullcontext()
        with hooks:         # an async save's snapshot is taken inside
            if self.config.async_save and self.online is None:
                self.checkpointer.save_async(default_comm(), save_dir, tag, collect, update_latest=save_latest)
            else:
                self.checkpointer.save(
                    default_comm(), save_dir, tag, collect, update_latest=save_latest,
                    recorder=self.online.recorder if self.online is not None else None)
        if default_comm().rank == 0:
            leave_script(*self.checkpointer.locate(save_dir))
        return True

    def _collect(self, client_state, exclude_frozen):
        e = self.engine
        lay = describe(e)
        shards = collect_shards(e, lay)
        if exclude_frozen:
            frozen = {f"model/{n}" for n, p in named(e) if not p.requires_grad}
            shards = [s for s in shards if s.name not in frozen]
        strict = self.config.strict_objects
        now = self.scalars()
        objects = Objects(
            counters=now.counters, loss_scaler=now.loss_scaler,
            lr_scheduler=(jsontree.saveable(now.lr_scheduler, "lr_scheduler", strict)
                          if now.lr_scheduler is not None else None),
            param_groups=([{k: v for k, v in g.items() if k != "params"}
                           for g in lay.base_optimizer.param_groups] if lay.base_optimizer else None),
            client_state=jsontree.saveable(dict(client_state or {}), "client_state", strict),
            model_spec=self._model_spec(lay).tree())
        dp_rank, dp_size = data_parallel(e)
        pp_rank, pp_size = pipeline(e)
        sizes = {"zero_stage": lay.stage, "optimizer": lay.wrapper.name, "dp_world_size": dp_size,
                 "tp_world_size": lay.tp[1], "pp_world_size": pp_size}
        layout = dict(sizes, dp_rank=dp_rank, tp_rank=lay.tp[0], pp_rank=pp_rank)
        framework = dict(sizes, name="deepspeed", deepspeed=deepspeed.__version__, torch=torch.__version__,
                         adacheck=adacheck.__version__,
                         dtype="bf16" if e.bfloat16_enabled() else "fp16" if e.fp16_enabled() else "fp32")
        rank_objects = RankObjects(rng=rng_state())
        if self.online is not None and lay.wrapper.flat_partitions:
            # what this rank's partitions are made of: its deltas replay on another DP size too
            rank_objects.partitions = partition_map(lay, self.online.tap.key_of)
        return LocalState(shards=shards, objects=objects.tree(), rank_objects=rank_objects.tree(),
                               layout=layout, framework=framework, step=int(e.global_steps))

    def _model_spec(self, lay) -> SavedModel:
        """What a DeepSpeed engine of another layout is built from (adacheck_ds.native): the
        parameters in module order with their trainability, the buffers, the optimizer groups
        as DeepSpeed was given them, the optimizer class, the DeepSpeed config and the tied
        weights' other names."""
        e = self.engine
        base = lay.base_optimizer
        raw = param_dict(getattr(e, "_config", None))
        cfg = {k: v for k, v in raw.items() if k != "adacheck"} if raw is not None else None
        spec = SavedModel(parameters=[[n, bool(p.requires_grad)] for n, p in named(e)],
                          tensor_parallel={"size": lay.tp[1], "partition_dims": dict(sorted(lay.split.items()))},
                          buffers=[n for n, _ in named(e, buffers=True)],
                          groups=lay.groups,
                          optimizer=class_path(base) if base is not None else None,
                          ds_config=(jsontree.saveable(cfg, "ds_config", False)
                                     if cfg is not None else None),
                          shared=tied_parameters(e.module), pipeline=pipeline_layers(e.module),
                          moe=moe_layers(e.module))
        return self._whole_model(spec) if pipeline(e)[1] > 1 or getattr(e, "has_moe_layers", False) else spec

    @staticmethod
    def _whole_model(spec: SavedModel) -> SavedModel:
        """Every rank's part of the model description as one (collective): parameters, buffers
        and each optimizer group's names in rank order (pipeline stages in order, a tied weight
        once, where its first stage lists it; MoE experts held by other ranks after them)."""
        every = default_comm().all_gather_object(spec.tree())
        params, buffers, groups, shared, seen = [], [], [[] for _ in spec.groups], {}, set()
        split: Dict[str, int] = {}
        for tree in every:      # global rank order: the stages in order, each stage's ranks alike
            part = SavedModel.of(tree, "a stage's model description")
            split.update(part.partition_dims)   # a stage's tensor-parallel parameters: its own
            for n, trainable in part.parameters:
                if n not in seen:
                    seen.add(n)
                    params.append([n, trainable])
            buffers += [n for n in part.buffers if n not in buffers]
            if len(part.groups) != len(groups):
                raise adacheck.StateError(f"the pipeline stages have different numbers of optimizer param groups "
                                          f"({len(part.groups)} and {len(groups)}); AdaCheck needs the same on every stage")
            for mine, theirs in zip(groups, part.groups):
                mine += [n for n in theirs if n not in mine]
            shared.update(part.shared or {})
        return SavedModel(parameters=params, buffers=buffers, groups=groups, shared=shared,
                          tensor_parallel=dict(spec.tensor_parallel, partition_dims=dict(sorted(split.items()))),
                          optimizer=spec.optimizer, ds_config=spec.ds_config, pipeline=spec.pipeline, moe=spec.moe)

    def _scaler(self):
        """The object holding the loss scale and its trackers: ZeRO 1-3 keep a ``loss_scaler``;
        the ZeRO-0 fp16 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer) a ``loss_scale_config``."""
        opt = self.engine.optimizer
        sc = getattr(opt, "loss_scaler", None)
        return sc if sc is not None else getattr(opt, "loss_scale_config", None)

    def scalars(self) -> Scalars:
        """The engine's counters, LR scheduler state and loss scaler state now."""
        e, sc = self.engine, self._scaler()
        sched = e.lr_scheduler
        return Scalars(
            counters={k: _counter(getattr(e, k)) for k in _COUNTERS if hasattr(e, k)},
            lr_scheduler=sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
            loss_scaler=None if sc is None else {k: _plain(getattr(sc, k)) for k in _SCALER_FIELDS if hasattr(sc, k)})

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """``engine.load_checkpoint`` of an AdaCheck checkpoint (or, in a directory that holds one,
        of DeepSpeed's own), into this engine's layout, its online deltas replayed.

        Args:
            load_dir: the checkpoint directory, or a directory a save left a pointer in.
            tag: the checkpoint (default: the one ``latest`` names); its committed online deltas
                are replayed, up to ``engine.adacheck.replay_until`` if set.
            load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                load_module_only: as DeepSpeed's.
            custom_load_fn: not supported (a ConfigError).

        Returns:
            ``(checkpoint directory, client_state)``, or ``(None, None)`` when there is none.
        """
        e, comm = self.engine, default_comm()
        found = (pointer.follow(self.checkpointer.where, load_dir, tag, comm.rank)
                 if load_dir and self.config.save_dir else None)
        if found is not None:
            # (a directory the caller names, e.g. a Hugging Face Trainer's checkpoint-N, whose save went to
            # adacheck.save_dir: exactly the step it was saved at, with no online deltas after it)
            load_dir, tag, until = found.save_dir, found.tag, found.step
        else:
            load_dir, until = self.config.save_dir or load_dir, self.replay_until
        if custom_load_fn is not None:
            raise adacheck.ConfigError("custom_load_fn is not supported with AdaCheck checkpoints")
        if tag is None and e.load_universal_checkpoint():
            tag = _latest_universal(load_dir)    # None: AdaCheck's own 'latest'
        self.finish()     # an asynchronous save in flight commits first
        if tag is None and not self.checkpointer.has_checkpoint(load_dir, comm):
            log.warning("AdaCheck: no checkpoint in %s (no 'latest'); nothing loaded", load_dir)
            return None, None
        native = _native_checkpoint(load_dir, tag)
        if native is not None:
            # switching an existing run to AdaCheck: its last checkpoint is DeepSpeed's own
            log.warning("AdaCheck: %s is a native DeepSpeed checkpoint; DeepSpeed loads it, "
                        "and the next save writes an AdaCheck checkpoint", native)
            return load_native(e, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only)
        want_optim = load_optimizer_states and not load_module_only
        # a checkpoint holds every pipeline stage's and every expert's tensors: those other ranks hold
        # are expected
        everywhere = None
        if comm.world_size > 1:
            every = comm.all_gather_object(module_names(e))
            everywhere = (set().union(*(p for p, _ in every)), set().union(*(b for _, b in every)))
        loaded = self.checkpointer.load(comm, load_dir, tag, _Load(
            self, load_dir, want_optim, load_module_strict, load_module_only, load_lr_scheduler_states, everywhere))
        ckpt_dir, objects = loaded.ckpt_dir, loaded.result
        replay = None
        if want_optim and load_lr_scheduler_states:
            model = objects.model(ckpt_dir)
            replay = Replay(self, model.optimizer if model is not None else None)
        done = recovery.after_load(comm, self.checkpointer, loaded, replay, until=until,
                                   without="the optimizer and scheduler states",
                                   recorder=self.online.recorder if self.online is not None else None)
        if done.steps:
            self.last_replay = {"steps": done.steps, "seconds": done.seconds, "bytes": done.bytes}
        log.info("AdaCheck: loaded %s (step %s)", ckpt_dir, done.step)
        return ckpt_dir, objects.client_state

    def apply_scalars(self, saved: Scalars, with_scheduler: bool = True) -> None:
        """Counters, LR scheduler and loss scaler from a checkpoint's (or delta's) scalars."""
        e = self.engine
        for k, v in saved.counters.items():
            setattr(e, k, v)
        if with_scheduler and e.lr_scheduler is not None and saved.lr_scheduler:
            e.lr_scheduler.load_state_dict(saved.lr_scheduler)
        sc = self._scaler()
        if sc is not None and saved.loss_scaler:
            for k, v in saved.loss_scaler.items():
                if not hasattr(sc, k):   # saved by the other kind of scaler (another ZeRO stage)
                    continue
                cur = getattr(sc, k)
                setattr(sc, k, torch.tensor(v, dtype=cur.dtype, device=cur.device)
                        if isinstance(cur, torch.Tensor) else v)
