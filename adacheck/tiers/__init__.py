"""Checkpoint tiers in front of the durable checkpoint directory: node-local memory, and the
copies of a node's files that its peers keep."""
import importlib

__all__ = ["NodeSpread", "Reused", "delta_moves", "fetch", "memory_location", "own_files", "pack_files", "pack_step",
           "persist_checkpoint", "plan_recovery", "receive_file", "receive_step", "shard_check", "spares_of",
           "unpack_files"]


def __getattr__(name):
    # imported on first use: the submodules import each other's packages, and an eager
    # re-export here would make those imports circular
    if name in __all__:
        return getattr(importlib.import_module(".memory", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
