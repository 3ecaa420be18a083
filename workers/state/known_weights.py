"""Refuse a checkpoint holding model weights the job's model has none of, once DCP has read its metadata.

DCP loads the keys the state asks for and ignores the checkpoint's others, so a model with fewer layers than were
saved loaded without a word, the checkpoint's last layers dropped. The controller refuses that before the ranks
start from the job fields recorded beside each save (``orchestrator.checkpoints.job_record``); a checkpoint saved
before that record existed has none, and this check, made on the ranks against the checkpoint's own keys, is what
is left. Only ``model`` keys are compared: optimizer state, progress and compression feedback are read as the
job asks, and the parameter-server shards have their own folder. The known names are the union over every rank
(``CheckpointIO.load``), so a pipeline stage or a tensor-parallel shard does not take another's layers for extra.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from workers.state.dcp_reading import CheckpointRefusal, SafeLoadPlanner, dcp_load

MODEL = "model."  # DCP's flattened prefix of the model's entries
SHOWN = 3  # extra keys named in the refusal
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"\.expert\d+$")  # expert-parallel saves before experts were saved as whole stacks


class UnknownWeights(CheckpointRefusal):
    """A checkpoint holds model weights the job's model does not (its message is the one-line refusal)."""


def layer_count(names: Iterable[str]) -> int:
    """Layers the names cover: the highest ``layers.<i>`` index plus one (0 without layers)."""
    return max((int(m.group(1)) + 1 for m in map(_LAYER.search, names) if m), default=0)


def unknown(saved: Iterable[str], known: Iterable[str]) -> list[str]:
    """The checkpoint's model keys (``saved``, DCP's flattened names) that no name in ``known`` (the model's state
    dict keys) reads, without the ``model.`` prefix and in order."""
    known = set(known)
    return sorted(key[len(MODEL):] for key in saved if key.startswith(MODEL) and key[len(MODEL):] not in known)


def refusal(checkpoint: str | Path, extra: list[str], saved_layers: int, job_layers: int) -> str:
    """The one-line refusal: a few of the extra keys, the layer counts and the fix."""
    per_expert = [key for key in extra if _PER_EXPERT.search(key)]
    if per_expert:
        return (f"checkpoint {checkpoint} keeps its experts one key per expert ({', '.join(per_expert[:SHOWN])}), "
                "as expert-parallel saves of an older raymesh did; this one reads each expert stack whole "
                "(workers/state/expert_stacks.py); fix: resume it with the raymesh version that saved it, or start "
                "a fresh run in another run_dir or checkpoint.dir")
    more = f" and {len(extra) - SHOWN} more" if len(extra) > SHOWN else ""
    fix = (f"load it with the job file it was trained with (--set model.n_layers={saved_layers})"
           if saved_layers > job_layers else "load it with the job file (model section) it was trained with")
    return (f"checkpoint {checkpoint} holds model weights this job's model has none of ({', '.join(extra[:SHOWN])}"
            f"{more}); it was saved with {saved_layers} layers, the job builds {job_layers}, and loading would drop "
            f"them; fix: {fix}, or start a fresh run in another run_dir or checkpoint.dir")


class KnownWeightsPlanner(SafeLoadPlanner):
    """DCP's load planner (reading no code, ``workers.state.dcp_reading``), refusing (``UnknownWeights``) when the
    checkpoint's metadata names model weights ``known`` lacks."""

    def __init__(self, known: Iterable[str], checkpoint: str | Path, **kwargs):
        super().__init__(checkpoint=checkpoint, **kwargs)
        self.known = set(known)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = metadata.state_dict_metadata
        extra = unknown(saved, self.known)
        if extra:
            model = [k for k in saved if k.startswith(MODEL)]
            raise UnknownWeights(refusal(self.checkpoint, extra, layer_count(model), layer_count(self.known)))


def load_known(state: dict, checkpoint: str | Path, known: Iterable[str], **kwargs) -> None:
    """``dcp_load`` of ``state`` (``kwargs``: its ``process_group`` or ``no_dist``) refusing a checkpoint with model
    weights ``known`` lacks, or one whose files would run code; the refusal is raised as itself, not inside DCP's
    exception that carries every rank's traceback."""
    dcp_load(state, checkpoint, KnownWeightsPlanner(known, checkpoint), **kwargs)
