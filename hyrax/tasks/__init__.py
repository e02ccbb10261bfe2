"""Synthetic tasks for the demo checkpoint: generator, training, and accuracy evaluation
(in-process and against a live server), including the forced-retraction arms."""
