"""Typed JSON records: what an integration keeps besides tensors (a checkpoint's objects, each
saving rank's objects, the scalars of one online step) declared once, as a dataclass whose
fields are the keys.

The module that writes a record and the modules that read it share its class, so a key is
spelt in one place and a reader cannot ask for one the writer never wrote.  ``tree()`` is the
JSON object that is saved; ``of(tree, where)`` checks every field it declares (a damaged or
foreign record is a :class:`FormatError` naming the field, before anything is applied) and
ignores keys it does not declare (written by a newer version).  A field with a default may be
absent (written by an older version)::

    @dataclass
    class StepScalars(Record):
        iteration: int = entry(is_int, "an integer")
        scheduler: Optional[dict] = entry(optional(dict), "an object or null", default=None)
"""
from __future__ import annotations

from dataclasses import MISSING, field, fields
from typing import Callable, Dict, Tuple, Type, TypeVar

from ..errors import FormatError

Expect = Dict[str, Tuple[Callable[[object], bool], str]]   # record field -> (test, what it must be)
R = TypeVar("R", bound="Record")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def of_kind(kind) -> Callable[[object], bool]:
    return lambda v: isinstance(v, kind)


def optional(kind) -> Callable[[object], bool]:
    return lambda v: v is None or isinstance(v, kind)


def int_map(v) -> bool:
    return isinstance(v, dict) and all(is_int(x) for x in v.values())


def number_map(v) -> bool:
    return isinstance(v, dict) and all(is_number(x) for x in v.values())


def entry(check: Callable[[object], bool], says: str, **kwargs):
    """A record field: ``check`` says whether a saved value is valid, ``says`` what it must be
    (for the error); ``default`` / ``default_factory`` as for a dataclass field."""
    return field(metadata={"check": check, "says": says}, **kwargs)


def check_fields(tree, expect: Expect, where: str) -> None:
    """Raise FormatError unless ``tree`` is an object holding each field of ``expect`` as described."""
    if not isinstance(tree, dict):
        raise FormatError(f"{where}: the record is not an object")
    for key, (ok, what) in expect.items():
        if not ok(tree.get(key)):
            raise FormatError(f"{where}: {key} is {str(tree.get(key))[:60]}, expected {what}; the record is "
                              "damaged or was written by another integration")


class Record:
    """Base of a typed record (subclasses are dataclasses whose fields are made with :func:`entry`)."""

    def tree(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def expect(cls) -> Expect:
        """Each field's check, for :func:`check_fields` (a field that may be absent also passes
        as null)."""
        out = {}
        for f in fields(cls):
            check, says = f.metadata["check"], f.metadata["says"]
            if f.default is MISSING and f.default_factory is MISSING:
                out[f.name] = (check, says)
            else:
                out[f.name] = (lambda v, check=check: v is None or check(v), says)
        return out

    @classmethod
    def of(cls: Type[R], tree, where: str) -> R:
        """The record saved as ``tree``; FormatError naming ``where`` and the field if it is not one."""
        if not isinstance(tree, dict):
            raise FormatError(f"{where}: expected an object, found {type(tree).__name__}")
        values = {}
        for f in fields(cls):
            if f.name not in tree and (f.default is not MISSING or f.default_factory is not MISSING):
                continue     # written before the field existed
            value = tree.get(f.name)
            if not f.metadata["check"](value):
                raise FormatError(f"{where}: {f.name} is {str(value)[:60]}, expected {f.metadata['says']}; "
                                  "the checkpoint is damaged or was written by another integration")
            values[f.name] = value
        return cls(**values)
