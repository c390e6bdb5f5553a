"""Where checkpoint bytes live and how they become a checkpoint: storage backends (POSIX, fsspec),
the write-then-commit catalog, the save directory's lease, and pointers."""
