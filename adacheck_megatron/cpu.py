"""Run real megatron-core on CPU with the gloo backend: device redirection, not a mock.

megatron-core assumes CUDA in a handful of places.  ``enable_cpu()`` redirects exactly those
to the CPU, so that its real parallel_state, GPTModel, pipeline schedules, DDP, optimizers
(the DistributedOptimizer included), MoE dispatchers and dist_checkpointing run unchanged in
processes that called ``torch.distributed.init_process_group("gloo")``.  Verified on
megatron-core 0.16.1 + torch 2.13 (CPU build); each item names what needs it, and each was
checked to be needed by switching it off (.probe/megatron/REPORT.md):

1. Device arguments.  A ``TorchFunctionMode`` pushed once for the process rewrites a CUDA
   ``device=`` ("cuda", "cuda:N", ``torch.device("cuda")`` or an index such as the 0 of
   ``torch.cuda.current_device()``) to the CPU in every torch call: grad buffers of DDP,
   p2p shape tensors, token counters of the schedules, the default causal mask of
   ``transformer.utils.get_default_causal_mask``, the gather buffers of ``mappings``.
   ``Tensor.cuda()`` returns the tensor, ``Tensor.to(<cuda device>)`` moves nothing.
2. ``Tensor.type()`` (no argument) on a CPU tensor answers ``torch.cuda.<T>Tensor``: the
   mixed-precision optimizers, the DistributedOptimizer and ``clip_grads`` accept only
   those names.
3. Uneven all-gather.  Gloo's allgather needs equal pieces; ``mappings._gather_along_first_dim``
   with ``output_split_sizes`` (alltoall MoE dispatcher with expert TP > 1) gathers pieces
   of different lengths.  The mode pads them to the longest and copies the true lengths out.
4. Backward.  torch 2.13's ``backward()`` / ``autograd.grad()`` dispatch to the mode, which
   is off while it handles a call, so the autograd engine (running custom Function backwards
   and the DDP grad hooks) would start without it; its entry point re-enters the mode.
5. ``torch.cuda.current_device()`` returns 0 and ``torch.cuda.synchronize()`` does nothing
   (p2p communication, MoE, distributed optimizer, dist_checkpointing).
6. ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream``
   are inert: CPU work is synchronous (MoE token dispatcher, DDP, dist_checkpointing).
7. A device generator of its own, distinct from the CPU one, as on a GPU: random operations
   run under the mode (dropout, ``rand*``, ``normal_``, ``uniform_``, ``bernoulli``... all of
   which would run on CUDA tensors there) draw from it; ``torch.cuda.get_rng_state`` /
   ``set_rng_state`` / ``manual_seed`` and ``tensor_parallel.random``'s get/set helpers act on
   it; ``torch.manual_seed`` seeds it too (it seeds every device's generator).  So the tracker
   of ``model_parallel_cuda_manual_seed`` (data-, tensor- and expert-parallel states, forked
   around initialisation and dropout) behaves as on a GPU, and a checkpoint must hold the
   device generator's state apart from the CPU generator's to resume exactly.
8. MoE, not device-specific: without Transformer Engine, megatron-core 0.16.1's
   ``moe_utils`` never binds ``te_general_gemm`` yet tests it (NameError in every router
   forward); it is bound to None, which selects the torch.mm path.
9. MoE alltoall dispatcher: ``maybe_move_tensor_to_cpu`` turns split sizes into numpy only
   for ``is_cuda`` tensors, and gloo's all_to_all_single needs int sequences; here the
   "device" tensors are CPU tensors and are converted all the same.

``enable_cpu()`` is idempotent and refuses to run where CUDA is available.  ``cpu_mode()`` is
the same as a context manager; on exit it pops the device mode (items 1-4) but leaves the
module patches (5-9), which are inert for code that does not use megatron-core.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable_cpu", "cpu_mode", "is_enabled", "device_rng_state", "set_device_rng_state"]

_MODE: "_CpuDeviceMode | None" = None
_PATCHED = False
_ENGINE_RUN_BACKWARD = torch.autograd._engine_run_backward


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # an index means CUDA


# --------------------------------------------------------------------------- items 1-3

def _to(tensor, *args, **kwargs):
    if args and not isinstance(args[0], (torch.Tensor, torch.dtype)) and _is_cuda(args[0]):
        args = (torch.device("cpu"),) + args[1:]
    return torch.Tensor.to(tensor, *args, **kwargs)


def _type(tensor, *args, **kwargs):
    name = torch.Tensor.type(tensor, *args, **kwargs)
    if args or kwargs or tensor.device.type != "cpu":
        return name
    return name.replace("torch.", "torch.cuda.", 1)


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    if all(t.shape == tensor.shape for t in tensor_list):
        return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    if async_op:
        raise NotImplementedError("adacheck_megatron.cpu: asynchronous all_gather of uneven pieces")
    rows = max(t.shape[0] for t in tensor_list)
    padded_input = tensor.new_zeros((rows,) + tuple(tensor.shape[1:]))
    padded_input[: tensor.shape[0]] = tensor
    padded = [torch.empty_like(padded_input) for _ in tensor_list]
    torch.distributed.all_gather(padded, padded_input, group=group)
    for out, piece in zip(tensor_list, padded):
        out.copy_(piece[: out.shape[0]])
    return None


# --------------------------------------------------------------------------- item 7

_DEVICE_GENERATOR = torch.Generator()


def device_rng_state() -> torch.Tensor:
    return _DEVICE_GENERATOR.get_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    _DEVICE_GENERATOR.set_state(state.to("cpu", torch.uint8))


def _on_device_generator(func):
    """``func`` drawing its random numbers from the device generator (the CPU default generator
    is swapped out for the call and put back as it was)."""
    def call(*args, **kwargs):
        if kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        host = torch.get_rng_state()
        torch.set_rng_state(_DEVICE_GENERATOR.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            _DEVICE_GENERATOR.set_state(torch.get_rng_state())
            torch.set_rng_state(host)
    return call


_RANDOM = [torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
           torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
           torch.dropout, torch.bernoulli, torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal,
           torch.rand_like, torch.randn_like, torch.randint_like, torch.multinomial, torch.poisson,
           torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.normal_, torch.Tensor.uniform_,
           torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
           torch.Tensor.geometric_, torch.Tensor.multinomial]


# Functions answered by the mode instead of torch (items 1-3, 7); every other call only has a
# CUDA ``device=`` keyword rewritten.  Inside a handler the mode is off, so these call torch.
_HANDLERS = {**{f: _on_device_generator(f) for f in _RANDOM},
    torch.Tensor.cuda: lambda tensor, *args, **kwargs: tensor,
    torch.Tensor.to: _to,
    torch.Tensor.type: _type,
    torch.distributed.all_gather: _all_gather,
}


class _CpuDeviceMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device=torch.device("cpu"))
        handler = _HANDLERS.get(func)
        return handler(*args, **kwargs) if handler else func(*args, **kwargs)


def _run_backward_in_mode(*args, **kwargs):
    """torch.autograd's engine entry point, run with the device mode on (item 4)."""
    if _MODE is None:
        return _ENGINE_RUN_BACKWARD(*args, **kwargs)
    with _MODE:
        return _ENGINE_RUN_BACKWARD(*args, **kwargs)


# --------------------------------------------------------------------------- items 5-9

class _NullStream:
    """torch.cuda.Stream / Event stand-in: everything is already complete (item 6)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _ExpectedForkWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_device_queries():  # item 5
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None


def _patch_streams():  # item 6
    torch.cuda.Stream = torch.cuda.Event = _NullStream
    torch.cuda.current_stream = torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _patch_rng():  # item 7
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.get_rng_state = lambda device="cuda": device_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": set_device_rng_state(new_state)
    torch.cuda.manual_seed = torch.cuda.manual_seed_all = lambda seed: _DEVICE_GENERATOR.manual_seed(int(seed))
    host_manual_seed = torch.manual_seed

    def manual_seed(seed):          # as on a GPU: every device's generator too
        _DEVICE_GENERATOR.manual_seed(int(seed))
        return host_manual_seed(seed)
    torch.manual_seed = torch.random.manual_seed = manual_seed
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: device_rng_state()
    mrandom._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: set_device_rng_state(state)
    logging.getLogger(mrandom.__name__).addFilter(_ExpectedForkWarning())


def _patch_moe():  # items 8 and 9
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def device_to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = device_to_host


_PATCHES = (_patch_device_queries, _patch_streams, _patch_rng, _patch_moe)


# --------------------------------------------------------------------------- entry points

def enable_cpu() -> None:
    """Redirect megatron-core's CUDA use to the CPU in this process (idempotent).

    Call it before building megatron-core objects (parallel_state, models, optimizers).
    Raises RuntimeError where CUDA is available: there, megatron-core runs as it is.
    """
    global _MODE, _PATCHED
    if _MODE is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("adacheck_megatron.cpu.enable_cpu() is for machines without CUDA; "
                           "this one has a GPU: run megatron-core on it unchanged")
    if not _PATCHED:
        for patch in _PATCHES:
            patch()
        torch.autograd._engine_run_backward = _run_backward_in_mode
        _PATCHED = True
    _MODE = _CpuDeviceMode()
    _MODE.__enter__()


def is_enabled() -> bool:
    return _MODE is not None


@contextlib.contextmanager
def cpu_mode():
    """``enable_cpu()`` for a block; pops the device mode again on exit if it pushed it."""
    global _MODE
    pushed = _MODE is None
    enable_cpu()
    try:
        yield
    finally:
        if pushed and _MODE is not None:
            _MODE.__exit__(None, None, None)
            _MODE = None
