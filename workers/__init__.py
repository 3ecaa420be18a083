"""Per-rank code: process groups, the reference model, parallel wrappers, data, the train step.

Nothing here imports the orchestrator: workers receive a plain spec dict.
"""
