"""The --adacheck flags: one per config key, validated like the DeepSpeed block."""
import argparse
from dataclasses import fields

import pytest

from adacheck.config import AdaCheckConfig, OnlineConfig
from adacheck.errors import ConfigError
from adacheck_megatron.flags import add_adacheck_args, config_from_args, flag_of

pytestmark = pytest.mark.unit


def parse(*argv):
    p = argparse.ArgumentParser()
    p.add_argument("--save")   # a Megatron flag next to ours
    return config_from_args(add_adacheck_args(p).parse_args(list(argv)))


def test_every_config_key_has_a_flag():
    p = add_adacheck_args(argparse.ArgumentParser())
    text = p.format_help()
    for f in fields(AdaCheckConfig):
        if f.name not in ("online", "async_save"):    # (async_save: Megatron-LM's own --async-save)
            assert flag_of(f.name) in text, f.name
    for f in fields(OnlineConfig):
        assert flag_of("online." + f.name) in text, f.name


def test_megatron_async_save_flag_is_honoured_under_adacheck():
    p = add_adacheck_args(argparse.ArgumentParser())
    p.add_argument("--async-save", action="store_true")     # Megatron-LM's flag
    assert config_from_args(p.parse_args(["--adacheck", "--async-save"])).async_save is True
    assert config_from_args(p.parse_args(["--adacheck"])).async_save is False
    assert config_from_args(p.parse_args(["--async-save"])) == AdaCheckConfig()   # Megatron-LM's own then
    c = config_from_args(p.parse_args(["--adacheck", "--adacheck-on-error", "raise",
                                       "--adacheck-storage-options", '{"endpoint_url": "http://h:9000"}',
                                       "--adacheck-dir", "s3://b/run"]))
    assert c.on_error == "raise" and c.storage_options == {"endpoint_url": "http://h:9000"}
    assert config_from_args(p.parse_args(["--adacheck", "--adacheck-compression", "zstd"])).compression == "zstd"
    with pytest.raises(SystemExit):
        p.parse_args(["--adacheck", "--adacheck-compression", "lz4"])


def test_defaults_and_values():
    assert parse() == AdaCheckConfig()
    c = parse("--adacheck", "--adacheck-dir", "/ck", "--adacheck-keep-last", "3", "--no-adacheck-fsync",
              "--adacheck-redundancy-factor", "2", "--adacheck-exchange", "allgather", "--save", "x")
    assert c == AdaCheckConfig(enabled=True, save_dir="/ck", keep_last=3, fsync=False,
                               redundancy_factor=2, exchange="allgather")
    c = parse("--adacheck", "--adacheck-online", "--adacheck-online-base-interval", "auto",
              "--adacheck-online-compact", "--adacheck-online-on-error", "raise")
    assert c.online == OnlineConfig(enabled=True, base_interval="auto", compact=True, on_error="raise")
    assert parse("--adacheck", "--adacheck-online", "--adacheck-online-base-interval", "7").online.base_interval == 7


@pytest.mark.parametrize("argv,match", [
    (["--adacheck", "--adacheck-keep-last", "-1"], "--adacheck-keep-last must be >= 0"),
    (["--adacheck", "--adacheck-redundancy-factor", "0"], "--adacheck-redundancy-factor must be >= 1"),
    (["--adacheck-keep-last", "2"], "--adacheck-keep-last given without --adacheck"),
    (["--adacheck", "--adacheck-online", "--adacheck-online-base-interval", "0"],
     "--adacheck-online-base-interval must be an integer >= 1"),
    (["--adacheck", "--adacheck-online-queue-depth", "3"],
     "--adacheck-online-queue-depth given without --adacheck-online"),
    (["--adacheck-convert-save", "out"], "--adacheck-convert-save converts an AdaCheck checkpoint: add --adacheck"),
])
def test_bad_values_name_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse(*argv)


def test_argparse_rejects_unknown_choices_and_types(capsys):
    with pytest.raises(SystemExit):
        parse("--adacheck", "--adacheck-exchange", "tree")
    assert "invalid choice: 'tree'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--adacheck", "--adacheck-keep-last", "three")
    assert "--adacheck-keep-last: invalid int value" in capsys.readouterr().err
