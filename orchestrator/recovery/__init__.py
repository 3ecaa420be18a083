"""Recovery decisions and their inputs: which snapshot to roll back to, elastic shrink/grow, lost nodes, stragglers."""
