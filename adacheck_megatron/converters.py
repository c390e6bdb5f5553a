"""megatron-core's torch_dist format for ``adacheck convert`` (registered as an entry point):
written with ``dist_checkpointing.save`` and read with ``dist_checkpointing.load``, one tensor
at a time (:mod:`adacheck_megatron.convert`)."""
from __future__ import annotations

import os

from adacheck.integration import Converter


class TorchDist(Converter):
    name = "torch-dist"
    summary = "megatron-core dist_checkpointing (torch_dist), loadable into any TP/PP/EP/DP layout"
    framework = None      # Megatron's online deltas are materialised by the training script

    def write(self, ckpt_dir, out, options, progress):
        from .convert import to_torch_dist
        written = to_torch_dist(ckpt_dir, out, verify=not options.no_verify, progress=progress)
        return written, ("a megatron-core torch_dist checkpoint (loadable with dist_checkpointing.load into any "
                         "layout; load with --no-load-rng)")

    def read(self, src, out, options, progress):
        from .convert import from_torch_dist
        m = from_torch_dist(src, out, progress=progress)
        return os.path.join(os.path.abspath(out), m.tag), f"an AdaCheck checkpoint ({len(m.tensors)} tensors)"
