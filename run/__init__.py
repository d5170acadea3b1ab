"""The run layer: the typed run config (``RunConfig``) and the read side of checkpoints (find,
resolve, load weights and trainer state). Evaluation and training both build on it."""
