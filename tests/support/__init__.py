"""Helpers the tests import: the tiny job, the single-process reference, test-only actors and clusters."""
