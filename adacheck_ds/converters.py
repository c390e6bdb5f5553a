"""DeepSpeed's checkpoint formats for ``adacheck convert`` (registered as entry points):

- ``deepspeed``: native DeepSpeed files of a ZeRO stage, data-parallel and (Megatron-DeepSpeed)
  tensor-parallel size, written and read by DeepSpeed itself in as many local ranks as the
  layout has (:mod:`adacheck_ds.native`); it also materialises the online deltas of a DeepSpeed
  AdaCheck checkpoint into one new base;
- ``deepspeed-universal``: DeepSpeed's universal checkpoint (:func:`adacheck_ds.convert.to_universal`).
"""
from __future__ import annotations

import sys

from adacheck.integration import Converter

from . import native


class NativeDeepSpeed(Converter):
    name = "deepspeed"
    summary = ("native DeepSpeed files for a ZeRO stage, DP size and Megatron-DeepSpeed TP size (written and "
               "read by DeepSpeed itself in DP x TP local ranks)")
    framework = "deepspeed"

    def add_arguments(self, parser) -> None:
        native.add_arguments(parser)

    def write(self, ckpt_dir, out, options, progress):
        return self._run("to-native", options.src, out, options, progress)

    def read(self, src, out, options, progress):
        return self._run("from-native", src, out, options, progress)

    def materialise(self, src, out, options, progress):
        return self._run("materialise", src, out, options, progress)

    def _run(self, direction: str, src: str, out: str, options, progress=None):
        if not options.json:
            sys.stderr.write(f"adacheck convert: {direction}: starting DeepSpeed ranks on this machine ...\n")
        written = native.convert(direction, src, out, options, progress)
        what = {"to-native": "a native DeepSpeed checkpoint (load it with engine.load_checkpoint)",
                "from-native": "an AdaCheck checkpoint", "materialise": "an AdaCheck checkpoint"}[direction]
        return written, what


class DeepSpeedUniversal(Converter):
    name = "deepspeed-universal"
    summary = "DeepSpeed's universal checkpoint (any ZeRO stage 1-3 and DP size)"

    def write(self, ckpt_dir, out, options, progress):
        from .convert import to_universal
        written = to_universal(ckpt_dir, out, verify=not options.no_verify, progress=progress)
        return written, ('a DeepSpeed universal checkpoint (load it with "checkpoint": {"load_universal": true} '
                         "in the DeepSpeed config)")
