"""One exception root for everything AdaCheck raises on purpose.

Every message says what was expected, what was found, and what the user can do.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple


class AdaCheckError(Exception):
    """Root of all AdaCheck errors."""


class ConfigError(AdaCheckError, ValueError):
    """The `adacheck` config block, a flag or an argument is invalid (also a ValueError, as
    DeepSpeed raises for an empty ``save_dir``)."""


class TagMismatchError(ConfigError, AssertionError):
    """The ranks of one save named different checkpoint tags (also an AssertionError, as
    DeepSpeed's ``checkpoint.tag_validation: "FAIL"`` raises one for this)."""


class FormatError(AdaCheckError):
    """A checkpoint file or manifest is malformed, truncated or inconsistent."""


class IntegrityError(FormatError):
    """Stored bytes, or the manifest itself, do not match the hash recorded for them."""


class NotFoundError(AdaCheckError):
    """No (complete) checkpoint where one was asked for."""


class StateError(AdaCheckError):
    """Training state cannot be captured or restored (e.g. a non-JSON-able object)."""


class StorageError(AdaCheckError, OSError):
    """The storage (an object store, a remote filesystem) could not be reached or refused an
    operation; the message names the operation, the path and the backend's own error."""


class LeaseError(AdaCheckError):
    """Another job holds the save directory's lease (:mod:`adacheck.storage.lease`), or took it over from
    this job: this job's save is refused, and nothing of the other job's is touched."""


class NothingToDo(AdaCheckError):
    """What was asked is already so (the CLI says it on stdout and exits 0)."""


class CorruptCheckpointWarning(UserWarning):
    """A damaged checkpoint or delta step was skipped and older intact state loaded instead
    (on_corrupt: fallback)."""


KINDS = {c.__name__: c for c in (AdaCheckError, ConfigError, FormatError, IntegrityError, NotFoundError,
                                  StateError, StorageError, TagMismatchError, LeaseError)}


class DistributedError(AdaCheckError):
    """One or more ranks failed a collective step; every rank raises it, naming each cause.

    ``failures``: rank -> message; ``kinds``: rank -> the name of the exception class that rank
    raised.  When every failing rank raised the same AdaCheck error class, the error raised
    (:meth:`of`) is also an instance of that class, on every rank: ``except IntegrityError``
    catches a hash mismatch found by any rank."""

    kind: Optional[str] = None      # the AdaCheck error class every failing rank raised, if one

    def __init__(self, what: str, failures: Dict[int, str], kinds: Optional[Dict[int, str]] = None):
        self.what = what
        self.failures = dict(failures)
        self.kinds = dict(kinds or {})
        lines = [f"{what} failed on {len(failures)} rank(s):"]
        for rank in sorted(failures):
            lines.append(f"  rank {rank}: {failures[rank]}")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        """Pickled with every rank's cause and the class it combines (a launcher passes a rank's
        exception to its parent process): the same class, message and details come back."""
        return _rebuild, (self.kind, self.what, self.failures, self.kinds, self.args, dict(self.__dict__))

    @classmethod
    def of(cls, what: str, failures: Dict[int, Tuple[str, str]]) -> "DistributedError":
        """The error for ``failures`` (rank -> (exception class name, message))."""
        kinds = {r: k for r, (k, _) in failures.items()}
        shared = set(kinds.values())
        base = KINDS.get(shared.pop()) if len(shared) == 1 else None
        klass = cls if base in (None, AdaCheckError) else _combined(base)
        return klass(what, {r: m for r, (_, m) in failures.items()}, kinds)


_COMBINED: Dict[type, type] = {}


def _combined(base: type) -> type:
    """DistributedError that is also a ``base`` (one class per base, made once)."""
    if base not in _COMBINED:
        _COMBINED[base] = type(f"Distributed{base.__name__}", (DistributedError, base),
                               {"kind": base.__name__, "__module__": __name__,
                                "__doc__": f"A {base.__name__} raised by one or more ranks, on every rank."})
    return _COMBINED[base]


def _rebuild(kind: Optional[str], what: str, failures: Dict[int, str], kinds: Dict[int, str], args: tuple,
             state: dict) -> DistributedError:
    """A pickled DistributedError (see its ``__reduce__``), its message as it was when sent."""
    klass = _combined(KINDS[kind]) if kind in KINDS and kind != "AdaCheckError" else DistributedError
    err = klass(what, failures, kinds)
    err.args = args
    err.__dict__.update(state)
    return err


def kind_of(e: BaseException) -> str:
    """The class name ``DistributedError.of`` groups ``e`` by: the AdaCheck error class (also
    through a DistributedError that carries one), else the exception's own class name."""
    if isinstance(e, DistributedError):
        return e.kind or "DistributedError"
    return type(e).__name__


class SaveWarning(UserWarning):
    """A save that did not complete as asked, with ``on_error: "warn"``: training goes on."""
