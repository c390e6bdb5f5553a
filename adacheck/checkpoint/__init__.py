"""One checkpoint's save and load, collective over a job's ranks: the :class:`Checkpointer`, the
state an integration hands it (:class:`LocalState` of :class:`LocalShard`), and the
:class:`CheckpointReader` a load reads through."""
import importlib

__all__ = ["CheckpointReader", "Checkpointer", "DeferredSource", "LegacyFormatWarning", "LocalShard", "LocalState",
           "Options", "RankObjectLookup", "confirm_files", "describe_save", "exchange_blob", "find_intact", "human",
           "load", "resolve", "save", "structure_of", "verify_part"]


def __getattr__(name):
    # imported on first use: the submodules import each other's packages, and an eager
    # re-export here would make those imports circular
    if name in __all__:
        return getattr(importlib.import_module(".checkpointer", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
