"""One rank of a real DeepSpeed (CPU, gloo) run for tests/test_ds_dropin.py: ds_worker.py's spec
and actions, plus

  run["optimizer"] = "hybrid"   DeepSpeed's HybridStateOptimizer of tests/unit/simple_model.py
                                 (a Python int ``integer_step`` and a 1-element tensor
                                 ``tensor_step`` per tensor it steps, plain SGD; with
                                 run["odd_shape"] also a tensor "odd" of that shape)
  ["raw", NAME]                  every rank writes NAME-rank<r>.safetensors: what its engine holds,
                                 read from DeepSpeed's objects without AdaCheck (the module weights,
                                 each tensor the base optimizer steps and its state by position,
                                 the loss scale) and records the state's Python types
  ["kind"]                       records the class of engine.optimizer
  ["load_native_kw", DIR, KWARGS] DeepSpeed's own load_checkpoint with those arguments
  ["load_custom_fn", DIR]        load_checkpoint with a custom_load_fn
  ["wrap_methods"]               DeepSpeedEngine's save/load_checkpoint wrapped (functools.wraps)
                                 by a decorator that counts calls, as a user's may be

and a dump (ds_worker's full_state) of DeepSpeed's FP16_Optimizer (ZeRO-0 fp16 / bf16 with
DeepSpeed's fused Adam), which DeepSpeed's safe_get_full_* API does not cover: each parameter's
master and moments cut from the group's flat tensors in DeepSpeed's own flattening order.
"""
import functools
import os

import ds_worker
from ds_worker import torch
from safetensors.torch import save_file
from torch._utils import _unflatten_dense_tensors


class HybridStateOptimizer(torch.optim.Optimizer):
    """As DeepSpeed's tests/unit/simple_model.py has it (lr aside)."""

    def __init__(self, params, lr=0.01, odd_shape=None):
        super().__init__(params, dict(lr=lr))
        self.odd_shape = odd_shape      # (a further state tensor of this shape: "odd")

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["integer_step"] = 0
                    state["tensor_step"] = torch.zeros(1, device=p.device)
                    if self.odd_shape is not None:
                        state["odd"] = torch.zeros(self.odd_shape, device=p.device)
                p.data.add_(p.grad.data, alpha=-group["lr"])
                state["integer_step"] += 1
                state["tensor_step"] += 1


_make_engine, _full_state, _act = ds_worker.make_engine, ds_worker.full_state, ds_worker.act


def make_engine(run):
    if run.get("optimizer") != "hybrid":
        return _make_engine(run)
    torch.manual_seed(run.get("seed", 0))
    model = ds_worker.Net(run.get("hidden", 37), run.get("layers", 1))
    config = dict(ds_worker.ds_config(run), zero_allow_untested_optimizer=True)
    engine, _, _, _ = ds_worker.deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                                     optimizer=HybridStateOptimizer(model.parameters(),
                                                                                    odd_shape=run.get("odd_shape")),
                                                     config=config)
    return engine


def full_state(engine):
    opt = engine.optimizer
    if type(opt).__name__ != "FP16_Optimizer":
        return _full_state(engine)
    out = {}
    names = {p: n for n, p in engine.module.named_parameters()}
    for n, p in engine.module.named_parameters():
        out[f"model/{n}"] = p.data.detach().clone()
    for lps, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
        state = opt.optimizer.state.get(flat, {})
        for p, m in zip(lps, _unflatten_dense_tensors(flat.data, lps)):
            out[f"master/{names[p]}"] = m.clone()
        for k in ("exp_avg", "exp_avg_sq"):
            if k in state:
                for p, v in zip(lps, _unflatten_dense_tensors(state[k], lps)):
                    out[f"optim/{k}/{names[p]}"] = v.clone()
        if "step" in state:
            out["meta/optim_step"] = torch.tensor([float(state["step"])])
    out["meta/global_steps"] = torch.tensor([engine.global_steps, engine.global_samples, engine.skipped_steps])
    if engine.fp16_enabled():
        sc = opt.loss_scale_config
        out["meta/loss_scale"] = torch.tensor([float(sc.cur_scale), float(sc.cur_iter),
                                               float(sc.last_overflow_iter)], dtype=torch.float64)
    if engine.lr_scheduler is not None:
        out["meta/lr"] = torch.tensor([g["lr"] for g in opt.param_groups])
    for n, b in engine.module.named_buffers():
        out[f"buffer/{n}"] = b.detach().clone()
    return {k: v.contiguous() for k, v in out.items()}


def raw(engine):
    """This rank's engine state by position (DeepSpeed's objects, not AdaCheck's layout), and the
    Python type of each optimizer state value."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    out, types = {}, {}
    for n, p in engine.module.named_parameters():
        out[f"model/{n}"] = p.data.detach().clone()
    i = 0
    for g in base.param_groups:
        for p in g["params"]:
            out[f"stepped/{i}"] = p.data.detach().clone()
            for k, v in base.state.get(p, {}).items():
                types[f"{i}/{k}"] = type(v).__name__
                out[f"state/{i}/{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
            i += 1
    sc = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    if engine.fp16_enabled() and sc is not None:
        out["meta/loss_scale"] = torch.tensor([float(sc.cur_scale), float(sc.cur_iter)], dtype=torch.float64)
    out["meta/global_steps"] = torch.tensor([engine.global_steps, engine.global_samples, engine.skipped_steps])
    out["meta/lr"] = torch.tensor([g["lr"] for g in base.param_groups], dtype=torch.float64)
    return {k: v.contiguous() for k, v in out.items()}, types


def _counted(method, rec):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        rec["calls"] = rec.get("calls", 0) + 1
        return method(*args, **kwargs)
    return wrapper


def act(engine, a, rec, out_dir, rank):
    if a[0] == "raw":
        tensors, types = raw(engine)
        save_file(tensors, os.path.join(out_dir, f"{a[1]}-rank{rank}.safetensors"))
        rec.setdefault("types", {})[a[1]] = types
    elif a[0] == "load_native_kw":   # load_native_kw DIR KWARGS: DeepSpeed's own load with those arguments
        path, cs = ds_worker.adacheck_ds.load_native(engine, a[1], **a[2])
        rec["loaded"].append([path, sorted(cs or {})])
    elif a[0] == "load_custom_fn":   # load_custom_fn DIR: load_checkpoint with a custom_load_fn
        engine.load_checkpoint(a[1], custom_load_fn=lambda src, dst: dst.copy_(src))
    elif a[0] == "wrap_methods":   # wrap the engine's save/load_checkpoint as a user's decorator would
        cls = ds_worker.deepspeed.runtime.engine.DeepSpeedEngine
        for name in ("save_checkpoint", "load_checkpoint"):
            setattr(cls, name, _counted(getattr(cls, name), rec))
    elif a[0] == "kind":
        rec.setdefault("kind", []).append(type(engine.optimizer).__name__)
    else:
        _act(engine, a, rec, out_dir, rank)


ds_worker.make_engine, ds_worker.full_state, ds_worker.act = make_engine, full_state, act

if __name__ == "__main__":
    ds_worker.run_main()
