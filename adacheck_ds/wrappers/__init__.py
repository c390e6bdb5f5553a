"""The kinds of DeepSpeed optimizer wrappers AdaCheck knows, one module each (see
:mod:`.base`): ``wrapper_of(engine)`` is the one an engine uses."""
from __future__ import annotations

from .base import Frag, Layout, Wrapper
from .bf16 import BF16
from .fp16_fused import FP16Fused
from .fp16_unfused import FP16Unfused
from .plain import Plain
from .zero3 import Zero3
from .zero12 import Zero12

# tried in this order; Plain (a torch optimizer, or none) last
KINDS = (Zero3, Zero12, BF16, FP16Fused, FP16Unfused, Plain)


def wrapper_of(engine) -> Wrapper:
    return next(k for k in KINDS if k.matches(engine.optimizer))(engine)


__all__ = ["Frag", "Layout", "Wrapper", "KINDS", "wrapper_of"]
