"""``--adacheck-*`` command-line flags: one flag per key of :class:`adacheck.config.AdaCheckConfig`,
with the same name in kebab-case, for any argparse-based training script (the DeepSpeed block's
keys under the names a launcher's flags have):

  --adacheck                      enabled
  --adacheck-dir DIR              save_dir (default: the script's own checkpoint directory); a
                                  local directory or an fsspec URL (s3://bucket/prefix)
  --adacheck-storage-options JSON storage_options (fsspec arguments for a URL)
  --adacheck-keep-last K          keep_last
  --[no-]adacheck-verify-on-load  verify_on_load
  --[no-]adacheck-fsync           fsync
  --[no-]adacheck-strict-objects  strict_objects
  --[no-]adacheck-reference-previous
  --adacheck-redundancy-factor K  redundancy_factor
  --adacheck-exchange {auto,ring,allgather,partitioned}
  --adacheck-on-corrupt {raise,fallback}
  --adacheck-on-error {warn,raise}  on_error (a failed asynchronous save)
  --adacheck-compression zstd     compression
  --[no-]adacheck-async-save      async_save (unless the script has a flag of its own for it)
  --adacheck-async-writer {thread,process}  async_writer
  --[no-]adacheck-takeover        takeover (the save directory's lease from the job holding it)
  --adacheck-lease-ttl-s SECONDS  lease_ttl_s
  --adacheck-online               online.enabled (gradient deltas after every step)
  --adacheck-online-base-interval N|auto
  --[no-]adacheck-online-compact
  --adacheck-online-queue-depth N
  --adacheck-online-on-error {disable,raise}
  --adacheck-tiers-memory         tiers.memory (every save to node-local memory first)
  --[no-]adacheck-tiers-peer      tiers.peer (each node's memory files copied to the next node's memory)
  --adacheck-tiers-persist-interval N  tiers.persist_interval (every N-th save copied to --adacheck-dir)
  --adacheck-tiers-keep N         tiers.keep (newest checkpoints kept in memory)
  --adacheck-tiers-memory-dir DIR tiers.memory_dir (default $ADACHECK_MEMORY_DIR or /dev/shm/adacheck)

``add_config_flags(parser, own)`` adds them; ``own`` maps keys that the script's own flags set
(Megatron-LM's ``--async-save`` sets ``async_save``) to those flags' argparse destinations, and no
``--adacheck-*`` flag is made for them.  A flag left out keeps the config default.
``config_from_flags(args, own)`` validates the result with the same rules as the DeepSpeed block
and names the offending flag in the error.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import fields
from typing import List, Tuple
from typing import Dict, Optional

from .config import (ASYNC_WRITERS, ON_CORRUPT, ON_ERROR, ON_SAVE_ERROR, AdaCheckConfig, OnlineConfig, TiersConfig,
                     json_object_arg)
from .errors import ConfigError
from .plan.exchange import EXCHANGES

_SPECIAL = {"enabled": "--adacheck", "save_dir": "--adacheck-dir", "online.enabled": "--adacheck-online"}
# sections of the config with keys of their own, the key that switches each on, and what it does
_SECTIONS = {"online": (OnlineConfig, "enabled", "to record gradient deltas"),
             "tiers": (TiersConfig, "memory", "to save to the memory tier")}
_CHOICES = {"exchange": EXCHANGES, "on_corrupt": ON_CORRUPT, "on_error": ON_SAVE_ERROR, "online.on_error": ON_ERROR,
            "compression": ("zstd",), "async_writer": ASYNC_WRITERS}


def _keys(own=()) -> List[Tuple[str, object]]:
    """(dotted key, default) for every leaf of the config, e.g. ("online.base_interval", 50),
    but those the script's own flags set (``own``)."""
    out = []
    for f in fields(AdaCheckConfig):
        if f.name in own:
            continue
        if f.name in _SECTIONS:
            cls = _SECTIONS[f.name][0]
            out += [(f"{f.name}.{g.name}", getattr(cls(), g.name)) for g in fields(cls)]
        else:
            out.append((f.name, getattr(AdaCheckConfig(), f.name)))
    return out


def flag_of(key: str) -> str:
    return _SPECIAL.get(key, "--adacheck-" + key.replace(".", "-").replace("_", "-"))


def _dest(key: str) -> str:
    return "adacheck" if key == "enabled" else "adacheck_" + key.replace(".", "_")


def _interval(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def add_config_flags(parser: argparse.ArgumentParser, own: Optional[Dict[str, str]] = None):
    """Add the flags to ``parser`` (in a group of their own, which is returned)."""
    g = parser.add_argument_group("AdaCheck", "deduplicated, verified checkpoints (see adacheck/config.py)")
    for key, default in _keys(own or {}):
        flag, dest = flag_of(key), _dest(key)
        if key == "enabled":
            g.add_argument(flag, action="store_true", default=None, help="save and load checkpoints with AdaCheck")
        elif key == "online.enabled":
            g.add_argument(flag, dest=dest, action="store_true", default=None,
                           help="online gradient deltas after every optimizer step (needs --adacheck)")
        elif key == "tiers.memory":
            g.add_argument(flag, dest=dest, action="store_true", default=None,
                           help="every save to node-local memory first, every --adacheck-tiers-persist-interval-th "
                                "copied to the checkpoint directory in the background (needs --adacheck)")
        elif key == "tiers.memory_dir":
            g.add_argument(flag, dest=dest, default=None, metavar="DIR",
                           help="the memory tier's directory (default $ADACHECK_MEMORY_DIR, else /dev/shm/adacheck)")
        elif key == "save_dir":
            g.add_argument(flag, dest=dest, default=None, metavar="DIR",
                           help="checkpoint directory or fsspec URL, e.g. s3://bucket/prefix "
                                "(default: --save / --load)")
        elif key == "storage_options":
            g.add_argument(flag, dest=dest, type=json_object_arg, default=None, metavar="JSON",
                           help="fsspec filesystem arguments for a URL, e.g. '{\"endpoint_url\": \"http://host:9000\"}'")
        elif isinstance(default, bool):
            g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                           default=None, help=f"adacheck.{key} (default {str(default).lower()})")
        elif key in _CHOICES:
            g.add_argument(flag, dest=dest, choices=_CHOICES[key], default=None,
                           help=f"adacheck.{key} (default {default})")
        elif key == "lease_ttl_s":
            g.add_argument(flag, dest=dest, type=float, default=None, metavar="SECONDS",
                           help=f"adacheck.{key} (default {default:g})")
        elif key == "online.base_interval":
            g.add_argument(flag, dest=dest, type=_interval, default=None, metavar="N|auto",
                           help=f"adacheck.{key} (default {default})")
        else:
            g.add_argument(flag, dest=dest, type=int, default=None, metavar="N",
                           help=f"adacheck.{key} (default {default})")
    return g


def config_from_flags(args: argparse.Namespace, own: Optional[Dict[str, str]] = None) -> AdaCheckConfig:
    """The validated AdaCheckConfig for parsed ``args`` (``own``: see :func:`add_config_flags`);
    ConfigError names the flag."""
    own = own or {}
    block, sections = {}, {name: {} for name in _SECTIONS}
    for key, _ in _keys(own):
        v = getattr(args, _dest(key), None)
        if v is not None:
            section, _, leaf = key.partition(".")
            if leaf:
                sections[section][leaf] = v
            else:
                block[key] = v
    given = [flag_of(k) for k in block if k != "enabled"] + [flag_of(f"{n}.{k}") for n, sec in sections.items()
                                                            for k in sec]
    if given and not block.get("enabled"):
        raise ConfigError(f"{', '.join(given)} given without --adacheck; add --adacheck to use "
                          "AdaCheck, or drop the other --adacheck-* flags")
    for name, (_, switch, what) in _SECTIONS.items():
        others = [flag_of(f"{name}.{k}") for k in sections[name] if k != switch]
        if others and not sections[name].get(switch):
            raise ConfigError(f"{', '.join(others)} given without {flag_of(f'{name}.{switch}')}; add "
                              f"{flag_of(f'{name}.{switch}')} {what}, or drop those flags")
    for name, sec in sections.items():
        if sec:
            block[name] = sec
    if block.get("enabled"):
        for key, dest in own.items():
            if getattr(args, dest, None):
                block[key] = True
    try:
        return AdaCheckConfig.from_dict(block)
    except ConfigError as e:
        msg = re.sub(r"adacheck\.([\w.]+)", lambda m: flag_of(m.group(1)), str(e))
        raise ConfigError(msg.replace(" must be true or false", " must be given as a flag")) from None
