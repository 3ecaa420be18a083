"""The communication model's bytes beside the bytes a run's collectives counted."""

from __future__ import annotations

from orchestrator.planning.layout_search import predicted_bytes
from workers.contract.grid import Grid


def compare(spec, measured: dict[int, list[dict]]) -> dict[int, dict[str, tuple[float, int]]]:
    """Rank -> dimension -> (predicted, measured) in the last step, for every dimension either one names."""
    predicted, grid = predicted_bytes(spec), Grid.from_parallel(spec.parallel)
    out = {}
    for rank, steps in measured.items():
        want, got = predicted[grid.coords_dict(rank)["pp"]], steps[-1]
        out[rank] = {dim: (want.get(dim, 0.0), got.get(dim, 0)) for dim in set(want) | set(got)}
    return out
