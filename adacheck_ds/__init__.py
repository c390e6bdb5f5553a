"""AdaCheck for DeepSpeed.

``import adacheck_ds`` makes every DeepSpeedEngine whose config has an enabled
``"adacheck"`` block save and load through AdaCheck; ``attach(engine, config)`` does the
same for an engine built any other way.  Without the block DeepSpeed is unchanged.
``save_native`` / ``load_native`` always call DeepSpeed's own implementation.
DeepSpeed's fp32 export (``deepspeed.utils.zero_to_fp32``) and its universal conversion
(``deepspeed.checkpoint.ds_to_universal.main``) read AdaCheck checkpoints too.
"""
from __future__ import annotations

import os

from adacheck.compat import not_installed, warn_if_untested

try:
    from deepspeed.runtime.engine import DeepSpeedEngine
except ModuleNotFoundError as e:
    raise not_installed(e, "deepspeed", "deepspeed", "deepspeed") from None
from deepspeed.checkpoint import ds_to_universal
from deepspeed.runtime import engine as ds_runtime_engine
from deepspeed.utils import zero_to_fp32 as ds_zero_to_fp32

from adacheck.config import AdaCheckConfig
from adacheck.errors import ConfigError

from . import zero_to_fp32
from .engine import DEEPSPEED_METHODS, AdaCheckDeepSpeed, load_native, param_dict, save_native
from .state import refuse_config

warn_if_untested("deepspeed")

__all__ = ["AdaCheckDeepSpeed", "attach", "detach", "save_native", "load_native", "install"]

# DeepSpeedEngine's own methods that install() replaced: save_native / load_native call these
_ORIG = DEEPSPEED_METHODS


def attach(engine, config=None) -> AdaCheckDeepSpeed:
    """Route ``engine.save_checkpoint`` / ``load_checkpoint`` through AdaCheck.

    Args:
        engine: a DeepSpeedEngine (or PipelineEngine).
        config: an AdaCheckConfig, a dict like the JSON block, or None for the engine's block
            (``enabled`` is implied).

    Returns:
        ``engine.adacheck``, the engine's :class:`AdaCheckDeepSpeed`.
    """
    install()
    if config is None:
        config = AdaCheckConfig.from_dict(_block_of(engine) or {"enabled": True})
    elif isinstance(config, dict):
        config = AdaCheckConfig.from_dict(config)
    if not config.enabled:
        config = AdaCheckConfig(**{**config.__dict__, "enabled": True})
    engine.adacheck = AdaCheckDeepSpeed(engine, config)
    return engine.adacheck


def detach(engine) -> None:
    engine.adacheck = None


def check_checkpoint_section(raw) -> None:
    """DeepSpeed's ``"checkpoint"`` config section with AdaCheck on: ``tag_validation`` is honoured
    at each save and ``load_universal`` at each load (a universal checkpoint is DeepSpeed's own
    files, which DeepSpeed loads; an AdaCheck checkpoint loads into any layout anyway);
    ``parallel_write.pipeline_stage`` asks for what AdaCheck always does (every rank writes its
    share of the checkpoint); ``use_node_local_storage`` is refused (ConfigError)."""
    section = (raw or {}).get("checkpoint") or {}
    if isinstance(section, dict) and section.get("use_node_local_storage"):
        raise ConfigError(
            "checkpoint.use_node_local_storage is true: DeepSpeed then writes a copy of the checkpoint "
            "to each node's own disk. An AdaCheck checkpoint is one directory that every rank writes its "
            "share of and reads from, so it needs storage every node sees: set use_node_local_storage "
            "to false and give save_checkpoint a shared directory or an fsspec URL (adacheck.tiers.memory "
            "saves to node-local memory first, then to that storage)")


def _block_of(engine):
    return (param_dict(getattr(engine, "_config", None)) or {}).get("adacheck")


def install() -> None:
    """Patch DeepSpeedEngine once (idempotent)."""
    if _ORIG:
        return
    _ORIG.update({name: getattr(DeepSpeedEngine, name) for name in ("__init__", "save_checkpoint", "load_checkpoint")})

    def __init__(self, *args, **kwargs):
        # validated before DeepSpeed builds anything: a mistake costs no model start-up
        # deepspeed.initialize passes the config parsed, as config_class
        raw = param_dict(kwargs.get("config_class"))
        config = AdaCheckConfig.in_config(raw, "DeepSpeed")
        if config is not None and config.enabled:
            check_checkpoint_section(raw)
            refuse_config(raw)
        _ORIG["__init__"](self, *args, **kwargs)
        block = _block_of(self)
        if config is None and block is not None:    # a config DeepSpeed found some other way
            config = AdaCheckConfig.from_dict(block)
        self.adacheck = None
        if config is not None and config.enabled:
            check_checkpoint_section(param_dict(getattr(self, "_config", None)))
            self.adacheck = AdaCheckDeepSpeed(self, config)

    def routed(name: str):
        def method(self, *args, **kwargs):
            ac = getattr(self, "adacheck", None)
            return getattr(ac, name)(*args, **kwargs) if ac is not None else _ORIG[name](self, *args, **kwargs)
        return method

    for name, fn in (("__init__", __init__), ("save_checkpoint", routed("save_checkpoint")),
                     ("load_checkpoint", routed("load_checkpoint"))):
        fn.__name__, fn.__wrapped__, fn.__doc__ = name, _ORIG[name], _ORIG[name].__doc__
        setattr(DeepSpeedEngine, name, fn)

    # DeepSpeed's fp32 export: its convert_* and load_state_dict_* call this one by its module name
    native_fp32 = ds_zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint

    def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                                 lazy_mode=False):
        if zero_to_fp32.adacheck_dir(checkpoint_dir, tag) is None:
            return native_fp32(checkpoint_dir, tag, exclude_frozen_parameters, lazy_mode)
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    get_fp32_state_dict_from_zero_checkpoint.__wrapped__ = native_fp32
    get_fp32_state_dict_from_zero_checkpoint.__doc__ = native_fp32.__doc__
    ds_zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint = get_fp32_state_dict_from_zero_checkpoint
    # DeepSpeed's engine imported it by name: its ZeRO-3 load without optimizer states calls it on
    # the load directory's 'latest', which may be an AdaCheck checkpoint beside the native one loaded
    ds_runtime_engine.get_fp32_state_dict_from_zero_checkpoint = get_fp32_state_dict_from_zero_checkpoint

    # DeepSpeed's universal conversion (ds_to_universal.main(args), as its tests and scripts call
    # it): an AdaCheck checkpoint goes through adacheck convert --to deepspeed-universal
    native_universal = ds_to_universal.main

    def main(args):
        if zero_to_fp32.adacheck_dir(args.input_folder) is None:
            return native_universal(args)
        from .convert import to_universal
        out_dir, out_name = os.path.split(os.path.normpath(args.output_folder))
        to_universal(args.input_folder, out_dir, out_name=out_name)
    main.__wrapped__, main.__doc__ = native_universal, native_universal.__doc__
    ds_to_universal.main = main


install()
