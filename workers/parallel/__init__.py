"""Parallel wrappers applied from outside the model: pipeline split, TP/SP, data parallel/ZeRO, recompute."""
