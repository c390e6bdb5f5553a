"""Megatron integration (see issue: Megatron integration). Not implemented yet."""
