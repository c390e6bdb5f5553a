"""What each rank writes: the pure save planner, the ring and partitioned exchanges that give every
rank what it plans from, and the one module that calls torch.distributed (:mod:`.exchange`)."""
