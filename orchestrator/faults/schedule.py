"""Which fault each rank injects at each step, from the job file's ``faults:`` list (deterministic).

One-shot faults (``kill_rank``, ``kill_node``, ``hang_rank``, ``nan_loss``,
``raise_error``, ``oom``, ``corrupt_checkpoint``) fire once at ``at_step``, so the step re-run after
recovery is clean; a ``slow_rank`` stays slow from ``at_step`` on; a fault
with ``every_s`` repeats (``orchestrator.faults.soak``). ``corrupt_checkpoint`` acts
on storage and ``kill_ps_shard`` on a parameter-server shard, so the controller
injects them, not a rank: they come from ``for_controller``, never from the
rank-keyed ``for_step``, where they would collide with a rank's own fault.

The ranks run windows of steps on their own (``workers.loop``): ``planned`` hands a window the ranks' faults due
in it (known in advance, so no call reaches a rank per step), ``fired_through`` marks them fired as the window's
records arrive, and repeating faults, due by the clock, are posted to the running window as they fall due
(``due_repeating``).
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

    def planned(self, first: int, last: int) -> tuple[dict[int, dict[int, dict]], dict[int, dict]]:
        """The ranks' faults for a window of steps ``first``..``last``: step -> rank -> each one-shot fault not
        fired yet, and rank -> the slow_rank fault that rank runs with (from its at_step on; the latest wins,
        as in ``for_step``). Nothing is marked fired: ``fired_through`` does that as steps complete."""
        once: dict[int, dict[int, dict]] = {}
        slow: dict[int, dict] = {}
        for fault in self.pending:
            if fault["kind"] in CONTROLLER_KINDS or fault.get("fired"):
                continue
            if fault["kind"] == "slow_rank":
                if fault["at_step"] <= last:
                    slow[fault["rank"]] = fault
            elif first <= fault["at_step"] <= last:
                once.setdefault(fault["at_step"], {})[fault["rank"]] = fault
        return once, slow

    def fired_through(self, step: int) -> None:
        """Steps up to ``step`` ran (completed, or failed there): their one-shot rank faults fired."""
        for fault in self.pending:
            if fault["kind"] not in CONTROLLER_KINDS and fault["kind"] != "slow_rank" and fault["at_step"] <= step:
                fault["fired"] = True

    def next_controller_step(self, after: int) -> int | None:
        """The first step after ``after`` at which the controller injects a fault itself (a window ends before it)."""
        steps = [f["at_step"] for f in self.pending
                 if f["kind"] in CONTROLLER_KINDS and not f.get("fired") and f["at_step"] > after]
        return min(steps, default=None)

    def due_repeating(self, step: int, world_size: int) -> list[dict]:
        """Repeating faults whose time has come, as one-shot faults at ``step`` (kept as pending ones, so a window
        that fails before ``step`` plans them again)."""
        fired = [f for soak in self.repeating if (f := soak.due(step, world_size)) is not None]
        self.pending += fired
        return fired

    def for_controller(self, step: int) -> list[dict]:
        """Faults the controller injects itself at ``step`` (call after ``for_step`` for the same step)."""
        due = [f for f in self.pending if f["kind"] in CONTROLLER_KINDS and f["at_step"] == step and not f.get("fired")]
        for fault in due:
            fault["fired"] = True
        return due
