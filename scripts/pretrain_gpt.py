"""A small, real GPT pretraining script on megatron-core, runnable on CPU with gloo.

    python -m torch.distributed.run --nproc_per_node 4 scripts/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 \\
        --train-iters 10 --lr 1e-3 --save ckpt --save-interval 5

Everything that trains is megatron-core's own code: parallel_state, GPTModel with the local
(no Transformer Engine) layer spec, the pipeline schedules of ``get_forward_backward_func``,
its DistributedDataParallel wrapper, ``get_megatron_optimizer`` (optionally the
DistributedOptimizer) and the OptimizerParamScheduler.  Flags keep Megatron-LM's names.
Without a GPU, ``adacheck_megatron.cpu.enable_cpu()`` redirects megatron-core's CUDA
assumptions to the CPU and the process groups use gloo.

The data are deterministic synthetic token sequences (arithmetic progressions modulo the
vocabulary, so the loss has something to learn), drawn from a generator seeded by
(--seed, iteration, data-parallel rank, micro-batch); the same flags give bit-identical
losses.  The last pipeline stage prints ``iteration N loss L ...`` per iteration.

Extension points, each in one place:
  * ``extra_args_provider(parser)``: a function adding flags (``main(extra_args_provider=...)``,
    as Megatron-LM's ``pretrain``); the ``--adacheck*`` flags are always there;
  * ``save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args)`` and
    ``load_checkpoint(model, optimizer, opt_param_scheduler, args) -> iteration``: with
    ``--adacheck``, AdaCheck (``adacheck_megatron.save_checkpoint`` / ``load_checkpoint``, into
    ``--adacheck-dir`` or else ``--save`` / ``--load``); without it megatron-core's
    ``dist_checkpointing`` (torch_dist format), the native baseline;
  * post-step hooks: ``build_optimizer`` wraps the optimizer with
    ``adacheck_megatron.hooks.wrap_optimizer_step``, so every callable registered with
    ``adacheck_megatron.hooks.add_post_step_hook(fn)`` runs as ``fn(optimizer, update_successful)``
    after each ``optimizer.step()`` (a skipped step too, with False), before the
    scheduler advances the learning rate and before the gradients are zeroed (the same point
    as in Megatron-LM with the patch or ``python -m adacheck_megatron.launch``).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from functools import partial
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules, get_num_layers_to_build)
from megatron.core.utils import unwrap_model  # noqa: E402

import adacheck_megatron  # noqa: E402
from adacheck.errors import ConfigError  # noqa: E402
from adacheck_megatron.flags import add_adacheck_args, config_from_args  # noqa: E402
from adacheck_megatron.hooks import wrap_optimizer_step  # noqa: E402


# --------------------------------------------------------------------------- arguments

def parse_args(extra_args_provider: Optional[Callable] = None, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="default: --tensor-model-parallel-size")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved pipeline schedule: each pipeline rank holds several model chunks "
                        "of this many layers")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradients in the background of the backward pass (DDP buckets)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather updated parameters in the next forward pass instead of in the "
                        "optimizer step (needs --use-distributed-optimizer and --overlap-grad-reduce)")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, required=True)
    g.add_argument("--vocab-size", type=int, default=1024)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--use-cpu-initialization", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: accumulate and reduce gradients in bf16 (default: fp32, as Megatron-LM)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 weights, fp32 main weights, loss scaling (dynamic unless --loss-scale)")
    g.add_argument("--loss-scale", type=float, default=None, help="a constant loss scale (fp16)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="as Megatron-LM: a non-persistent checkpoint every N iterations (with --adacheck: into "
                        "the memory tier only, needs --adacheck-tiers-memory; --save-interval's go there and to "
                        "the checkpoint directory at once)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop after an iteration that is a multiple of this (saving first)")
    g.add_argument("--async-save", action="store_true",
                   help="as Megatron-LM: with --adacheck, a save returns after a snapshot and commits in the background")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="DistributedOptimizer state as 'fully_reshardable' (default 'dp_reshardable')")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration instead of the newest (AdaCheck: a base's, or one its committed "
                        "online deltas reach)")
    g.add_argument("--ckpt-convert-format", choices=["torch_dist"], default=None,
                   help="load, save the loaded state natively in this format under --ckpt-convert-save, and exit")
    g.add_argument("--ckpt-convert-save", default=None, metavar="DIR")
    add_adacheck_args(p)
    if extra_args_provider is not None:
        p = extra_args_provider(p) or p
    args = p.parse_args(argv)
    try:
        args.adacheck_config = config_from_args(args)
    except ConfigError as e:
        p.error(str(e))
    if args.non_persistent_save_interval is not None:
        if args.non_persistent_save_interval < 1:
            p.error("--non-persistent-save-interval must be >= 1")
        if not (args.adacheck and args.adacheck_config.tiers.memory):
            p.error("--non-persistent-save-interval: this script keeps non-persistent checkpoints only in "
                    "AdaCheck's memory tier: add --adacheck --adacheck-tiers-memory")
    if args.fp16 and args.bf16:
        p.error("--fp16 and --bf16 exclude each other: choose one")
    if args.grad_reduce_in_bf16 and not args.bf16:
        p.error("--grad-reduce-in-bf16 needs --bf16")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        p.error("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    if (args.ckpt_convert_format is None) != (args.ckpt_convert_save is None):
        p.error("--ckpt-convert-format and --ckpt-convert-save go together")
    if args.ckpt_convert_format and args.adacheck_convert_save:
        p.error("--ckpt-convert-format (native output) and --adacheck-convert-save (AdaCheck output) exclude "
                "each other: choose one")
    if (args.ckpt_convert_format or args.adacheck_convert_save) and not (
            args.load or (args.adacheck and args.adacheck_config.save_dir)):
        p.error("converting needs the checkpoint to load: --load DIR")

    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % mp:
        p.error(f"world size {args.world_size} is not divisible by TP x PP = {mp}")
    args.data_parallel_size = args.world_size // mp
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    expert_mp = (args.expert_tensor_parallel_size * args.expert_model_parallel_size
                 * args.pipeline_model_parallel_size)
    if args.world_size % expert_mp:
        p.error(f"world size {args.world_size} is not divisible by expert TP x EP x PP = {expert_mp}")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        p.error(f"--global-batch-size {args.global_batch_size} is not divisible by "
                f"micro batch x data parallel = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    args.virtual_pipeline_model_parallel_size = None
    per_vp = args.num_layers_per_virtual_pipeline_stage
    if per_vp is not None:
        pp = args.pipeline_model_parallel_size
        if pp == 1 or args.num_layers % (pp * per_vp):
            p.error(f"--num-layers-per-virtual-pipeline-stage {per_vp} needs a pipeline (size > 1) whose "
                    f"stages' {args.num_layers} layers split into chunks of that many layers")
        if args.num_microbatches < pp:
            p.error(f"the interleaved pipeline schedule needs at least as many micro-batches per step as "
                    f"pipeline stages ({pp}): raise --global-batch-size")
        v = args.num_layers // (pp * per_vp)
        args.virtual_pipeline_model_parallel_size = v if v > 1 else None
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.seq_length > args.max_position_embeddings:
        p.error("--seq-length exceeds --max-position-embeddings")
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple
    if args.save_interval is not None and args.save is None and not args.adacheck_save_dir:
        p.error("--save-interval needs --save (or --adacheck-dir)")
    return args


# --------------------------------------------------------------------------- set-up

def initialize(args) -> None:
    """Process groups (gloo on CPU), megatron-core's parallel state and the seeds."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        from adacheck_megatron.cpu import enable_cpu
        enable_cpu()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend, world_size=args.world_size, rank=args.rank)
    initialize_parallel(args)


def initialize_parallel(args) -> None:
    """megatron-core's parallel state for args' layout, and the seeds (several layouts can
    follow each other in one process group, with destroy_model_parallel() in between)."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
    )
    # As Megatron-LM: a different seed per pipeline stage; TP/EP offsets come from the tracker.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def transformer_config(args) -> TransformerConfig:
    dtype = params_dtype(args)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        add_bias_linear=not args.disable_bias_linear,
        normalization=args.normalization,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        use_cpu_initialization=args.use_cpu_initialization,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # GPU kernel fusions (torch.compile / apex / TE); the plain PyTorch paths are used.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


class SequenceParallelTorchNorm:
    """torch LayerNorm / RMSNorm whose parameters carry ``sequence_parallel = True``.

    With --sequence-parallel each TP rank normalises its own slice of the sequence, so the
    norm's gradients are partial sums that ``finalize_model_grads`` all-reduces over TP for
    parameters with that flag (as apex/TE norms set it).  The local spec's WrappedTorchNorm
    refuses sequence parallelism, and without apex or TE there is no other norm.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(args, config, vp_stage: Optional[int] = None):
    """megatron-core's local (no TE) GPT layer spec; with SP, its norms are swapped (above)."""
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, normalization=args.normalization)
    if not args.sequence_parallel:
        return spec
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)


def model_provider(args, config, pre_process: bool, post_process: bool,
                   vp_stage: Optional[int] = None) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
    )


def build_model(args):
    """[DDP(Float16Module?(GPTModel))] for this pipeline stage: one model chunk, or one per
    virtual stage with --num-layers-per-virtual-pipeline-stage (as Megatron-LM builds them)."""
    config = transformer_config(args)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 and not args.grad_reduce_in_bf16,  # Megatron-LM's default for bf16: fp32
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    vp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for i in range(vp or 1):
        stage = i if vp else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunk = model_provider(args, config, pre_process=first, post_process=last, vp_stage=stage)
        if torch.cuda.is_available():       # (as Megatron-LM's get_model: the whole chunk on this GPU)
            chunk.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            chunk = Float16Module(config, chunk)
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=i > 0))
    # Hooks the schedules call (as Megatron-LM's training loop sets them).
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in chunks] if vp else chunks[0].no_sync
    return chunks, config


def build_optimizer(args, model, config):
    dtype = params_dtype(args)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        params_dtype=dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    optimizer = wrap_optimizer_step(get_megatron_optimizer(opt_config, model))   # post-step hooks
    config.grad_scale_func = optimizer.scale_loss
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.train_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


# --------------------------------------------------------------------------- data and loss

def synthetic_batch(args, iteration: int, microbatch: int) -> dict:
    """Micro-batch ``microbatch`` of ``iteration`` for this data-parallel rank (deterministic)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    rng = np.random.default_rng([args.seed, iteration, dp_rank, microbatch])
    b, s, v = args.micro_batch_size, args.seq_length, args.vocab_size
    start = rng.integers(0, v, size=(b, 1))
    stride = rng.integers(1, 8, size=(b, 1))
    seq = torch.from_numpy((start + stride * np.arange(s + 1)) % v)
    batch = {
        "tokens": seq[:, :-1].contiguous(),
        "labels": seq[:, 1:].contiguous(),
        "loss_mask": torch.ones(b, s, dtype=torch.float32),
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
    }
    if torch.cuda.is_available():
        batch = {k: t.cuda(torch.cuda.current_device(), non_blocking=True) for k, t in batch.items()}
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    # (sum, tokens): the schedule divides by tokens and micro-batches for the backward pass;
    # the pair is reported and averaged over micro-batches and data-parallel ranks below.
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


# --------------------------------------------------------------------------- checkpoints

def _ckpt_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _tracker_file(root: str) -> str:
    return os.path.join(root, "latest_checkpointed_iteration.txt")


def _rng_state():
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(model, optimizer, args, is_loading: bool, with_optim: bool = True,
                        with_rng: bool = True) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {}
    for i, chunk in enumerate(model):   # Megatron-LM's keys: "model", or "model<i>" per virtual stage
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        state["model" if len(model) == 1 else f"model{i}"] = unwrap_model(chunk).sharded_state_dict()
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    model_sd = state["model"] if len(model) == 1 else dict(state)
    if with_optim:
        # as Megatron-LM's _build_sharded_state_dict_metadata: chained optimizers' state keys carry
        # no per-optimizer prefix (unless the distributed optimizer's format needs one)
        metadata = {"distrib_optim_sharding_type":
                    "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable",
                    "chained_optim_avoid_prefix": True}
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    if with_rng:
        # Per global rank: RNG streams differ by TP, PP and EP rank (and may by DP rank).
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state


def save_checkpoint(iteration: int, model, optimizer, opt_param_scheduler, args, non_persistent: bool = False) -> None:
    """AdaCheck with --adacheck (``non_persistent``: into the memory tier only); else the native
    baseline: megatron-core dist_checkpointing, torch_dist format, fully parallel."""
    if args.overlap_param_gather:   # as Megatron-LM before a save: the last step's weights everywhere
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    if args.adacheck:
        t0 = time.perf_counter()
        m = adacheck_megatron.save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                              args=args, config=args.adacheck_config,
                                              non_persistent_ckpt=non_persistent)
        if m is None:    # --async-save: snapshotted; it commits in the background
            if torch.distributed.get_rank() == 0:
                print(f"AdaCheck checkpoint iteration {iteration}: snapshot in {time.perf_counter() - t0:.2f}s, "
                      "committing in the background", flush=True)
            return
        if torch.distributed.get_rank() == 0:
            print(f"saved AdaCheck checkpoint iteration {iteration} to "
                  f"{os.path.join(args.adacheck_config.save_dir or args.save, m.tag)} in "
                  f"{time.perf_counter() - t0:.2f}s ({m.stats.get('file_bytes', 0)} bytes written)",
                  flush=True)
        return
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    t0 = time.perf_counter()
    ckpt_dir = _ckpt_dir(args.save, iteration)
    if torch.distributed.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state_dict(model, optimizer, args, is_loading=False)
    state["iteration"] = iteration
    state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        parallel_state.get_data_parallel_group(with_context_parallel=True))
    dist_checkpointing.save(state, ckpt_dir, strategy)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tmp = _tracker_file(args.save) + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, _tracker_file(args.save))
        print(f"saved checkpoint iteration {iteration} to {ckpt_dir} "
              f"in {time.perf_counter() - t0:.2f}s", flush=True)
    torch.distributed.barrier()


def _init_empty_optimizer_state(optimizer) -> None:
    """Give a never-stepped optimizer the state torch's Adam creates at its first step.

    Without apex / Transformer Engine megatron-core wraps torch.optim.AdamW, which creates
    its state lazily; DistributedOptimizer.sharded_state_dict(is_loading=True) reads the
    'step' of that state and fails on a fresh optimizer.  The values are overwritten by the
    load; the parameters are not touched (unlike a dummy step, which applies weight decay).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.tensor(0.0),
                                          "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


def load_checkpoint(model, optimizer, opt_param_scheduler, args) -> int:
    """Load the newest checkpoint under --load; returns its iteration (0 if there is none)."""
    native = None
    if args.adacheck:
        from adacheck_megatron.checkpointing import native_checkpoint
        native = native_checkpoint(args.adacheck_config.save_dir or args.load)
        if native is not None and torch.distributed.get_rank() == 0:
            print(f"{native} is a native checkpoint: loading it with dist_checkpointing; "
                  "the next save is AdaCheck's", flush=True)
    if args.adacheck and native is None:
        t0 = time.perf_counter()
        iteration, _ = adacheck_megatron.load_checkpoint(model, optimizer, opt_param_scheduler,
                                                         args=args, config=args.adacheck_config,
                                                         iteration=args.ckpt_step)
        if torch.distributed.get_rank() == 0 and iteration:
            from adacheck_megatron.checkpointing import checkpointer
            job = checkpointer(optimizer, args.adacheck_config)
            where = (f"the memory tier ({job.last_loaded.load_dir})" if job.last_loaded.tier == "memory"
                     else args.adacheck_config.save_dir or args.load)
            print(f"loaded AdaCheck checkpoint iteration {iteration} from {where} in {time.perf_counter() - t0:.2f}s",
                  flush=True)
        return iteration
    load_dir = args.adacheck_config.save_dir or args.load if args.adacheck else args.load
    tracker = _tracker_file(load_dir)
    if not os.path.exists(tracker):
        if torch.distributed.get_rank() == 0:
            print(f"no checkpoint under {load_dir}, training from scratch", flush=True)
        return 0
    with open(tracker) as f:
        iteration = int(f.read().strip()) if args.ckpt_step is None else args.ckpt_step
    ckpt_dir = _ckpt_dir(load_dir, iteration)
    t0 = time.perf_counter()
    if args.use_distributed_optimizer and not args.no_load_optim:
        _init_empty_optimizer_state(optimizer)
    state = _sharded_state_dict(model, optimizer, args, is_loading=True,
                                with_optim=not args.no_load_optim, with_rng=not args.no_load_rng)
    state = dist_checkpointing.load(state, ckpt_dir)
    for i, chunk in enumerate(model):
        unwrap_model(chunk).load_state_dict(state["model" if len(model) == 1 else f"model{i}"])
    if not args.no_load_optim:
        optimizer.load_state_dict(state["optimizer"])
        opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    elif args.fp16 or args.bf16:    # (as Megatron-LM: the main weights from the loaded module weights)
        optimizer.reload_model_params()
    if not args.no_load_rng:
        _set_rng_state(state["rng_state"])
    assert state["iteration"] == iteration, (state["iteration"], iteration)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(f"loaded checkpoint iteration {iteration} from {ckpt_dir} "
              f"in {time.perf_counter() - t0:.2f}s", flush=True)
    return iteration


# --------------------------------------------------------------------------- training

def train_step(args, iteration: int, model, optimizer, opt_param_scheduler):
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    batches = [synthetic_batch(args, iteration, m) for m in range(args.num_microbatches)]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        # one iterator per model chunk: the interleaved schedule feeds each chunk separately
        data_iterator=[iter(batches) for _ in model] if len(model) > 1 else iter(batches),
        model=model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    if update_successful:
        opt_param_scheduler.step(increment=args.global_batch_size)
    loss = None
    if parallel_state.is_pipeline_last_stage():
        total = torch.stack([d["lm loss"] for d in losses]).sum(0)
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        loss = (total[0] / total[1]).item()
    return loss, grad_norm, lr, update_successful


def convert_and_exit(iteration: int, model, optimizer, opt_param_scheduler, args) -> None:
    """The loaded state (online deltas replayed) saved once more, as Megatron-LM's
    --ckpt-convert-format does: natively (torch_dist) under --ckpt-convert-save/torch_dist, or
    as one AdaCheck checkpoint into --adacheck-convert-save."""
    from adacheck_megatron.checkpointing import refuse_existing_output, save_converted
    if not iteration:
        raise SystemExit(f"nothing to convert: no checkpoint loaded from {args.load}")
    try:
        if args.adacheck_convert_save:
            out = args.adacheck_convert_save
            save_converted(iteration, model, optimizer, opt_param_scheduler, out, args=args,
                           config=args.adacheck_config)
        else:
            out = os.path.join(args.ckpt_convert_save, args.ckpt_convert_format)
            refuse_existing_output(_ckpt_dir(out, iteration))
            args.adacheck, args.save = False, out
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(f"converted checkpoint iteration {iteration} -> {out}", flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def main(extra_args_provider: Optional[Callable] = None, argv=None) -> None:
    args = parse_args(extra_args_provider, argv)
    initialize(args)
    model, config = build_model(args)
    optimizer, opt_param_scheduler = build_optimizer(args, model, config)
    converting = bool(args.ckpt_convert_format or args.adacheck_convert_save)
    if args.adacheck and args.adacheck_config.online.enabled and not converting:   # deltas after every iteration
        from adacheck_megatron import online
        online.attach(model, optimizer, opt_param_scheduler, args, args.adacheck_config)
    resume = args.load or (args.adacheck and args.adacheck_config.save_dir)
    iteration = load_checkpoint(model, optimizer, opt_param_scheduler, args) if resume else 0
    if converting:
        return convert_and_exit(iteration, model, optimizer, opt_param_scheduler, args)

    is_logger = (parallel_state.is_pipeline_last_stage()
                 and parallel_state.get_tensor_model_parallel_rank() == 0
                 and parallel_state.get_data_parallel_rank() == 0)
    if torch.distributed.get_rank() == 0:
        vp = args.virtual_pipeline_model_parallel_size
        print(f"world {args.world_size}: TP {args.tensor_model_parallel_size} PP "
              f"{args.pipeline_model_parallel_size}{f' x {vp} virtual' if vp else ''} DP {args.data_parallel_size} EP "
              f"{args.expert_model_parallel_size}, {args.num_microbatches} micro-batches, "
              f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}"
              f"{', distributed optimizer' if args.use_distributed_optimizer else ''}", flush=True)
    t_start, first = time.perf_counter(), iteration
    saving = args.save or (args.adacheck and args.adacheck_config.save_dir)
    hooked = not args.overlap_param_gather
    if not hooked:
        # as Megatron-LM: the first iteration runs on the weights every rank loaded (or initialised),
        # the forward pre-hooks that all-gather parameters come back after its step succeeded
        for chunk in model:
            chunk.disable_forward_pre_hook(param_sync=False)
    while iteration < args.train_iters:
        iteration += 1
        t0 = time.perf_counter()
        loss, grad_norm, lr, ok = train_step(args, iteration, model, optimizer, opt_param_scheduler)
        if not hooked and ok:
            for chunk in model:
                chunk.enable_forward_pre_hook()
            hooked = True
        if is_logger and iteration % args.log_interval == 0:
            print(f"iteration {iteration} loss {loss:.6f} lr {lr:.4e} grad-norm {grad_norm:.6f} "
                  f"time {time.perf_counter() - t0:.3f}s exact-loss {loss!r}"
                  f"{'' if ok else ' (skipped)'}", flush=True)
        if saving and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args)
        elif saving and args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args, non_persistent=True)
        if args.exit_interval and iteration % args.exit_interval == 0:
            if torch.distributed.get_rank() == 0:
                print(f"exiting at iteration {iteration} (--exit-interval)", flush=True)
            break
    if saving and iteration > first and not (args.save_interval and iteration % args.save_interval == 0):
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args)
    adacheck_megatron.finalize_async_saves(block=True)     # (as Megatron-LM's maybe_finalize_async_save)
    if torch.distributed.get_rank() == 0:
        print(f"done: {iteration} iterations in {time.perf_counter() - t_start:.2f}s", flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
