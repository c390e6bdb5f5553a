"""One checkpoint's save and load, collective over a job's ranks.

- :mod:`.state`: the shards of a save as the core cuts and hashes them;
- :mod:`.checkpointer`: the :class:`Checkpointer` of a job (save, async save, load, leases);
- :mod:`.saving`: the steps of one save (:class:`SavePipeline`);
- :mod:`.loading`: a load (:class:`Loader`, :class:`LoadResult`);
- :mod:`.reader`: reading a committed checkpoint (:class:`CheckpointReader`);
- :mod:`.options`: :class:`Options` and the job's caches;
- :mod:`.background`, :mod:`.staging`, :mod:`.writer_process`: asynchronous saves;
  :mod:`.lifecycle`: what is finished at exit."""
import importlib

_WHERE = {"CheckpointReader": "reader", "Pieces": "reader", "RankObjectLookup": "reader", "confirm_files": "reader",
          "find_intact": "reader", "resolve": "reader", "verify_part": "reader", "LegacyFormatWarning": "reader",
          "Checkpointer": "checkpointer", "load": "checkpointer", "save": "checkpointer",
          "DeferredSource": "state",
          "Options": "options", "LoadResult": "loading", "Loader": "loading", "SavePipeline": "saving",
          "describe_save": "saving", "exchange_blob": "saving", "human": "saving", "structure_of": "saving"}
__all__ = sorted(_WHERE)


def __getattr__(name):
    # imported on first use: the submodules import each other's packages, and an eager
    # re-export here would make those imports circular
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
