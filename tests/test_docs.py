"""The reference pages name every config key, flag and CLI option (issue 62: short docs, nothing lost).

* every key of the config block (``AdaCheckConfig``, nested sections included) is in backticks in
  ``docs/*.md``, spelt as in the JSON block: a top-level key as `keep_last` (its alias if it has one:
  `async`), a nested one by its dotted path, `online.base_interval`, `tiers.memory`;
* every ``--adacheck*`` flag that ``adacheck.flags`` and ``adacheck_megatron.flags`` add to a parser is
  in ``docs/megatron.md`` or ``docs/deepspeed.md`` (a ``--[no-]adacheck-x`` names both ``--adacheck-x``
  and ``--no-adacheck-x``);
* every subcommand (as `adacheck NAME`) and every option string of ``adacheck.cli.build_parser()``
  is in ``docs/cli.md``.

Pure: reads the pages and builds the parsers in this process.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import typing

import pytest

from adacheck import cli, config, flags
from adacheck_megatron import flags as megatron_flags

pytestmark = pytest.mark.unit

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _code_spans(text: str) -> set:
    """The contents of the inline code spans (`...`) of a Markdown text, fenced blocks left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {m.group(1).strip() for m in re.finditer(r"`([^`\n]+)`", text)}


def _section(tp):
    """The config class ``tp`` stands for (a dataclass or a pydantic model, also inside Optional), or None."""
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and (dataclasses.is_dataclass(t) or hasattr(t, "model_fields")):
            return t
    return None


def _config_keys(cls, prefix: str = "") -> list:
    """Every key of the config ``cls`` as the JSON block spells it, nested ones as dotted paths."""
    if hasattr(cls, "model_fields"):                 # pydantic: the field's alias, else its name
        items = [(f.alias or name, f.annotation) for name, f in cls.model_fields.items()]
    else:                                            # dataclass: the module's JSON aliases
        alias = {field: key for key, field in getattr(config, "_ALIASES", {}).items()}
        hints = typing.get_type_hints(cls, vars(config))
        items = [(alias.get(f.name, f.name), hints[f.name]) for f in dataclasses.fields(cls)]
    keys = []
    for key, tp in items:
        keys.append(prefix + key)
        nested = _section(tp)
        if nested is not None:
            keys += _config_keys(nested, f"{prefix}{key}.")
    return keys


def _mentions(flag: str, text: str) -> bool:
    """``flag`` (whole: not the head of a longer one) in ``text``, also as --[no-]X for --X / --no-X."""
    forms = [flag]
    if flag.startswith("--no-"):
        forms.append("--[no-]" + flag[len("--no-"):])
    elif flag.startswith("--"):
        forms.append("--[no-]" + flag[2:])
    return any(re.search(r"(?<![\w\-\]])" + re.escape(f) + r"(?![\w-])", text) for f in forms)


def test_every_config_key_is_in_the_docs():
    keys = _config_keys(config.AdaCheckConfig)
    assert "enabled" in keys and any("." in k for k in keys), keys     # (the walk found the sections)
    spans = set().union(*(_code_spans(p.read_text(encoding="utf-8")) for p in sorted(DOCS.glob("*.md"))))
    missing = [k for k in keys if k not in spans]
    assert not missing, f"config keys not in backticks in docs/*.md: {missing}"


def _adacheck_flags() -> set:
    generic = argparse.ArgumentParser(add_help=False)
    flags.add_config_flags(generic)
    megatron = argparse.ArgumentParser(add_help=False)
    megatron_flags.add_adacheck_args(megatron)
    return {s for p in (generic, megatron) for a in p._actions for s in a.option_strings
            if s.startswith(("--adacheck", "--no-adacheck"))}


def test_every_adacheck_flag_is_in_the_docs():
    names = _adacheck_flags()
    assert {"--adacheck", "--adacheck-dir", "--adacheck-convert-save"} <= names, names
    text = _page("megatron.md") + "\n" + _page("deepspeed.md")
    missing = sorted(f for f in names if not _mentions(f, text))
    assert not missing, f"flags in neither docs/megatron.md nor docs/deepspeed.md: {missing}"


def _cli():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {s for a in parser._actions for s in a.option_strings}
    for p in sub.choices.values():
        options |= {s for a in p._actions for s in a.option_strings}
    return sorted(sub.choices), sorted(options)


def test_every_cli_command_and_option_is_in_cli_md():
    commands, options = _cli()
    assert "convert" in commands and "--json" in options
    text = _page("cli.md")
    missing = [f"adacheck {c}" for c in commands if not re.search(rf"\badacheck {re.escape(c)}\b", text)]
    missing += [o for o in options if not _mentions(o, text)]
    assert not missing, f"not in docs/cli.md: {missing}"
