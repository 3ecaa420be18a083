"""Offload: a tiered tensor store and what uses it (optimizer state, parameters, activations)."""
