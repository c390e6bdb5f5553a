"""One rank of real megatron-core training on CPU (gloo), driven by a JSON spec.

spec = {"runs": [{"argv": [pretrain_gpt.py flags], "actions": [["train", 2], ["save", DIR], ...]}]}
Every run builds its own layout (parallel state, GPTModel, DDP, optimizer, scheduler) with
scripts/pretrain_gpt.py's own functions in the same process group, then tears the parallel
state down, so several layouts share one launch. Actions:
  train N | train_to N | train_dump N PREFIX [MARKER] | online [false] | online_legacy | dump NAME | scramble |
  scramble_rng | save DIR | load DIR | save_native DIR | load_native DIR | latest DIR | marker NAME |
  set_args {NAME: VALUE} | die | expect_error SUBSTRING ACTION...
Each rank writes result-rank<r>.json: per run, the losses (from the last pipeline stage),
the iterations loaded and errors caught by expect_error.
"""
import json
import multiprocessing
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--vocab-size", "200",
        "--make-vocab-size-divisible-by", "16", "--lr", "1e-3", "--train-iters", "20",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]


def last_stage_value(v):
    """The value the last pipeline stage (TP rank 0, DP rank 0) has, on every rank."""
    mine = v if (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
                 and parallel_state.get_data_parallel_rank() == 0) else None
    got = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(got, mine)
    return next(x for x in got if x is not None)


def run_one(run, out):
    argv = BASE + list(run["argv"])
    args = pretrain_gpt.parse_args(argv=argv)
    pretrain_gpt.initialize_parallel(args)
    model, config = pretrain_gpt.build_model(args)
    optimizer, scheduler = pretrain_gpt.build_optimizer(args, model, config)
    iteration = 0
    res = {"losses": [], "loaded": [], "errors": []}

    def do(action):
        nonlocal iteration
        kind, rest = action[0], action[1:]
        if kind in ("train", "train_to", "train_dump"):
            # train N | train_to N (until iteration N) | train_dump N PREFIX [MARKER]: after each
            # iteration dump PREFIX<iteration> (and touch MARKER<iteration>-rank<r>)
            for _ in range(rest[0] - iteration if kind == "train_to" else rest[0]):
                iteration += 1
                loss, _, _, ok = pretrain_gpt.train_step(args, iteration, model, optimizer, scheduler)
                res["losses"].append(last_stage_value(loss))
                if not ok:
                    res.setdefault("skipped", []).append(iteration)
                if kind == "train_dump":
                    do(["dump", f"{rest[1]}{iteration}"])
                    if len(rest) > 2:
                        open(os.path.join(out, f"{rest[2]}{iteration}-rank{torch.distributed.get_rank()}"), "w").close()
        elif kind == "online":   # start the online mode (flags in argv), or stop it: ["online", false]
            from adacheck_megatron import online
            if rest and rest[0] is False:
                online.online_of(optimizer).close()
            else:
                online.attach(model, optimizer, scheduler, args, args.adacheck_config)
        elif kind == "online_legacy":   # start it recording as versions before per-kind gradient
            # names did (not distributed optimizer): every key tp<t>.pp<p>.ep<e>., every rank
            # writing all of its own gradients
            from megatron.core import parallel_state as ps
            from adacheck.online.optimtap import OptimizerTap
            from adacheck_megatron import online, state
            prefix = (f"tp{ps.get_tensor_model_parallel_rank()}.pp{ps.get_pipeline_model_parallel_rank()}."
                      f"ep{ps.get_expert_model_parallel_rank()}.")
            saved = online.make_tap, online._replica_share
            online.make_tap = lambda opt: OptimizerTap([o.optimizer for o in state.optimizer_parts(opt)], prefix=prefix)
            online._replica_share = lambda tap, opt, comm, spread=None: set(tap.tensors)
            try:
                online.attach(model, optimizer, scheduler, args, args.adacheck_config)
            finally:
                online.make_tap, online._replica_share = saved
        elif kind == "dump":     # this rank's weights, main weights, optimizer state and LR
            t = {}
            for i, chunk in enumerate(model):
                for n, p in chunk.named_parameters():
                    t[f"model{i}/{n}"] = p.detach().clone()
            for oi, o in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
                for gi, g in enumerate(o.optimizer.param_groups):
                    t[f"lr{oi}.{gi}"] = torch.tensor([g["lr"], g.get("weight_decay", 0.0)], dtype=torch.float64)
                    for j, p in enumerate(g["params"]):
                        t[f"main{oi}.{gi}.{j}"] = p.detach().clone()
                        for k, v in sorted(o.optimizer.state.get(p, {}).items()):
                            if torch.is_tensor(v):
                                t[f"state{oi}.{gi}.{j}.{k}"] = v.detach().clone().reshape(-1)
            t["scheduler"] = torch.tensor([scheduler.num_steps], dtype=torch.int64)
            for oi, o in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
                gs = getattr(o, "grad_scaler", None)
                if gs is not None:     # fp16: the loss scale and its trackers
                    t[f"grad_scaler{oi}"] = torch.tensor(
                        [float(gs.scale.item()), getattr(gs, "_growth_tracker", 0),
                         getattr(gs, "_hysteresis_tracker", 0)], dtype=torch.float64)
            from safetensors.torch import save_file
            save_file({k: v.contiguous() for k, v in t.items()},
                      os.path.join(out, f"{rest[0]}-rank{torch.distributed.get_rank()}.safetensors"))
        elif kind == "latest":   # latest DIR: what DIR/latest names now (None: no such file)
            p = os.path.join(rest[0], "latest")
            res.setdefault("latest", []).append(open(p).read().strip() if os.path.exists(p) else None)
        elif kind == "marker":   # marker NAME: touch NAME-rank<r> in the output directory
            open(os.path.join(out, f"{rest[0]}-rank{torch.distributed.get_rank()}"), "w").close()
        elif kind == "set_args":   # set_args {name: value}: e.g. no_load_rng for the loads that follow
            for k, v in rest[0].items():
                setattr(args, k, v)
        elif kind == "scramble_rng":   # other host and model-parallel RNG states than the run that saved
            from megatron.core import tensor_parallel
            torch.manual_seed(4321 + torch.distributed.get_rank())
            tensor_parallel.model_parallel_cuda_manual_seed(4321)
        elif kind == "copy_memory":   # copy_memory DIR NAME: this node's memory tier of DIR, as it is
            # now, copied to NAME-rank<r> in the output directory (a clean exit empties the tier)
            import shutil
            from adacheck.storage.backends import LOCAL
            from adacheck.tiers import memory_location
            mem = memory_location(LOCAL, rest[0])
            if os.path.isdir(mem):
                shutil.copytree(mem, os.path.join(out, f"{rest[1]}-rank{torch.distributed.get_rank()}"))
        elif kind == "die":        # SIGKILL this process (a crash: nothing at exit runs)
            sys.stdout.flush()
            os.kill(os.getpid(), 9)
        elif kind == "scramble":   # other weights than the run that saved (the load must overwrite them)
            with torch.no_grad():
                for chunk in model:
                    for p in chunk.parameters():
                        p.add_(torch.randn_like(p))
        elif kind == "save":
            args.adacheck, args.save = True, rest[0]
            pretrain_gpt.save_checkpoint(iteration, model, optimizer, scheduler, args)
            res.setdefault("exchanges", []).append(args.adacheck_config.exchange)
        elif kind == "load":
            args.adacheck, args.load = True, rest[0]
            iteration = pretrain_gpt.load_checkpoint(model, optimizer, scheduler, args)
            res["loaded"].append(iteration)
            job = getattr(optimizer, "adacheck_checkpointer", None)      # (what it read of the manifest)
            res.setdefault("manifest_read", []).append(job.last_loaded.read if job is not None and job.last_loaded else None)
        elif kind == "perturb_optimizer":   # main weights and every moment change in place
            with torch.no_grad():
                for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
                    for g in o.optimizer.param_groups:
                        for p in g["params"]:
                            p.add_(1.0)
                            for v in o.optimizer.state.get(p, {}).values():
                                if torch.is_tensor(v) and v.dim() > 0:
                                    v.add_(1.0)
        elif kind == "finish":   # wait for AdaCheck's asynchronous save in flight
            import adacheck_megatron
            adacheck_megatron.finalize_async_saves(block=True)
        elif kind == "save_native":
            args.adacheck, args.save = False, rest[0]
            pretrain_gpt.save_checkpoint(iteration, model, optimizer, scheduler, args)
        elif kind == "load_native":   # [DIR, {"no_load_rng": true, ...}]
            args.adacheck, args.load = False, rest[0]
            for k, v in (rest[1] if len(rest) > 1 else {}).items():
                setattr(args, k, v)
            iteration = pretrain_gpt.load_checkpoint(model, optimizer, scheduler, args)
            res["loaded"].append(iteration)
        elif kind == "expect_error":
            try:
                do(rest[1])
            except Exception as e:   # noqa: BLE001 - the test checks the message
                msg = f"{type(e).__name__}: {e}"
                if rest[0] not in msg:
                    raise AssertionError(f"expected an error containing {rest[0]!r}, got {msg}") from e
                res["errors"].append(msg)
            else:
                raise AssertionError(f"expected an error containing {rest[0]!r}; {rest[1]} succeeded")
        else:
            raise ValueError(f"unknown action {action}")

    for a in run["actions"]:
        do(a)
    parallel_state.destroy_model_parallel()
    return res


def _exit(code: int) -> None:
    """os._exit (no interpreter teardown in a process that ran gloo and DeepSpeed / megatron-core
    threads), after stopping the helper processes multiprocessing started here: megatron-core's
    native save starts a Manager process for its write results, which would outlive this one."""
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.stdout.flush()
    os._exit(code)


def main():
    spec_path, out = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    from adacheck_megatron.cpu import enable_cpu
    enable_cpu()
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    results = []
    try:
        for run in spec["runs"]:
            results.append(run_one(run, out))
    except BaseException:
        traceback.print_exc()
        _exit(1)
    with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # what a script's normal exit runs (os._exit skips atexit): AdaCheck's writers closed and its
    # lease of each save directory removed
    from adacheck.checkpoint.lifecycle import at_exit
    at_exit()
    _exit(0)


if __name__ == "__main__":
    main()
