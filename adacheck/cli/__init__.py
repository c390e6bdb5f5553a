"""The ``adacheck`` command: look inside and check AdaCheck checkpoints.

This module parses the command line (``--help`` and ``--version`` answer without importing
torch); the subcommands are in :mod:`adacheck.cli.commands`."""
from __future__ import annotations

import argparse
import os
import re
import sys

from .. import __version__
from ..errors import AdaCheckError, NothingToDo

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    try:
        return float(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else float(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 30m, 12h or 7d") from None


def _size(text: str) -> int:
    """Bytes of a size as Hugging Face reads them: 5GB = 5 * 10**9, 5GiB = 5 * 2**30, 1048576; a
    lowercase b after a decimal unit means bits (5Gb = 5 * 10**9 / 8 bytes)."""
    m = re.match(r"^(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?)(B))?$", text.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB (10^9 bytes), 5GiB (2^30 bytes), "
                                         "500MB or 1048576")
    power = " KMGT".index(m.group(2).upper()) if m.group(2) else 0
    n = float(m.group(1)) * ((1024 if m.group(3) else 1000) ** power)
    return int(n / 8 if m.group(4) == "b" and not m.group(3) else n)


EXIT_CODES = ("exit status: 0 ok; 1 damage found (verify, ls), tensors that differ (diff), no checkpoint in "
              "the directory (ls); 2 a usage error, or an error that stopped the command (a missing "
              "directory, a damaged manifest, an unreachable storage)")


CONVERSIONS = ("conversions (adacheck convert SRC OUT ...): AdaCheck -> full weights (--to weights, the "
               "default), native DeepSpeed (--to deepspeed), a DeepSpeed universal checkpoint (--to "
               "deepspeed-universal), megatron-core torch_dist (--to torch-dist); native DeepSpeed or torch_dist "
               "-> AdaCheck (--from deepspeed / --from torch-dist); DeepSpeed online deltas -> one AdaCheck "
               "checkpoint (--to adacheck). adacheck convert --help lists the formats installed here.")


def _json_object(text: str):
    from ..config import json_object_arg
    return json_object_arg(text)


_json_object.__name__ = "JSON object"      # argparse: "invalid JSON object value: ..."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adacheck", description="Inspect, verify, compare, prune, clean and convert "
                                "AdaCheck checkpoints. " + CONVERSIONS, epilog=EXIT_CODES)
    p.add_argument("--version", action="version", version=f"adacheck {__version__}", help="print the version")
    sub = p.add_subparsers(dest="cmd", required=True)

    def command(name, helptext, **kw):      # its help is also the description of `adacheck NAME --help`
        return sub.add_parser(name, help=helptext, description=helptext, **kw)
    for name, helptext in [("inspect", "show layout, step, tensors and bytes. Bytes: held = what all ranks hold "
                                       "(a replica counts on every rank that holds it); logical = each tensor "
                                       "once; derived = not stored, rebuilt on load as a proven cast of another "
                                       "tensor (bf16 weights from the fp32 masters); stored / written here = in "
                                       "this checkpoint's files; referenced = read from an earlier checkpoint's "
                                       "files (unchanged boxes); distinct = each different copy once"),
                           ("verify", "check every stored box against its hash")]:
        s = command(name, helptext)
        s.add_argument("path", help="a save directory (its 'latest' is used) or a checkpoint directory")
        s.add_argument("--tag", help="checkpoint tag inside PATH (default: the one 'latest' names)")
        s.set_defaults(fn=name)
    sub.choices["inspect"].add_argument("--json", action="store_true", help="machine-readable output")
    sub.choices["inspect"].add_argument("--memory-dir", metavar="DIR", default=None,
                                        help="the memory tier's directory, for what it holds of this checkpoint "
                                             "directory (default: $ADACHECK_MEMORY_DIR, else /dev/shm/adacheck)")
    sub.choices["inspect"].add_argument("--tensors", action="store_true", help="list every logical tensor")
    sub.choices["inspect"].add_argument("--redundancy", action="store_true",
                                        help="bytes held / distinct / written / referenced per kind "
                                             "and per holder group; diverged replicas")
    sub.choices["verify"].add_argument("--quiet", action="store_true", help="no progress bar")
    sub.choices["verify"].add_argument("--json", action="store_true", help="machine-readable output")
    s = command("prune", helptext="retire old checkpoints (dry run unless --yes); never the latest, "
                       "never a file a kept checkpoint reads")
    s.add_argument("path", help="a save directory")
    s.add_argument("--keep-last", type=int, metavar="K", help="keep the newest K checkpoints")
    s.add_argument("--older-than", type=_duration, metavar="AGE", help="retire checkpoints older than AGE "
                   "(90s, 30m, 12h, 7d)")
    s.add_argument("--yes", action="store_true", help="really delete (default: only show what would go)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn="prune")
    s = command("clean", helptext="list the memory tier's checkpoints of jobs (tiers.memory), and remove them "
                       "(dry run unless --yes): what a killed job left in node-local memory")
    s.add_argument("--memory-dir", metavar="DIR", default=None,
                   help="the memory tier's directory (default: $ADACHECK_MEMORY_DIR, else /dev/shm/adacheck)")
    s.add_argument("--job", action="append", metavar="JOB", help="only this job (repeatable; default: every job)")
    s.add_argument("--yes", action="store_true", help="really delete (default: only show what would go)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn="clean")
    s = command("diff", helptext="which tensors differ between two checkpoints, and by how much "
                       "(exit 1 if any)")
    s.add_argument("a", help="checkpoint directory, or a save directory (its latest)")
    s.add_argument("b", help="the other checkpoint (directory, or save directory: its latest)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--no-verify", action="store_true", help="do not check hashes while reading")
    s.set_defaults(fn="diff")
    s = command("convert", add_help=False, helptext="to full model weights (safetensors) or another "
                       "installed format (DeepSpeed native or universal, megatron-core torch_dist), or from one "
                       "into AdaCheck (adacheck convert --help lists them)")
    s.add_argument("src", nargs="?", help="a save directory (its 'latest') or a checkpoint directory")
    s.add_argument("out", nargs="?", help="output directory")
    s.add_argument("-h", "--help", action="store_true", help="show this help (with --to/--from FORMAT: its options)")
    s.add_argument("--tag", help="checkpoint tag inside SRC")
    s.add_argument("--to", default=None, metavar="FORMAT",
                   help="weights (default from AdaCheck), adacheck, or an installed format (adacheck convert --help)")
    s.add_argument("--from", dest="from_", default="adacheck", metavar="FORMAT",
                   help="adacheck (default), or an installed format SRC is in, converted into AdaCheck under OUT")
    s.add_argument("--dtype", choices=["model", "fp32", "bf16", "fp16"], default=None,
                   help="--to weights: the training dtype of the module weights (model, the default), or the "
                        "fp32 master weights (where there are) as fp32, bf16 or fp16")
    s.add_argument("--max-shard-size", type=_size, metavar="SIZE", help="--to weights: split into shards of at "
                   "most SIZE (5GB = 5*10^9 bytes, as Hugging Face counts; 5GiB = 5*2^30) with a "
                   "model.safetensors.index.json")
    s.add_argument("--overwrite", action="store_true", help="--to weights: replace existing output files")
    s.add_argument("--config", metavar="PATH", help="--to weights: the model's config.json (or a directory "
                   "holding one) to write beside the weights, so that from_pretrained(OUT) loads them; default: "
                   "the config.json in SRC or beside the checkpoint (a Hugging Face Trainer's checkpoint-N has it)")
    s.add_argument("--no-verify", action="store_true", help="do not check hashes while reading")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn="convert")
    s = command("ls", helptext="list the checkpoints of a save directory: damaged (a file missing or cut "
                       "short, a manifest that cannot be read), unverified, verified (--verify), retired or "
                       "INCOMPLETE (no manifest: an interrupted save)")
    s.add_argument("path", help="a save directory")
    s.add_argument("--verify", action="store_true", help="also re-hash every box of every checkpoint")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn="ls")
    for name, s in sub.choices.items():
        if name == "clean":
            continue     # the memory tier is node-local files, never a URL
        s.add_argument("--storage-options", type=_json_object, metavar="JSON",
                       help="for a URL PATH (s3://bucket/prefix, ...): the fsspec filesystem's arguments, e.g. "
                            "'{\"endpoint_url\": \"http://host:9000\"}'")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    try:
        return _run(p, args, rest)
    except BrokenPipeError:     # the reader went away (adacheck ls | head): stop writing, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(p, args, rest) -> int:
    if args.fn == "convert" and not args.help and (args.src is None or args.out is None):
        p.error("convert needs SRC and OUT (adacheck convert --help)")
    if args.fn != "convert" and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        from . import commands as cli_commands     # torch and the checkpoint code: only now
        command = getattr(cli_commands, f"cmd_{args.fn}")
        return command(args, rest) if args.fn == "convert" else command(args)
    except NothingToDo as e:
        print(f"adacheck {args.cmd}: {e}")
        return 0
    except AdaCheckError as e:
        print(f"adacheck {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as e:     # the system refused a path: not writable, not a directory, ...
        where = f": {e.filename}" if e.filename else ""
        print(f"adacheck {args.cmd}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
