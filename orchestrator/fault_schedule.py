"""Which fault each rank injects at each step, from the job file's ``faults:`` list (deterministic).

One-shot faults (``kill_rank``, ``kill_node``, ``hang_rank``, ``nan_loss``) fire once at
``at_step``, so the step re-run after recovery is clean; a ``slow_rank`` stays
slow from ``at_step`` on.
"""

from __future__ import annotations


class FaultSchedule:
    def __init__(self, faults):
        self.pending = [f.model_dump() for f in faults]

    def add(self, fault: dict) -> None:
        """A fault requested while the job runs (the control API's InjectFault)."""
        self.pending.append(dict(fault))

    def for_step(self, step: int) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for fault in self.pending:
            if fault["kind"] == "slow_rank":
                if step >= fault["at_step"]:
                    out[fault["rank"]] = fault
            elif fault["at_step"] == step and not fault.get("fired"):
                fault["fired"] = True
                out[fault["rank"]] = fault
        return out
