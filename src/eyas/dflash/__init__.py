"""DFlash: the block-parallel draft family (model, objective, training loop); docs/dflash.md."""
