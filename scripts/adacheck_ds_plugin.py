"""pytest plugin for ``scripts/check_deepspeed_suite.py``: DeepSpeed's own tests, natively or with
AdaCheck turned on, without editing DeepSpeed's files.

Loaded with ``-p adacheck_ds_plugin`` (this directory on PYTHONPATH) in both modes, it records
every test's start and outcome, one JSON line each, in ``$ADACHECK_DS_SUITE_EVENTS`` as they
happen (a run killed by the watchdog keeps what it had).

Version skew (a test tree of another DeepSpeed version than the installed one) is bridged here,
in both modes alike and never in what a test asserts: DeepSpeed 0.19.8 removed sparse-gradient
support and with it ``DeepSpeedEngine.sparse_tensor_module_names``, which the tests' shared
``compare_deepspeed_states`` compares between the saved and the loaded engine; where the installed
engine lacks it, engines get it as an empty set (what the removed feature held for a model without
sparse embeddings; 0.19.8 reduces every gradient dense). And DeepSpeed's ``DistributedFixture``
(a class that a test names as a fixture, run on its own world size) makes itself a fixture through
``_pytestfixturefunction``, which pytest 8.4+ no longer reads ("fixture 'baseline_ws2' not found");
where pytest does not see such a class as a fixture, a fixture of its name, visible in its module,
runs the class as DeepSpeed's conftest does (``cls()(request)``).
``ADACHECK_DS_SUITE_SHIMS=0`` turns both off. ``ADACHECK_DS_SUITE_PRELOAD=1`` makes the
multiprocessing forkserver import torch and deepspeed once, so DistributedTest's ranks are forked
with them imported instead of importing them each.

With ``ADACHECK_DS_SUITE=1`` it also injects AdaCheck: ``import adacheck_ds`` and a wrapper around
``deepspeed.initialize`` that adds ``"adacheck": {"enabled": true}`` to the config it is given (a
dict, in place, as DeepSpeed itself mutates it; a path to a JSON file or base64 JSON: a copy with
the block; ``args.deepspeed_config`` / ``args.deepscale_config``: a copy of ``args`` naming such a
copy). DeepSpeed's ``DistributedTest`` runs each test body in worker processes (a forkserver pool,
or spawned processes), which never load pytest plugins: the check script therefore puts a
``sitecustomize.py`` on their PYTHONPATH that calls :func:`boot`, so every Python process of the run
patches ``deepspeed`` the moment it is imported. Workers log each ``initialize`` (was AdaCheck
attached to the engine?) and each ``save_checkpoint`` (was a ``manifest.json`` written?), tagged
with the test the main process is running.

``deepspeed.initialize`` called from AdaCheck's own modules (its conversions start engines) is left
alone: the block goes into the configs the tests give.
"""
from __future__ import annotations

import base64
import copy
import functools
import importlib.abc
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time

INJECT_ENV = "ADACHECK_DS_SUITE"            # "1": inject AdaCheck
SHIMS_ENV = "ADACHECK_DS_SUITE_SHIMS"       # "0": no version-skew shims
PRELOAD_ENV = "ADACHECK_DS_SUITE_PRELOAD"   # "1": the forkserver imports torch and deepspeed
EVENTS_ENV = "ADACHECK_DS_SUITE_EVENTS"     # JSON-lines file of events (all processes append)
BLOCK = {"enabled": True}
_OWN = ("adacheck", "adacheck_ds", "adacheck_megatron")
_state = {"installed": False, "hooked": False, "shimmed": False}


# ------------------------------------------------------------------ events
def _current_file() -> str | None:
    ev = os.environ.get(EVENTS_ENV)
    return ev + ".current" if ev else None


def current_test() -> str | None:
    """The node id of the test the pytest process is running (workers cannot see PYTEST_CURRENT_TEST:
    a forkserver's children have the environment of the forkserver's start)."""
    path = _current_file()
    try:
        with open(path) as f:
            return f.read().strip() or None
    except (OSError, TypeError):
        return None


def log(event: str, **fields) -> None:
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    rec = {"event": event, "t": time.time(), "pid": os.getpid(), "rank": os.environ.get("RANK")}
    rec.setdefault("nodeid", None)
    rec.update(fields)
    if rec["nodeid"] is None:
        rec["nodeid"] = current_test()
    line = (json.dumps(rec, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)      # one write on an O_APPEND file: lines of processes do not interleave
    finally:
        os.close(fd)


# ------------------------------------------------------------------ injection
def _with_block(cfg: dict) -> dict:
    block = cfg.get("adacheck")
    cfg["adacheck"] = {**(block if isinstance(block, dict) else {}), **BLOCK}
    return cfg


def _load_config(text_or_path: str) -> dict:
    if os.path.exists(text_or_path):
        with open(text_or_path) as f:
            return json.load(f)
    # DeepSpeed also accepts a base64-encoded JSON string
    return json.loads(base64.urlsafe_b64decode(text_or_path).decode())


def _write_copy(cfg: dict, like: str) -> str:
    base = os.path.basename(like) if os.path.exists(like) else "ds_config.json"
    fd, path = tempfile.mkstemp(prefix="adacheck_", suffix="_" + base)
    with os.fdopen(fd, "w") as f:
        json.dump(_with_block(cfg), f)
    return path


def _inject(arguments: dict) -> list[str]:
    """Add the block to the config in ``arguments`` (deepspeed.initialize's bound arguments);
    what was changed, for the log."""
    how = []
    for key in ("config", "config_params"):
        cfg = arguments.get(key)
        if isinstance(cfg, dict):
            _with_block(cfg)
            how.append(f"{key}=dict")
        elif isinstance(cfg, str):
            arguments[key] = _write_copy(_load_config(cfg), cfg)
            how.append(f"{key}=path")
        elif cfg is not None:
            how.append(f"{key}={type(cfg).__name__} (left alone)")
    args = arguments.get("args")
    if args is not None:
        for attr in ("deepspeed_config", "deepscale_config"):
            val = getattr(args, attr, None)
            if isinstance(val, str):
                args = copy.copy(args)
                setattr(args, attr, _write_copy(_load_config(val), val))
                arguments["args"] = args
                how.append(f"args.{attr}=path")
            elif isinstance(val, dict):
                args = copy.copy(args)
                setattr(args, attr, _with_block(copy.deepcopy(val)))
                arguments["args"] = args
                how.append(f"args.{attr}=dict")
    return how


def _wrap_initialize(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def initialize(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "") or ""
        if caller.split(".")[0] in _OWN:
            return orig(*args, **kwargs)
        bound = sig.bind_partial(*args, **kwargs)
        how = _inject(bound.arguments)
        try:
            result = orig(*bound.args, **bound.kwargs)
        except BaseException as e:
            log("initialize", how=how, error=f"{type(e).__name__}: {e}"[:500])
            raise
        engine = result[0] if isinstance(result, tuple) and result else result
        log("initialize", how=how, engine=type(engine).__name__,
            adacheck=getattr(engine, "adacheck", None) is not None)
        return result

    initialize.__adacheck_suite__ = True
    return initialize


def _manifests(save_dir) -> list[str]:
    found = []
    try:
        root = os.fspath(save_dir)
    except TypeError:
        return found
    if "://" in root or not os.path.isdir(root):
        return found
    base = root.rstrip(os.sep).count(os.sep)
    for d, dirs, files in os.walk(root):
        if "manifest.json" in files:
            found.append(os.path.relpath(os.path.join(d, "manifest.json"), root))
        if d.count(os.sep) - base >= 2:
            dirs[:] = []
    return found


def shim() -> None:
    """Version-skew shims, in both modes (see the module's docstring)."""
    if _state["shimmed"] or os.environ.get(SHIMS_ENV) == "0":
        return
    _state["shimmed"] = True
    from deepspeed.runtime.engine import DeepSpeedEngine
    if "sparse_tensor_module_names" not in dir(DeepSpeedEngine):
        orig_init = DeepSpeedEngine.__init__

        @functools.wraps(orig_init)
        def __init__(self, *args, **kwargs):
            orig_init(self, *args, **kwargs)
            if not hasattr(self, "sparse_tensor_module_names"):
                self.sparse_tensor_module_names = set()

        DeepSpeedEngine.__init__ = __init__


def _after_deepspeed() -> None:
    shim()
    if os.environ.get(INJECT_ENV) == "1":
        install()


def install() -> None:
    """Import adacheck_ds and wrap deepspeed.initialize and the engine's save/load (idempotent)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    import deepspeed
    import adacheck_ds
    from deepspeed.runtime.engine import DeepSpeedEngine

    adacheck_ds.install()
    if not getattr(deepspeed.initialize, "__adacheck_suite__", False):
        deepspeed.initialize = _wrap_initialize(deepspeed.initialize)

    save, load = DeepSpeedEngine.save_checkpoint, DeepSpeedEngine.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(self, save_dir, *args, **kwargs):
        try:
            out = save(self, save_dir, *args, **kwargs)
        except BaseException as e:
            log("save", dir=str(save_dir), adacheck=getattr(self, "adacheck", None) is not None,
                error=f"{type(e).__name__}: {e}"[:500])
            raise
        log("save", dir=str(save_dir), adacheck=getattr(self, "adacheck", None) is not None,
            manifests=_manifests(save_dir))
        return out

    @functools.wraps(load)
    def load_checkpoint(self, load_dir, *args, **kwargs):
        try:
            out = load(self, load_dir, *args, **kwargs)
        except BaseException as e:
            log("load", dir=str(load_dir), adacheck=getattr(self, "adacheck", None) is not None,
                error=f"{type(e).__name__}: {e}"[:500])
            raise
        log("load", dir=str(load_dir), adacheck=getattr(self, "adacheck", None) is not None)
        return out

    DeepSpeedEngine.save_checkpoint, DeepSpeedEngine.load_checkpoint = save_checkpoint, load_checkpoint


class _AfterDeepSpeed(importlib.abc.MetaPathFinder):
    """Calls shim() and install() right after ``deepspeed/__init__.py`` has run, in whatever process imports it."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _after_deepspeed()

        spec.loader.exec_module = exec_then_install
        return spec


def boot() -> None:
    """In a process of the run: shim (and inject) now if deepspeed is imported, else when it is."""
    if _state["hooked"] or not os.environ.get(EVENTS_ENV):
        return
    _state["hooked"] = True
    if "deepspeed" in sys.modules:
        _after_deepspeed()
    else:
        sys.meta_path.insert(0, _AfterDeepSpeed())


boot()


# ------------------------------------------------------------------ pytest hooks (main process)
def pytest_configure(config):
    if os.environ.get(PRELOAD_ENV) == "1":
        import multiprocessing.forkserver
        multiprocessing.forkserver.set_forkserver_preload(["torch", "deepspeed"])
    log("session", argv=sys.argv, inject=os.environ.get(INJECT_ENV) == "1",
        shims=os.environ.get(SHIMS_ENV) != "0", preload=os.environ.get(PRELOAD_ENV) == "1")


def pytest_collectstart(collector):
    import pytest
    if os.environ.get(SHIMS_ENV) == "0" or not isinstance(collector, pytest.Module):
        return
    try:
        module = collector.obj       # (imported here rather than a moment later; an error shows there)
    except Exception:
        return
    holder = _distributed_fixtures(module)
    if holder is not None:
        collector.session._fixturemanager.parsefactories(holder=holder, node=collector)


def _distributed_fixtures(module):
    """A module of fixtures for the DistributedFixture subclasses of ``module`` that pytest does not
    see as fixtures (see the docstring), or None.  The classes stay where they are: DistributedTest
    pickles the fixture object to its ranks, which find the class by its name."""
    import types
    import pytest
    from _pytest.fixtures import getfixturemarker
    base = getattr(sys.modules.get("unit.common"), "DistributedFixture", None)
    if base is None:
        return None
    holder = None
    for name, obj in list(vars(module).items()):
        if (inspect.isclass(obj) and issubclass(obj, base) and obj is not base and obj.__name__ == name
                and isinstance(getattr(obj, "world_size", None), int) and getfixturemarker(obj) is None):
            def fixture(request, cls=obj):
                # what DeepSpeed's conftest does for an is_dist_fixture in pytest_fixture_setup, in
                # the fixture's body instead: a skip there (a fixture of more ranks than devices)
                # left pytest >= 8.4's fixture state unfinished, failing the next parameter's setup
                cls()(request)
            fixture.__name__ = name
            if holder is None:
                holder = types.ModuleType(f"adacheck_ds_suite_fixtures_{module.__name__}")
            setattr(holder, name, pytest.fixture(name=name)(fixture))
            log("shim", what=f"DistributedFixture {module.__name__}.{name} as a fixture")
    return holder


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        log("collected", nodeids=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid, location):
    path = _current_file()
    if path:
        with open(path, "w") as f:
            f.write(nodeid)
    log("start", nodeid=nodeid)


def pytest_runtest_logreport(report):
    rec = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "duration": round(report.duration, 3)}
    if hasattr(report, "wasxfail"):
        rec["xfail"] = True
    if report.outcome == "failed":
        rec["longrepr"] = str(report.longrepr)[-20000:]
    elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        rec["reason"] = str(report.longrepr[2])[:300]
    log("report", **rec)


def pytest_runtest_logfinish(nodeid, location):
    path = _current_file()
    if path:
        with open(path, "w") as f:
            f.write("")
    log("finish", nodeid=nodeid)


def pytest_sessionfinish(session, exitstatus):
    ds = sys.modules.get("deepspeed")
    log("sessionend", exitstatus=int(exitstatus), deepspeed_file=getattr(ds, "__file__", None),
        deepspeed_version=getattr(ds, "__version__", None),
        adacheck_ds_file=getattr(sys.modules.get("adacheck_ds"), "__file__", None))
