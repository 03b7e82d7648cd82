"""store/: the folders steps hand over: manifests, shards, checkpoints, splits, vocab files."""
