"""Which fault each rank injects at each step, from the job file's ``faults:`` list (deterministic).

One-shot faults (``kill_rank``, ``kill_node``, ``hang_rank``, ``nan_loss``,
``raise_error``, ``oom``, ``corrupt_checkpoint``) fire once at ``at_step``, so the step re-run after
recovery is clean; a ``slow_rank`` stays slow from ``at_step`` on; a fault
with ``every_s`` repeats (``orchestrator.faults.soak``). ``corrupt_checkpoint`` acts
on storage and ``kill_ps_shard`` on a parameter-server shard, so the controller
injects them, not a rank: they come from ``for_controller``, never from the
rank-keyed ``for_step``, where they would collide with a rank's own fault.
"""

from __future__ import annotations

from orchestrator.faults.soak import RepeatingFault

CONTROLLER_KINDS = ("corrupt_checkpoint", "kill_ps_shard")


class FaultSchedule:
    def __init__(self, faults):
        dumped = [f.model_dump() for f in faults]
        self.pending = [f for f in dumped if f.get("every_s") is None]
        self.repeating = [RepeatingFault(f) for f in dumped if f.get("every_s") is not None]

    def add(self, fault: dict) -> None:
        """A fault requested while the job runs (the control API's InjectFault)."""
        self.pending.append(dict(fault))

    def for_step(self, step: int, world_size: int) -> dict[int, dict]:
        """The ranks' faults for ``step``; repeating faults due now become one-shot faults at ``step`` first."""
        for soak in self.repeating:
            fired = soak.due(step, world_size)
            if fired is not None:
                self.pending.append(fired)
        out: dict[int, dict] = {}
        for fault in self.pending:
            if fault["kind"] in CONTROLLER_KINDS:
                continue
            if fault["kind"] == "slow_rank":
                if step >= fault["at_step"]:
                    out[fault["rank"]] = fault
            elif fault["at_step"] == step and not fault.get("fired"):
                fault["fired"] = True
                out[fault["rank"]] = fault
        return out

    def for_controller(self, step: int) -> list[dict]:
        """Faults the controller injects itself at ``step`` (call after ``for_step`` for the same step)."""
        due = [f for f in self.pending if f["kind"] in CONTROLLER_KINDS and f["at_step"] == step and not f.get("fired")]
        for fault in due:
            fault["fired"] = True
        return due
