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


def mismatches(specs: dict, runs: dict, rel: float = 0.05) -> list[tuple]:
    """``(name, rank, dim, predicted, counted)`` wherever a run's counted bytes in its last step differ from the
    model's by more than ``rel`` (``specs`` and ``runs`` keyed alike)."""
    out = []
    for name, spec in specs.items():
        for rank, dims in compare(spec, runs[name].field("comm_bytes")).items():
            out += [(name, rank, dim, want, got) for dim, (want, got) in dims.items()
                    if abs(want - got) > rel * max(abs(want), abs(got))]
    return out
