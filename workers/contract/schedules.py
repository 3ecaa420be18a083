"""The pipeline schedules raymesh runs: one frozen record of facts per schedule, in one table keyed by name.

Torch-free, so the spec checks, the planner and the workers read the same facts: before this table each of them
kept its own tuple of names ("which schedules split backward", "which are V-shaped"), and a new schedule had to be
added in five places that could disagree. ``workers.parallel.pipeline`` maps ``torch_class`` onto
``torch.distributed.pipelining``; everything else here is arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How many stage-microbatches a rank holds activations for at its peak (see Schedule.in_flight):
#   all: every forward before any backward (GPipe); warmup: pp - r forwards before the first backward (1F1B);
#   interleaved_warmup: Megatron's interleaved warm-up; v_shape: the ZB-V paper's peak of 2*pp chunks.
InFlightRule = Literal["all", "warmup", "interleaved_warmup", "v_shape"]


@dataclass(frozen=True)
class Schedule:
    """What one pipeline schedule needs and does; the methods turn the facts into numbers for one job."""

    name: str
    torch_class: str | None  # the class in torch.distributed.pipelining that runs it (None: ours, asynchronous)
    default_stages_per_rank: int  # when parallel.virtual_stages is not set
    single_stage: bool  # exactly one stage per pp rank (the torch class takes one stage, not a list)
    v_shape: bool  # exactly 2 stages per rank, placed r and 2*pp-1-r, so the first and last share a rank
    interleaved: bool  # several stages per rank in a loop; microbatches must be a multiple of pp
    split_backward: bool  # backward runs as input-gradient then deferred weight-gradient passes
    min_microbatches_per_pp: int  # microbatches >= this * pp (dualpipev: one per stage, two stages a rank)
    in_flight_rule: InFlightRule
    # PipeDream's asynchronous schedules (workers.parallel.async_pipeline): weights change between microbatches
    asynchronous: bool = False
    # weight versions a stage stashes besides its live weights at most: "in_flight" (PipeDream: one per
    # microbatch in flight, pp - r on rank r), 2 (2BW), 0 (synchronous: forward and backward see the same weights)
    stashed_versions: Literal[0, 2, "in_flight"] = 0

    @property
    def placement(self) -> str:
        """``v`` (stages r and 2*pp-1-r) or ``loop`` (stages r, r+pp, r+2*pp, ...)."""
        return "v" if self.v_shape else "loop"

    @property
    def all_forwards_first(self) -> bool:
        """Every microbatch's forward runs before any backward, so the loss head is in flight for all of them."""
        return self.in_flight_rule == "all"

    def weight_copies(self, pp: int, pp_rank: int, microbatches: int) -> int:
        """Stashed weight versions pp rank ``pp_rank`` holds at its peak besides its live weights."""
        if self.stashed_versions == "in_flight":
            return self.in_flight(pp, pp_rank, microbatches)
        return self.stashed_versions

    def min_microbatches(self, pp: int) -> int:
        return self.min_microbatches_per_pp * pp

    def stage_ids(self, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
        """Global stage indices owned by ``pp_rank``."""
        if self.v_shape:
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + v * pp for v in range(stages_per_rank)]

    def in_flight(self, pp: int, pp_rank: int, microbatches: int, stages_per_rank: int = 1) -> int:
        """Stage-microbatches whose activations pp rank ``pp_rank`` holds at its peak.

        The unit is one microbatch through one of the rank's stages (chunks).
        - no pipeline: microbatches run forward+backward one after another (gradient accumulation): 1.
        - all (gpipe): all forwards before any backward: every microbatch on every chunk.
        - warmup (1f1b): rank r runs pp - r forwards before its first backward (Narayanan et al.).
        - interleaved_warmup (interleaved 1F1B, zero bubble): warm-up of (v-1)·pp + 2·(pp-1-r) chunk
          forwards, plus the one whose backward comes first (Megatron's interleaved schedule, PyTorch's too).
        - v_shape (zbv, dualpipev; 2 chunks): the ZB-V paper's peak of pp microbatches through the whole
          rank, i.e. 2·pp chunk-microbatches.
        """
        if pp == 1:
            return 1
        total = microbatches * stages_per_rank
        if self.in_flight_rule == "all":
            return total
        if self.in_flight_rule == "warmup":
            return min(microbatches, pp - pp_rank)
        if self.in_flight_rule == "v_shape":
            return min(total, 2 * pp)
        return min(total, (stages_per_rank - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def _loop(name: str, torch_class: str, *, multi: bool, split: bool, rule: InFlightRule) -> Schedule:
    return Schedule(name, torch_class, default_stages_per_rank=2 if multi else 1, single_stage=not multi,
                    v_shape=False, interleaved=multi, split_backward=split, min_microbatches_per_pp=1,
                    in_flight_rule=rule)


def _v(name: str, torch_class: str, *, min_per_pp: int) -> Schedule:
    return Schedule(name, torch_class, default_stages_per_rank=2, single_stage=False, v_shape=True,
                    interleaved=False, split_backward=True, min_microbatches_per_pp=min_per_pp,
                    in_flight_rule="v_shape")


# order matters: it is the order the job file's error for an unknown schedule lists the names in
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    _loop("gpipe", "ScheduleGPipe", multi=False, split=False, rule="all"),
    _loop("1f1b", "Schedule1F1B", multi=False, split=False, rule="warmup"),
    _loop("interleaved_1f1b", "ScheduleInterleaved1F1B", multi=True, split=False, rule="interleaved_warmup"),
    _loop("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", multi=True, split=True,
          rule="interleaved_warmup"),
    _v("zbv", "ScheduleZBVZeroBubble", min_per_pp=1),
    _v("dualpipev", "ScheduleDualPipeV", min_per_pp=2),
    Schedule("pipedream", None, default_stages_per_rank=1, single_stage=True, v_shape=False, interleaved=False,
             split_backward=False, min_microbatches_per_pp=1, in_flight_rule="warmup", asynchronous=True,
             stashed_versions="in_flight"),
    Schedule("pipedream_2bw", None, default_stages_per_rank=1, single_stage=True, v_shape=False,
             interleaved=False, split_backward=False, min_microbatches_per_pp=1, in_flight_rule="warmup",
             asynchronous=True, stashed_versions=2),
)}
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)


def schedule(name: str) -> Schedule:
    """The table's record for ``name``; the error lists the names a job file may use."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"pp_schedule {name!r} is not a pipeline schedule raymesh runs; "
                         f"pick one of {list(SCHEDULE_NAMES)}") from None
