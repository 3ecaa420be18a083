"""The controller's own records: frozen dataclasses whose ``to_dict()`` gives exactly the summary's JSON keys.

The summary JSON and ``raymesh report`` read these keys, so the field order
here is the key order users have always seen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from workers.protocol import RankInfo


@dataclass(frozen=True)
class Layout:
    """The grid a job runs on now: its degrees and every rank's place, device and process (``RankInfo``)."""

    dp: int
    pp: int
    tp: int
    zero: int
    pp_schedule: str
    virtual_stages: int
    microbatches: int
    world_size: int
    ranks: tuple[RankInfo, ...]
    pp_split: tuple[int, ...] = ()  # layers per pipeline stage (parallel.pp_split resolved)
    # the live nodes in the topology order placement filled them in (``runtime/node_order.py``), each a dict of
    # node_id, topology (the raymesh.io/topology label, or "") and address; empty without a Ray cluster
    node_order: tuple[dict, ...] = ()

    def with_ranks(self, ranks: list[RankInfo]) -> Layout:
        """The same grid after it was re-formed (replaced ranks have new processes)."""
        return replace(self, ranks=tuple(ranks))

    def to_dict(self) -> dict:
        """The summary's ``layout``: the keys it always had, in their order, then ``pp_split`` and ``node_order``
        (added later)."""
        head = {k: v for k, v in asdict(self).items() if k not in ("ranks", "pp_split", "node_order")}
        return {**head, "ranks": [r.to_dict() for r in self.ranks], "pp_split": list(self.pp_split),
                "node_order": [dict(n) for n in self.node_order]}


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery: what failed, where the state came from, the steps lost, and (once the next step
    completed) its MTTR and per-phase seconds."""

    kind: str
    rank: int
    at_step: int
    lost_steps: int
    source: str
    identities_before: dict
    dp_from: int
    dp_to: int
    mttr_s: float | None = None
    phases_s: dict | None = None
    stacks: str | None = None  # a hang's: the directory holding every rank's stacks when it was found
    # recovery: keep_training: the steps the other replicas ran while the failed ones were rebuilt (filled in,
    # with skipped_sequences, rejoined_at_step and rejoin_s, when they rejoin: KeepTraining)
    degraded_steps: list | None = None
    node: str | None = None  # a drain's: the node(s) Ray was draining, which the ranks left
    # a hang's: deadline_s (the progress deadline in force), median_step_s (the typical step it followed), silent_s
    # (how long no step had completed when it was found), diagnose_s (every rank's stacks, until the kill)
    detection: dict | None = None

    def completed(self, mttr_s: float, phases_s: dict) -> RecoveryRecord:
        return replace(self, mttr_s=mttr_s, phases_s=phases_s)

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.mttr_s is None:  # not ended yet: the summary only ever holds ended recoveries
            del out["mttr_s"], out["phases_s"]
        for optional in ("stacks", "degraded_steps", "node", "detection"):
            if out[optional] is None:
                del out[optional]
        return out


@dataclass(frozen=True)
class ResizeRecord:
    """One change of dp: ``reason`` request, shrink (after a loss) or grow (back), and where state came from."""

    reason: str
    at_step: int
    dp_from: int
    dp_to: int
    microbatches: int
    source: str
    seconds: float
    lost_steps: int = 0  # steps trained again: the resize's load fell back to an older checkpoint

    def to_dict(self) -> dict:
        return asdict(self)
