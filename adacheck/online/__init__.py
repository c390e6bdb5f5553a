"""The online mode: per-step deltas of what optimizers consumed between base checkpoints, their
recording and their replay at recovery."""
