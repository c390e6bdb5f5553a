"""AdaCheck for DeepSpeed.

``import adacheck_ds`` makes every DeepSpeedEngine whose config has an enabled
``"adacheck"`` block save and load through AdaCheck; ``attach(engine, config)`` does the
same for an engine built any other way.  Without the block DeepSpeed is unchanged.
``save_native`` / ``load_native`` always call DeepSpeed's own implementation.
"""
from __future__ import annotations

import difflib

from adacheck.compat import warn_if_untested
from adacheck.config import AdaCheckConfig
from adacheck.errors import ConfigError

from .engine import AdaCheckDeepSpeed

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


def _normal(key: str) -> str:
    return "".join(c for c in key.lower() if c.isalnum())


def check_config(raw) -> "AdaCheckConfig | None":
    """The validated ``"adacheck"`` block of a DeepSpeed config dict (None without one).  A
    top-level key that looks like a misspelt ``"adacheck"`` (``"adachek"``, ``"AdaCheck"``,
    ``"ada_check"``) is a ConfigError: DeepSpeed ignores unknown keys, so the block would be
    silently lost and training would go on with native checkpoints."""
    if not isinstance(raw, dict):
        return None
    for key in raw:
        if key != "adacheck" and isinstance(key, str) and (
                _normal(key) == "adacheck" or difflib.SequenceMatcher(None, key.lower(), "adacheck").ratio() >= 0.8):
            raise ConfigError(f"the DeepSpeed config has a top-level key {key!r}; did you mean \"adacheck\"? "
                              "DeepSpeed ignores unknown keys, so this block would not turn AdaCheck on. Rename it "
                              "to \"adacheck\".")
    block = raw.get("adacheck")
    return AdaCheckConfig.from_dict(block) if block is not None else None


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


def save_native(engine, *args, **kwargs):
    """DeepSpeed's own save_checkpoint, whatever is attached."""
    install()
    return _ORIG["save"](engine, *args, **kwargs)


def load_native(engine, *args, **kwargs):
    install()
    return _ORIG["load"](engine, *args, **kwargs)


def install() -> None:
    """Patch DeepSpeedEngine once (idempotent)."""
    if _ORIG:
        return
    from deepspeed.runtime.engine import DeepSpeedEngine
    _ORIG.update(init=DeepSpeedEngine.__init__, save=DeepSpeedEngine.save_checkpoint,
                 load=DeepSpeedEngine.load_checkpoint)

    def __init__(self, *args, **kwargs):
        # validated before DeepSpeed builds anything: a mistake costs no model start-up
        config = check_config(_config_given(args, kwargs))
        _ORIG["init"](self, *args, **kwargs)
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
        return _ORIG["save"](self, *args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        ac = getattr(self, "adacheck", None)
        if ac is not None:
            return ac.load_checkpoint(*args, **kwargs)
        return _ORIG["load"](self, *args, **kwargs)

    for name, fn in (("__init__", __init__), ("save_checkpoint", save_checkpoint),
                     ("load_checkpoint", load_checkpoint)):
        fn.__wrapped__ = _ORIG[{"__init__": "init", "save_checkpoint": "save",
                                "load_checkpoint": "load"}[name]]
        fn.__doc__ = fn.__wrapped__.__doc__
        setattr(DeepSpeedEngine, name, fn)


install()
