"""adacheck_megatron.hooks: the post-step point, on a real megatron-core optimizer (CPU, gloo).

The optimizers are megatron-core's own (get_megatron_optimizer, bf16 with fp32 masters),
built by scripts/pretrain_gpt.py in one process of a 1-rank gloo group; the child process
keeps the process group and adacheck_megatron.cpu's device redirection out of pytest's.
"""
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT, free_port

from adacheck_megatron.hooks import (add_post_step_hook, post_step_hooks, remove_post_step_hook,
                                     wrap_optimizer_step)

CHILD = r'''
import json, os, sys
sys.path.insert(0, os.path.join(os.environ["ADACHECK_ROOT"], "scripts"))
import torch
import pretrain_gpt
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from adacheck_megatron import hooks

out = {}
args = pretrain_gpt.parse_args(argv=["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                          "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "2",
                          "--global-batch-size", "2", "--vocab-size", "64", "--make-vocab-size-divisible-by",
                          "16", "--lr", "1e-3", "--train-iters", "4", "--bf16"])
pretrain_gpt.initialize(args)
model, config = pretrain_gpt.build_model(args)
optimizer, scheduler = pretrain_gpt.build_optimizer(args, model, config)
out["script_wraps"] = hooks.is_wrapped(optimizer)
out["optimizer_type"] = type(optimizer).__name__

calls = []
other = None
def record(opt, ok):
    calls.append([opt is optimizer, opt is other, ok])
hooks.add_post_step_hook(record)

# the script's own training step: one successful update, one hook call
loss, grad_norm, lr, ok = pretrain_gpt.train_step(args, 1, model, optimizer, scheduler)
out["script_step"] = [ok, grad_norm is not None and grad_norm > 0]
out["after_script_step"] = list(calls)

# a second real optimizer with a constant loss scale, so a step can be skipped (inf grads)
other = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,
                                               params_dtype=torch.bfloat16, loss_scale=1.0), model)
original = other.step
hooks.wrap_optimizer_step(other)
wrapped = other.step
hooks.wrap_optimizer_step(other)
out["idempotent"] = [wrapped is not original, other.step is wrapped]

calls.clear()
pretrain_gpt.train_step(args, 2, model, other, scheduler)                    # successful
for chunk in model:
    chunk.zero_grad_buffer()
next(p for p in model[0].parameters()).main_grad.fill_(float("inf"))
skipped = other.step()                                             # skipped: found inf
out["skipped_result"] = [skipped[0], skipped[1], skipped[2]]
out["calls"] = list(calls)

out["removed"] = hooks.remove_post_step_hook(record)
out["removed_again"] = hooks.remove_post_step_hook(record)
calls.clear()
pretrain_gpt.train_step(args, 3, model, other, scheduler)
pretrain_gpt.train_step(args, 3, model, optimizer, scheduler)
out["calls_after_remove"] = list(calls)
print("RESULT " + json.dumps(out), flush=True)
torch.distributed.destroy_process_group()
'''


@pytest.mark.timeout(300)
def test_hooks_run_once_per_step_on_a_real_megatron_optimizer(tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", ADACHECK_ROOT=ROOT,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=280)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["script_wraps"], "scripts/pretrain_gpt.py must wrap the optimizer it builds"
    assert r["script_step"] == [True, True]
    assert r["after_script_step"] == [[True, False, True]]          # once, the script's optimizer
    assert r["idempotent"] == [True, True]
    assert r["skipped_result"] == [False, None, None]               # returned unchanged
    assert r["calls"] == [[False, True, True], [False, True, False]]  # skipped steps run it too
    assert r["removed"] is True and r["removed_again"] is False
    assert r["calls_after_remove"] == []


def test_registry_order_duplicates_and_removal():
    def a(opt, ok):
        pass

    def b(opt, ok):
        pass

    before = post_step_hooks()
    try:
        assert add_post_step_hook(a) is a
        add_post_step_hook(b)
        add_post_step_hook(a)                       # registered once
        assert post_step_hooks()[len(before):] == [a, b]
        assert remove_post_step_hook(a) is True
        assert remove_post_step_hook(a) is False
        assert post_step_hooks()[len(before):] == [b]
    finally:
        remove_post_step_hook(a)
        remove_post_step_hook(b)
    assert post_step_hooks() == before
    with pytest.raises(TypeError):
        add_post_step_hook(None)
    assert wrap_optimizer_step(None) is None
