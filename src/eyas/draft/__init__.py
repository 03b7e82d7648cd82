"""draft/: the EAGLE-3 draft: model, config, formats, TTT forward, loss, training data, set-up."""
