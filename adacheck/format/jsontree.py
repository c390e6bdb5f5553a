"""Non-tensor state as JSON, with tensors pulled out as logical tensors.

Encodes dicts, lists, tuples, str, int, float (incl. inf/nan), bool and None exactly;
tensors become ``{"__tensor__": name}`` and are returned separately.  Anything else
is a StateError naming where it was found.  Decoding is the exact inverse.
"""
from __future__ import annotations

import math
from typing import Callable, List, Tuple

import torch

from ..errors import FormatError, StateError


def encode(obj, prefix: str) -> Tuple[object, List[Tuple[str, torch.Tensor]]]:
    tensors: List[Tuple[str, torch.Tensor]] = []

    def enc(x, path: str):
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            if math.isfinite(x):
                return x
            return {"__float__": repr(x)}
        if isinstance(x, torch.Tensor):
            name = f"{prefix}{path}"
            tensors.append((name, x))
            return {"__tensor__": name}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(x)]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v, f"{path}/{k}") for k, v in x.items()}
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int, bool, type(None))) or isinstance(k, float):
                    raise StateError(f"cannot save {prefix}{path}: dict key {k!r} of type "
                                     f"{type(k).__name__} is not str/int/bool/None")
                items.append([k, enc(v, f"{path}/{k}")])
            return {"__dict__": items}
        try:
            import numpy as np
            if isinstance(x, np.generic):
                return enc(x.item(), path)
            if isinstance(x, np.ndarray):
                return enc(torch.from_numpy(np.ascontiguousarray(x)), path)
        except ImportError:  # pragma: no cover
            pass
        raise StateError(
            f"cannot save {prefix}{path or '/'}: a {type(x).__module__}.{type(x).__qualname__} is "
            "neither JSON-able nor a tensor. AdaCheck never pickles; convert it to plain "
            "values (dict/list/str/int/float/bool/None) or tensors before saving.")

    return enc(obj, ""), tensors


_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def decode(tree, fetch: Callable[[str], torch.Tensor]):
    """The value ``encode`` encoded; a tree that ``encode`` cannot have made is a FormatError."""
    try:
        return _decoded(tree, fetch)
    except RecursionError:
        raise FormatError("saved object tree is nested too deeply") from None


def _decoded(x, fetch: Callable[[str], torch.Tensor]):
    # (a module function, not a closure calling itself: such a closure is a reference cycle that
    # would keep ``fetch``, and the checkpoint reader it reads with, until the garbage collector runs)
    if isinstance(x, list):
        return [_decoded(v, fetch) for v in x]
    if isinstance(x, dict):
        if "__tensor__" in x:
            if not isinstance(x["__tensor__"], str):
                raise FormatError(f"saved object tree: tensor reference {x!r} is not a name")
            return fetch(x["__tensor__"])
        if "__tuple__" in x:
            if not isinstance(x["__tuple__"], list):
                raise FormatError(f"saved object tree: {x!r} is not a tuple")
            return tuple(_decoded(v, fetch) for v in x["__tuple__"])
        if "__float__" in x:
            if not isinstance(x["__float__"], str) or x["__float__"] not in _NON_FINITE:
                raise FormatError(f"saved object tree: {x!r} is not a non-finite float")
            return _NON_FINITE[x["__float__"]]
        if "__dict__" in x:
            items = x["__dict__"]
            if not isinstance(items, list) or not all(
                    isinstance(i, list) and len(i) == 2 and isinstance(i[0], (str, int, bool, type(None)))
                    and not isinstance(i[0], float) for i in items):
                raise FormatError(f"saved object tree: {x!r} is not a list of [key, value] pairs")
            return {k: _decoded(v, fetch) for k, v in items}
        return {k: _decoded(v, fetch) for k, v in x.items()}
    if x is None or isinstance(x, (bool, str, int, float)):
        return x
    raise FormatError(f"unexpected value {x!r} in saved object tree")


def tensor_refs(tree) -> List[str]:
    """Names of the tensors a tree refers to."""
    out: List[str] = []

    def walk(x):
        if isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            if "__tensor__" in x:
                out.append(x["__tensor__"])      # the manifest parser checks each is a stored name
            else:
                for v in x.values():
                    walk(v)

    walk(tree)
    return out


def saveable(tree, what: str, strict: bool = True, quiet: bool = False, tensors: bool = True):
    """``tree`` if it can be saved (:func:`encode`).  Else a StateError (``strict``), or for a dict
    the entries that can, each dropped one with a warning unless ``quiet``.  ``tensors=False``
    also drops a dict's tensor entries (a record of plain values)."""
    import warnings
    try:
        encode(tree, what)
        if tensors or not isinstance(tree, dict):
            return tree
    except StateError:
        if strict or not isinstance(tree, dict):
            raise
    kept = {}
    for k, v in tree.items():
        if not tensors and isinstance(v, torch.Tensor):
            continue
        try:
            encode(v, f"{what}/{k}")
            kept[k] = v
        except StateError as e:
            if not quiet:
                warnings.warn(f"AdaCheck: not saving {what}[{k!r}]: {e}")
    return kept


def dicts(tree):
    """Every dict inside ``tree``, ``tree`` included (depth first)."""
    if isinstance(tree, dict):
        yield tree
    if isinstance(tree, (dict, list, tuple)):
        for v in (tree.values() if isinstance(tree, dict) else tree):
            yield from dicts(v)


def find(tree, key):
    """The first value (not None) stored under ``key`` anywhere in ``tree`` (depth first), else None."""
    return next((d[key] for d in dicts(tree) if d.get(key) is not None), None)
