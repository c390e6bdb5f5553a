"""Checkpoint tiers in front of the durable checkpoint directory: node-local memory
(:class:`~.memory.MemoryTier`), and the copies of a node's files that its peers keep.

- :mod:`.tiered`: :class:`~.tiered.TieredCheckpointer`, the memory tier wrapped around a job's
  Checkpointer, and the choice of tier for a load (:class:`~.tiered.TieredLoader`);
- :mod:`.memory`: the memory tier: its saves, copies to durable storage, and exit;
- :mod:`.location`: where a job's copies live on a node;
- :mod:`.peers`: copies between nodes, and the packing of files sent between ranks;
- :mod:`.persist`: copies from memory to durable storage;
- :mod:`.recovery`: which node's copy a load reads, and what moves to the nodes that lack it."""
import importlib

_WHERE = {"TieredCheckpointer": "tiered", "TieredLoader": "tiered", "MemoryTier": "memory", "memory_location": "location", "spares_of": "location",
          "NodeSpread": "peers", "DeltaSpread": "peers", "Reused": "peers", "pack_files": "peers", "pack_step": "peers",
          "receive_file": "peers", "receive_step": "peers", "shard_check": "peers", "unpack_files": "peers",
          "delta_moves": "recovery", "fetch": "recovery", "plan_recovery": "recovery",
          "own_files": "persist", "persist_checkpoint": "persist"}
__all__ = sorted(_WHERE)


def __getattr__(name):
    # imported on first use: the submodules import each other's packages, and an eager
    # re-export here would make those imports circular
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
