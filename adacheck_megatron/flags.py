"""``--adacheck`` flags for Megatron training scripts.

``add_adacheck_args(parser)`` has the signature of Megatron-LM's ``extra_args_provider``
(``pretrain(..., extra_args_provider=add_adacheck_args)``) and adds one flag per key of
:class:`adacheck.config.AdaCheckConfig` (:mod:`adacheck.flags`: ``--adacheck``, ``--adacheck-dir``,
``--adacheck-online``, ``--adacheck-tiers-memory``, ...), but ``async_save``, which is Megatron-LM's
own ``--async-save`` (honoured under ``--adacheck``); ``--adacheck-dir`` defaults to ``--save`` /
``--load``.  One more flag is an action, not a config key:

  --adacheck-convert-save DIR     load (replaying the committed online deltas, up to
                                  --ckpt-step if given), save that state as one AdaCheck
                                  checkpoint into DIR, and exit: materialises the newest
                                  recoverable (or a chosen) iteration, in the job's layout

``config_from_args(args)`` validates the result with the same rules as the DeepSpeed block and
names the offending flag in the error.
"""
from __future__ import annotations

import argparse

from adacheck.config import AdaCheckConfig
from adacheck.errors import ConfigError
from adacheck.flags import add_config_flags, config_from_flags, flag_of

__all__ = ["add_adacheck_args", "config_from_args", "flag_of"]

# config keys set by Megatron-LM's own flags -> their argparse destinations
MEGATRON_FLAGS = {"async_save": "async_save"}


def add_adacheck_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = add_config_flags(parser, own=MEGATRON_FLAGS)
    g.add_argument("--adacheck-convert-save", default=None, metavar="DIR",
                   help="load (replaying online deltas, up to --ckpt-step if given), save that state as one "
                        "AdaCheck checkpoint into DIR, and exit")
    return parser


def config_from_args(args: argparse.Namespace) -> AdaCheckConfig:
    """The validated AdaCheckConfig for parsed ``args``; ConfigError names the flag."""
    if getattr(args, "adacheck_convert_save", None) and not getattr(args, "adacheck", None):
        raise ConfigError("--adacheck-convert-save converts an AdaCheck checkpoint: add --adacheck (and --load)")
    return config_from_flags(args, own=MEGATRON_FLAGS)
