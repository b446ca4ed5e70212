"""How the demo model was made: the synthetic task generator, the demo's tokenizer, training and
evaluation. Not shipped with the package; run from the repository root (``python -m training.X``)."""
