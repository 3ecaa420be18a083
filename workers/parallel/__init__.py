"""Parallel wrappers applied from outside the model: pipeline split, TP/SP (and each family's plan), data
parallel/ZeRO, recompute. The torch-free facts the driver shares (``Grid``, the schedule table) are in
``workers.contract``."""
