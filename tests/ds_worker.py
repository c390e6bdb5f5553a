"""One rank of a real DeepSpeed (CPU, gloo) training run, driven by a JSON spec; with
``ADACHECK_TEST_DEVICE=cuda`` (launch.py's ``device``) on the GPU, NCCL, as DeepSpeed's default there.

spec = {"runs": [{"stage": 2, "dtype": "bf16", "optimizer": "adamw" | "ds_adam", "hidden": 37,
                  "frozen": [name prefixes], "tie": [[alias, source]],
                  "zero": {extra zero_optimization keys},
                  "adacheck": {...} | null, "actions": [["train", 3], ["save", DIR], ...]}]}
Actions: train N | train_dump N PREFIX [MARKER] | train_to N | steps | save DIR [TAG [KWARGS]] | save_native DIR | load DIR [KWARGS] | load_native DIR |
dump NAME | marker NAME | latest DIR | exchange_check | perturb RANK PARAM | fsize_limit RANK BYTES |
stop_writer RANK | kill_writer RANK | cont_writer RANK | wait_file PATH | slow_persist SECONDS | die | ls DIR |
expect_error SUBSTRING ACTION...
A run with "init_error": SUBSTRING expects building its engine to fail with that error.
Each rank writes result-rank<r>.json (losses and errors per run); dumps write the full
logical state (gathered through DeepSpeed's own safe_get_full_* API) from rank 0.
"""
import json
import os
import resource
import signal
import sys
import time
import traceback
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import adacheck_ds  # noqa: E402,F401  (registers the integration)
import adacheck_ds.state  # noqa: E402
from adacheck_ds.state import READ_RATHER_THAN_GATHER  # noqa: E402  (the default)

DEVICE = os.environ.get("ADACHECK_TEST_DEVICE", "cpu")


class Net(torch.nn.Module):
    def __init__(self, hidden, layers=1):
        super().__init__()
        self.inp = torch.nn.Linear(12, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.mid = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers - 1))
        self.out = torch.nn.Linear(hidden, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.inp(x)))
        for m in self.mid:
            h = h + torch.nn.functional.gelu(m(h))
        return self.out(h) * self.scale.to(h.dtype)


class _CopyToTP(torch.autograd.Function):
    """Megatron's copy to the tensor-parallel region: identity, gradients summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's reduce from the tensor-parallel region: outputs summed, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPNet(torch.nn.Module):
    """A Megatron-DeepSpeed style MLP: a column-parallel ``inp`` and a row-parallel ``out``
    (each rank holds 1/tp of them, marked as Megatron marks them), the LayerNorm and the
    output bias replicated.  The full weights do not depend on the TP size."""

    # how Megatron-DeepSpeed models tell DeepSpeed's universal checkpoint which parameters are split
    universal_checkpoint_info = {"tp_replicated_parameter_patterns": [r"norm\.", r"out\.bias$"],
                                 "parameter_with_row_parallelism_patterns": [r"out\.weight$"]}

    def __init__(self, hidden, mpu):
        super().__init__()
        tp, r = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        self.group, self.tp = mpu.get_slice_parallel_group(), tp
        self.norm = torch.nn.LayerNorm(12)
        inp, out = torch.nn.Linear(12, hidden), torch.nn.Linear(hidden, 5)
        h = hidden // tp
        self.inp, self.out = torch.nn.Linear(12, h), torch.nn.Linear(h, 5)
        with torch.no_grad():
            self.inp.weight.copy_(inp.weight[r * h:(r + 1) * h])
            self.inp.bias.copy_(inp.bias[r * h:(r + 1) * h])
            self.out.weight.copy_(out.weight[:, r * h:(r + 1) * h])
            self.out.bias.copy_(out.bias)
        for p, dim in ((self.inp.weight, 0), (self.inp.bias, 0), (self.out.weight, 1)):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        x = self.norm(x)
        if self.tp > 1:
            x = _CopyToTP.apply(x, self.group)
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, self.inp.weight, self.inp.bias))
        y = torch.nn.functional.linear(h, self.out.weight)
        if self.tp > 1:
            y = _ReduceFromTP.apply(y, self.group)
        return (y + self.out.bias) * self.scale.to(y.dtype)


_MPU = {}


def mpu_of(tp):
    """DeepSpeed's own mpu (PipelineParallelGrid: TP ranks consecutive, as Megatron orders them),
    one per TP size and process."""
    if tp not in _MPU:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid
        world = torch.distributed.get_world_size()
        _MPU[tp] = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=world // tp))
    return _MPU[tp]


def ds_config(run):
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": dict({"stage": run["stage"]}, **run.get("zero", {})),
        "bf16": {"enabled": run["dtype"] == "bf16"},
        "fp16": {"enabled": run["dtype"] == "fp16", "initial_scale_power": 8},
        "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                      "warmup_num_steps": 4}},
    }
    if run.get("optimizer") == "ds_adam":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01}}
    if run.get("adacheck") is not None:
        cfg["adacheck"] = run["adacheck"]
    cfg.update(run.get("ds_extra", {}))
    return cfg


def batch(step, rank, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    dev = "cuda" if DEVICE == "cuda" else "cpu"
    return torch.randn(2, 12, generator=g).to(dev, dtype), torch.randn(2, 5, generator=g).to(dev)


def allow_fp16_on_cpu():
    """DeepSpeed's CPU accelerator refuses fp16 unless the CPU has native fp16 arithmetic
    (oneDNN's check); torch computes fp16 on any CPU, only slower.  Lift that one refusal so the
    real fp16 optimizers and loss scalers of DeepSpeed run here; nothing else is replaced."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        type(acc).is_fp16_supported = lambda self: True


def make_engine(run):
    if run["dtype"] == "fp16":
        allow_fp16_on_cpu()
    torch.manual_seed(run.get("seed", 0))
    mpu = mpu_of(run["tp"]) if run.get("tp") else None
    model = TPNet(run.get("hidden", 40), mpu) if mpu else Net(run.get("hidden", 37), run.get("layers", 1))
    params = dict(model.named_parameters())
    for alias, source in run.get("tie", ()):   # tied weights: one nn.Parameter under two names
        *path, leaf = alias.split(".")
        setattr(model.get_submodule(".".join(path)), leaf, params[source])
    for n, p in model.named_parameters():
        if n.startswith(tuple(run.get("frozen", ()))):
            p.requires_grad_(False)
    kw = {}
    if run.get("optimizer", "adamw") == "adamw":
        kw["optimizer"] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                            lr=0.01, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad],
                                           config=ds_config(run), mpu=mpu, **kw)
    return engine


def train(engine, n, losses):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "", torch.float32)
    # the ranks of one tensor-parallel group see the same batch
    rank = engine.mpu.get_data_parallel_rank() if engine.mpu is not None else engine.global_rank
    for _ in range(n):
        x, y = batch(engine.global_steps, rank, dtype)
        loss = ((engine(x).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item())


def full_state(engine):
    """Every logical tensor, gathered with DeepSpeed's own API (independent of AdaCheck)."""
    out = {}
    stage3 = engine.zero_optimization_stage() == 3
    opt = engine.optimizer
    plain = not hasattr(opt, "optimizer") or opt.__class__.__name__ in ("AdamW", "Adam")
    base = getattr(opt, "optimizer", opt)
    unfused = {}
    if type(opt).__name__ == "FP16_UnfusedOptimizer":   # per-parameter fp32 masters
        unfused = {id(p): m for lps, ms in zip(opt.fp16_groups, opt.fp32_groups) for p, m in zip(lps, ms)}
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed's per-fragment views of the optimizer state (safe_get_full_optimizer_state)
        # are linked at the first step; a native load replaces the state, so link them again
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    # no moments yet when every step so far was skipped (fp16 overflow); the same on every rank
    never_stepped = engine.global_steps == engine.skipped_steps
    for n, p in engine.module.named_parameters():
        if stage3:
            with deepspeed.zero.GatheredParameters([p]):
                out[f"model/{n}"] = p.data.detach().clone()
        else:
            out[f"model/{n}"] = p.data.detach().clone()
        if plain or unfused:
            m = unfused.get(id(p), p)
            out[f"master/{n}"] = m.data.detach().float().clone()
            st = base.state.get(m, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out[f"optim/{k}/{n}"] = st[k].detach().clone()
        elif p.requires_grad:   # frozen parameters have no master weights or optimizer state
            out[f"master/{n}"] = safe_get_full_fp32_param(p).detach().clone()
            for k in ("exp_avg", "exp_avg_sq") if not never_stepped else ():
                v = safe_get_full_optimizer_state(p, k)
                if v is not None:
                    out[f"optim/{k}/{n}"] = v.detach().clone()
    steps, types = set(), set()
    for st in base.state.values():
        if "step" in st:
            steps.add(float(st["step"]))
            types.add(type(st["step"]).__name__)
    out["meta/optim_step"] = torch.tensor(sorted(steps) or [-1.0])
    out["meta/optim_step_is_int"] = torch.tensor([types == {"int"}])
    out["meta/global_steps"] = torch.tensor([engine.global_steps, engine.global_samples, engine.skipped_steps])
    sc = getattr(opt, "loss_scaler", None)
    sc = sc if sc is not None else getattr(opt, "loss_scale_config", None)   # ZeRO-0 fp16 optimizers
    if engine.fp16_enabled() and sc is not None:   # the loss scale and what decides its next change
        out["meta/loss_scale"] = torch.tensor([float(getattr(sc, k)) for k in
                                               ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
                                               if getattr(sc, k, None) is not None], dtype=torch.float64)
    if engine.lr_scheduler is not None:
        out["meta/lr"] = torch.tensor([g["lr"] for g in engine.optimizer.param_groups])
    for n, b in engine.module.named_buffers():
        out[f"buffer/{n}"] = b.detach().clone()
    if engine.mpu is not None and engine.mpu.get_tensor_model_parallel_world_size() > 1:
        # tensor-parallel parameters: the logical tensor is the TP slices side by side
        params = dict(engine.module.named_parameters())
        group, tp = engine.mpu.get_slice_parallel_group(), engine.mpu.get_tensor_model_parallel_world_size()
        for k in sorted(out):
            p = params.get(k.rsplit("/", 1)[-1])
            if k.startswith(("model/", "master/", "optim/")) and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(out[k]) for _ in range(tp)]
                torch.distributed.all_gather(parts, out[k].contiguous(), group=group)
                out[k] = torch.cat(parts, dim=p.partition_dim)
    return {k: v.contiguous() for k, v in out.items()}


def merged_state(mine):
    """Every rank's part of the logical state (``mine``: this rank's, as full_state gathers it) as
    one, on every rank: a tensor that several ranks hold (a tied weight on two pipeline stages,
    an expert on its expert-data-parallel group) must be the same on each."""
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, {k: v.cpu() for k, v in mine.items()})
    out = {}
    for st in every:
        for k, v in st.items():
            if k.startswith("meta/"):
                out.setdefault(k, v)
            elif k in out and not torch.equal(out[k], v):
                raise AssertionError(f"{k} differs between the ranks that hold it")
            else:
                out[k] = v
    return out


def act(engine, a, rec, out_dir, rank):
    op = a[0]
    if op == "train":
        train(engine, a[1], rec["losses"])
    elif op == "train_dump":   # train_dump N PREFIX: after each step, dump PREFIX<global_steps>
        for _ in range(a[1]):
            train(engine, 1, rec["losses"])
            act(engine, ["dump", f"{a[2]}{engine.global_steps}"], rec, out_dir, rank)
            if len(a) > 3:
                act(engine, ["marker", f"{a[3]}{engine.global_steps}"], rec, out_dir, rank)
    elif op == "train_to":   # train until global_steps == N
        train(engine, a[1] - engine.global_steps, rec["losses"])
    elif op == "steps":
        rec["steps"] = [engine.global_steps, engine.global_samples, engine.skipped_steps]
    elif op == "save":
        cs = {"epoch": 3, "note": "hi", "vec": torch.arange(4.0)}
        tag = a[2].format(rank=rank) if len(a) > 2 and a[2] is not None else None     # ("{rank}": per rank)
        engine.save_checkpoint(a[1], tag=tag, client_state=cs,
                               **(a[3] if len(a) > 3 else {}))
        if getattr(engine, "adacheck", None) is not None and engine.adacheck.last_manifest is not None:
            rec.setdefault("exchanges", []).append(engine.adacheck.last_manifest.stats["exchange"])
        if getattr(engine, "adacheck", None) is not None:
            rec.setdefault("last_save", []).append(engine.adacheck.last_save)
    elif op == "finish":   # wait for the asynchronous save in flight (and the online deltas submitted so far)
        if engine.adacheck.online is not None:
            engine.adacheck.online.flush()
        m = engine.adacheck.finish()
        rec.setdefault("finished", []).append(m.tag if m is not None else None)
        rec.setdefault("last_save", []).append(engine.adacheck.last_save)
    elif op == "save_native":
        adacheck_ds.save_native(engine, a[1])
    elif op == "load":
        base = getattr(engine.optimizer, "optimizer", engine.optimizer)

        def state_tensors():
            return [v for st in getattr(base, "state", {}).values() for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0]
        before = {id(v) for v in state_tensors()}
        path, cs = engine.load_checkpoint(a[1], **(a[2] if len(a) > 2 else {}))
        after = state_tensors()
        # the base optimizer's state tensors after the load that it held before: (kept, of)
        rec.setdefault("kept_state", []).append([sum(id(v) in before for v in after), len(after)])
        rec["loaded"].append([path, {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in (cs or {}).items()}])
        # ZeRO-3's persistent (small) parameters: gathered after a load, as DeepSpeed's own leaves them
        persistent = getattr(engine.optimizer, "persistent_parameters", None) or []
        rec.setdefault("persistent_gathered", []).append(
            [sum(p.ds_status.name == "AVAILABLE" and p.numel() == p.ds_numel for p in persistent), len(persistent)])
        ac = getattr(engine, "adacheck", None)
        rec.setdefault("manifest_read", []).append(ac.checkpointer.last_loaded.read if ac and ac.checkpointer.last_loaded else None)
    elif op == "load_native":
        path, cs = adacheck_ds.load_native(engine, a[1])
        rec["loaded"].append([path, sorted(cs or {})])
    elif op == "dump":
        st = full_state(engine)
        if rank == 0:
            save_file({k: v.cpu() for k, v in st.items()}, os.path.join(out_dir, f"{a[1]}.safetensors"))
    elif op == "marker":
        open(os.path.join(out_dir, f"{a[1]}-rank{rank}"), "w").close()
    elif op == "latest":   # latest DIR: what DIR/latest names now (None: no such file)
        p = os.path.join(a[1], "latest")
        rec.setdefault("latest", []).append(open(p).read().strip() if os.path.exists(p) else None)
    elif op == "fsize_limit":
        if rank == a[1]:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            limit = resource.RLIM_INFINITY if a[2] < 0 else a[2]
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    elif op in ("stop_writer", "kill_writer", "cont_writer"):   # that rank's writer process: SIGSTOP / SIGKILL / SIGCONT
        if rank == a[1]:
            proc = engine.adacheck.checkpointer.writer.proc
            os.kill(proc.pid, {"stop_writer": signal.SIGSTOP, "kill_writer": signal.SIGKILL,
                               "cont_writer": signal.SIGCONT}[op])
    elif op == "wait_file":     # wait_file PATH: until another job has made it (up to 1200 s)
        deadline = time.monotonic() + 1200
        while not os.path.exists(a[1]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{a[1]} did not appear")
            time.sleep(0.05)
    elif op == "ls":        # ls DIR: the complete checkpoints in DIR now
        from adacheck.storage import commit
        rec.setdefault("ls", []).append(sorted(t for t, m, _ in commit.list_checkpoints(a[1]) if m is not None)
                                        if os.path.isdir(a[1]) else [])
        rec.setdefault("ls_dirs", []).append(sorted(x for x in os.listdir(a[1]) if os.path.isdir(os.path.join(a[1], x)))
                                             if os.path.isdir(a[1]) else [])
    elif op == "slow_persist":   # slow_persist S: every copy from the memory tier to the directory starts S s late
        from adacheck.tiers import memory      # (where the memory tier looks the copy up)
        copy = memory.persist_checkpoint

        def late(*args, **kw):
            time.sleep(a[1])
            return copy(*args, **kw)
        memory.persist_checkpoint = late
    elif op == "die":       # SIGKILL this process (a crash: nothing at exit runs)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    elif op == "perturb":   # perturb RANK PARAM: that rank's replica silently diverges
        if rank == a[1]:
            with torch.no_grad():
                dict(engine.module.named_parameters())[a[2]].add_(1e-3)
    elif op == "exchange_check":   # uneven blocks (one empty) through both exchanges
        from adacheck.plan.exchange import TorchComm
        comm = TorchComm()
        mine = bytes(range(256))[: (rank * 37) % 256] * (rank + 1)
        rec["exchange"] = {how: [b.hex() for b in comm.all_gather_bytes(mine, how)]
                           for how in ("ring", "allgather")}
        rec["exchange"]["expected"] = [(bytes(range(256))[: (r * 37) % 256] * (r + 1)).hex()
                                       for r in range(comm.world_size)]
    elif op == "expect_error":
        try:
            act(engine, a[2:], rec, out_dir, rank)
        except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
            rec["errors"].append(f"{type(e).__name__}: {e}")
            rec.setdefault("error_lines", []).append(traceback.extract_tb(e.__traceback__)[-1].line)
            rec.setdefault("error_classes", []).append([c.__name__ for c in type(e).__mro__])
            if a[1] not in str(e):
                raise
        else:
            raise AssertionError(f"expected an error containing {a[1]!r} from {a[2:]}")
    else:
        raise ValueError(f"unknown action {a}")


def main():
    import logging
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("adacheck").setLevel(logging.INFO)   # AdaCheck's decisions in the rank logs
    spec = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed()      # DeepSpeed's default there: NCCL
    else:
        deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    if "nodes" in spec:   # pretend the ranks run on these machines (AdaCheck's placement)
        os.environ["ADACHECK_NODE"] = spec["nodes"][rank]
    results = []
    show = warnings.showwarning

    def record_warning(message, *args, **kwargs):   # kept even when stderr cannot be written
        results[-1]["warnings"].append(str(message))
        show(message, *args, **kwargs)
    warnings.showwarning = record_warning
    for run in spec["runs"]:
        rec = {"losses": [], "errors": [], "loaded": [], "warnings": []}
        results.append(rec)
        if "init_error" in run:   # building the engine must fail with this error
            try:
                make_engine(run)
            except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
                frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
                rec["errors"].append(f"{type(e).__name__}: {e}")
                rec["engine_code_ran"] = any(f.endswith(os.path.join("deepspeed", "runtime", "engine.py"))
                                             for f in frames)
                if run["init_error"] not in str(e):
                    raise
            else:
                raise AssertionError(f"expected building the engine to fail with {run['init_error']!r}")
            with open(os.path.join(out_dir, f"result-rank{rank}.json"), "w") as f:
                json.dump(results, f)
            continue
        # "gather": loads rebuild the module weights with DeepSpeed's all-gather whatever the
        # backend (by default gloo's ranks each read the master weights instead)
        adacheck_ds.state.READ_RATHER_THAN_GATHER = () if run.get("gather") else READ_RATHER_THAN_GATHER
        engine = make_engine(run)
        for a in run["actions"]:
            act(engine, a, rec, out_dir, rank)
        engine.destroy()
        with open(os.path.join(out_dir, f"result-rank{rank}.json"), "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()


def run_main():
    """The rank's whole life (also of pipe_worker.py, which replaces the model parts)."""
    try:
        main()
        # Tear gloo down explicitly: left to interpreter shutdown, its threads can abort the
        # process ("terminate called without an active exception") after all work is done.
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    run_main()
