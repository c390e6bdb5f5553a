"""AdaCheck for DeepSpeed.

``import adacheck_ds`` makes every DeepSpeedEngine whose config has an enabled
``"adacheck"`` block save and load through AdaCheck; ``attach(engine, config)`` does the
same for an engine built any other way.  Without the block DeepSpeed is unchanged.
``save_native`` / ``load_native`` always call DeepSpeed's own implementation.
"""
from __future__ import annotations

from adacheck.compat import warn_if_untested
from adacheck.config import AdaCheckConfig

from .engine import AdaCheckDeepSpeed, load_native, save_native

warn_if_untested("deepspeed")

__all__ = ["AdaCheckDeepSpeed", "attach", "detach", "save_native", "load_native", "install"]

_ORIG = {}


def attach(engine, config=None) -> AdaCheckDeepSpeed:
    """Route ``engine.save_checkpoint`` / ``load_checkpoint`` through AdaCheck.

    ``config``: an AdaCheckConfig, a dict like the JSON block, or None for the engine's block.
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


def _block_of(engine):
    cfg = getattr(engine, "_config", None)
    raw = getattr(cfg, "_param_dict", None)
    return raw.get("adacheck") if isinstance(raw, dict) else None


def _config_given(args, kwargs):
    """The DeepSpeed config dict an engine is being built from, before DeepSpeed builds it."""
    config_class = kwargs.get("config_class")
    raw = getattr(config_class, "_param_dict", None)
    if isinstance(raw, dict):
        return raw
    config = kwargs.get("config")
    if config is None:
        config = getattr(kwargs.get("args", args[0] if args else None), "deepspeed_config", None)
    if isinstance(config, str):
        from deepspeed.runtime.config import load_ds_config
        config = load_ds_config(config)
    return config if isinstance(config, dict) else None


def install() -> None:
    """Patch DeepSpeedEngine once (idempotent)."""
    if _ORIG:
        return
    from deepspeed.runtime.engine import DeepSpeedEngine
    _ORIG.update({name: getattr(DeepSpeedEngine, name) for name in ("__init__", "save_checkpoint", "load_checkpoint")})

    def __init__(self, *args, **kwargs):
        # validated before DeepSpeed builds anything: a mistake costs no model start-up
        config = AdaCheckConfig.in_config(_config_given(args, kwargs), "DeepSpeed")
        _ORIG["__init__"](self, *args, **kwargs)
        block = _block_of(self)
        if config is None and block is not None:    # (a config DeepSpeed found some other way)
            config = AdaCheckConfig.from_dict(block)
        self.adacheck = None
        if config is not None and config.enabled:
            self.adacheck = AdaCheckDeepSpeed(self, config)

    def save_checkpoint(self, *args, **kwargs):
        ac = getattr(self, "adacheck", None)
        if ac is not None:
            return ac.save_checkpoint(*args, **kwargs)
        return _ORIG["save_checkpoint"](self, *args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        ac = getattr(self, "adacheck", None)
        if ac is not None:
            return ac.load_checkpoint(*args, **kwargs)
        return _ORIG["load_checkpoint"](self, *args, **kwargs)

    for name, fn in (("__init__", __init__), ("save_checkpoint", save_checkpoint),
                     ("load_checkpoint", load_checkpoint)):
        fn.__wrapped__, fn.__doc__ = _ORIG[name], _ORIG[name].__doc__
        setattr(DeepSpeedEngine, name, fn)


install()
