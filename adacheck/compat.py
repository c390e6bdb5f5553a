"""The torch and framework versions AdaCheck is tested with; a warning when another one is found.

The integrations rely on internals of DeepSpeed (optimizer wrappers, engine attributes) and
megatron-core (sharded state dicts, parallel state) that change between minor versions; they
say so once, at import, when the installed version is not one the test suite ran with.  torch
has no upper bound in the package's requirements (pip must keep a user's CUDA build); the core
(``import adacheck``, which every integration and the CLI import) says so once instead."""
from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

# the minor versions the test suite ran with, oldest first (CI: torch 2.13.0, DeepSpeed 0.19.8,
# megatron-core 0.16.1; also run: the core, DeepSpeed and Megatron tests with torch 2.14.1, and
# the Megatron tests with megatron-core 0.17.1, 0.18.2 and 0.19.0 from source,
# scripts/check_versions.sh)
TESTED = {"torch": ("2.13", "2.14"), "deepspeed": ("0.19",), "megatron-core": ("0.16", "0.17", "0.18", "0.19")}


class UntestedVersionWarning(UserWarning):
    """An installed framework version AdaCheck's tests did not run with."""


def untested(dist: str, found: Optional[str] = None) -> Optional[str]:
    """The warning text if ``dist`` (installed, or ``found``) is not of a tested minor version."""
    if found is None:
        try:
            found = version(dist)
        except PackageNotFoundError:
            return None
    if ".".join(found.split(".")[:2]) in TESTED[dist]:
        return None
    return (f"AdaCheck is tested with {dist} {' / '.join(v + '.x' for v in TESTED[dist])} and found {found}: the "
            f"internals it relies on may differ; run its test suite (bash scripts/test.sh) against this version, "
            f"or install {dist}=={TESTED[dist][-1]}.*")


def not_installed(error: ModuleNotFoundError, module: str, dist: str, extra: str) -> ImportError:
    """The error to raise when importing an integration's framework failed: one that names the
    extra to install when ``module`` itself is missing, else ``error`` as it was (a dependency
    of the framework that is missing is the framework's problem)."""
    if error.name != module:
        return error
    return ImportError(f"this AdaCheck integration needs {dist}, which is not installed: "
                       f"pip install 'adacheck[{extra}]' (or install {dist} yourself)")


def warn_if_untested(dist: str) -> None:
    """An UntestedVersionWarning (attributed to the importer's line) if the installed ``dist``
    is not of a tested minor version; nothing if it is, or if it is not installed. It reads the
    installed metadata only: it imports nothing of ``dist``."""
    text = untested(dist)
    if text is not None:
        warnings.warn(text, UntestedVersionWarning, stacklevel=3)
