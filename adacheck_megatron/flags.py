"""``--adacheck`` flags for Megatron training scripts.

``add_adacheck_args(parser)`` has the signature of Megatron-LM's ``extra_args_provider``
(``pretrain(..., extra_args_provider=add_adacheck_args)``) and adds one flag per key of
:class:`adacheck.config.AdaCheckConfig`, with the same name in kebab-case:

  --adacheck                      enabled
  --adacheck-dir DIR              save_dir (default: Megatron's --save / --load)
  --adacheck-keep-last K          keep_last
  --[no-]adacheck-verify-on-load  verify_on_load
  --[no-]adacheck-fsync           fsync
  --[no-]adacheck-strict-objects  strict_objects
  --[no-]adacheck-reference-previous
  --adacheck-redundancy-factor K  redundancy_factor
  --adacheck-exchange {ring,allgather}

A flag left out keeps the config default.  ``config_from_args(args)`` validates the result
with the same rules as the DeepSpeed block and names the offending flag in the error.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import fields

from adacheck.config import AdaCheckConfig
from adacheck.errors import ConfigError
from adacheck.exchange import EXCHANGES

_SPECIAL = {"enabled": "--adacheck", "save_dir": "--adacheck-dir"}


def flag_of(key: str) -> str:
    return _SPECIAL.get(key, "--adacheck-" + key.replace("_", "-"))


def _dest(key: str) -> str:
    return "adacheck" if key == "enabled" else "adacheck_" + key


def add_adacheck_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("AdaCheck", "deduplicated, verified checkpoints (see adacheck/config.py)")
    defaults = AdaCheckConfig()
    for f in fields(AdaCheckConfig):
        key, default = f.name, getattr(defaults, f.name)
        if key == "enabled":
            g.add_argument("--adacheck", action="store_true", default=None,
                           help="save and load checkpoints with AdaCheck")
        elif key == "save_dir":
            g.add_argument("--adacheck-dir", dest=_dest(key), default=None, metavar="DIR",
                           help="checkpoint directory (default: --save / --load)")
        elif isinstance(default, bool):
            g.add_argument(flag_of(key), dest=_dest(key), action=argparse.BooleanOptionalAction,
                           default=None, help=f"adacheck.{key} (default {str(default).lower()})")
        elif key == "exchange":
            g.add_argument(flag_of(key), dest=_dest(key), choices=EXCHANGES, default=None,
                           help=f"adacheck.{key} (default {default})")
        else:
            g.add_argument(flag_of(key), dest=_dest(key), type=int, default=None, metavar="N",
                           help=f"adacheck.{key} (default {default})")
    return parser


def config_from_args(args: argparse.Namespace) -> AdaCheckConfig:
    """The validated AdaCheckConfig for parsed ``args``; ConfigError names the flag."""
    block = {}
    for f in fields(AdaCheckConfig):
        v = getattr(args, _dest(f.name), None)
        if v is not None:
            block[f.name] = v
    given = [flag_of(k) for k in block if k != "enabled"]
    if given and not block.get("enabled"):
        raise ConfigError(f"{', '.join(given)} given without --adacheck; add --adacheck to use "
                          "AdaCheck, or drop the other --adacheck-* flags")
    try:
        return AdaCheckConfig.from_dict(block)
    except ConfigError as e:
        msg = re.sub(r"adacheck\.(\w+)", lambda m: flag_of(m.group(1)), str(e))
        raise ConfigError(msg.replace(" must be true or false", " must be given as a flag")) from None
