"""Host RNG states (python, numpy, torch, cuda) as JSON-able trees with tensors, and back.

Both integrations save one such tree per rank; framework-specific generators (Megatron's
CUDA RNG tracker) are added by the integration.
"""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(device: bool = None) -> dict:
    """``device``: also the CUDA generator's state (default: where CUDA is in use).  A stand-in
    device (megatron-core's CPU shim) answers torch.cuda's RNG calls with a generator of its own."""
    version, words, gauss = random.getstate()
    npst = np.random.get_state()
    # python's 625 state words as a tensor (stored and hashed like any tensor, not as JSON text)
    out = {"python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
           "numpy": {"kind": npst[0], "keys": torch.from_numpy(npst[1].astype(np.int64)),
                                    "pos": int(npst[2]), "has_gauss": int(npst[3]),
                                    "cached_gaussian": float(npst[4])},
           "torch": torch.get_rng_state()}
    if device if device is not None else (torch.cuda.is_available() and torch.cuda.is_initialized()):
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(s: dict, device: bool = None) -> None:
    py = s["python"]
    if isinstance(py, dict):
        random.setstate((py["version"], tuple(py["words"].tolist()), py["gauss"]))
    else:   # checkpoints before the state words became a tensor: [version, [words], gauss]
        random.setstate((py[0], tuple(py[1]), py[2]))
    n = s["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and (device if device is not None else torch.cuda.is_available()):
        torch.cuda.set_rng_state(s["cuda"])
