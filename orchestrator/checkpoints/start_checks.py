"""What a run's start asks of its checkpoint directory: a fresh run finds none there, a resume finds one to load.

A fresh run into a folder holding any ``step-*`` folder (sealed, unsealed or set aside) is refused: a later
``--resume`` would pick whichever run saved the higher step, retention would mix two runs, and an unsealed folder
there may be someone's only copy of weights. A ``--resume`` that finds nothing to load is refused too, instead of
starting over at step 0 without a word (the user asked to continue something): when the job never saved a
checkpoint, and when every checkpoint fails its checksums (each is set aside as ``step-N.corrupt`` first, so the
refusal can name where they went). Each refusal names the directory, what is there and the fixes. A hosted
controller that Ray restarts resumes by itself and may start over where its first life never saved
(``TrainingJob(restarted=True)``); it is refused like the user when checkpoints exist and none loads.
"""

from __future__ import annotations

from orchestrator.checkpoints.directory import CheckpointDir
from orchestrator.errors import SpecError

SHOWN = 4  # folder names a refusal lists of each kind before "and N more"


def refuse_start(spec, resume: bool) -> None:
    """``raymesh run``'s checks of ``spec``'s checkpoint directory before Ray starts (the controller's ``_start``
    makes them again, for the Python API and a submitted job): ``refuse_fresh_run`` or ``refuse_nothing_to_resume``."""
    ckpt = CheckpointDir(spec.checkpoint_dir(), spec.checkpoint.keep)
    if resume:
        refuse_nothing_to_resume(ckpt)
    else:
        refuse_fresh_run(ckpt, str(spec.run_dir_url() or spec.resolved_run_dir()))


def refuse_fresh_run(ckpt: CheckpointDir, run_dir: str) -> None:
    """``SpecError`` when ``ckpt`` holds any checkpoint folder (a fresh run, before anything starts)."""
    found = ckpt.entries()
    if not any(found.values()):
        return
    raise SpecError("run_dir", run_dir, f"holds checkpoints of another run in {ckpt.root}: {_listed(found)}",
                    "continue that run with `raymesh run JOB --resume`, or start afresh in another run_dir "
                    "(--set run_dir=...) or checkpoint.dir, or delete those folders")


def refuse_nothing_to_resume(ckpt: CheckpointDir) -> None:
    """``SpecError`` when ``ckpt`` holds no sealed checkpoint at all (a ``--resume``, before anything starts)."""
    found = ckpt.entries()
    if found["sealed"]:
        return
    what = (f"no sealed checkpoint, only {_listed(found)}" if any(found.values()) else
            "no checkpoint: the job never saved one" + ("" if ckpt.root.exists() else " (the directory does not "
                                                        "exist)"))
    raise SpecError("--resume", str(ckpt.root), f"finds {what}, so there is nothing to resume from",
                    _fresh_fix(found))


def refuse_all_corrupt(ckpt: CheckpointDir) -> None:
    """``SpecError`` after ``latest_verified`` found no checkpoint that passes its checksums (each moved aside,
    ``ckpt.skipped`` says where): a resume does not start over over them."""
    skipped = [f"{_name(s['path'])} ({s['problem']})" for s in ckpt.skipped]
    count = f"{len(skipped)} checkpoint{'s' if len(skipped) != 1 else ''}"
    raise SpecError("--resume", str(ckpt.root),
                    f"finds {count}, all failing their checksums (each set aside, kept for inspection): "
                    f"{_some(skipped)}, so there is nothing to resume from", _fresh_fix(ckpt.entries()))


def _fresh_fix(found: dict[str, list[str]]) -> str:
    """How to start over: without --resume, where a fresh run is allowed (not beside other checkpoints)."""
    if any(found.values()):
        return ("to start over, run without --resume into a fresh run_dir (--set run_dir=...) or checkpoint.dir; "
                "or restore a checkpoint there")
    return "to start over, run without --resume (this run_dir is free), or point run_dir at the run to continue"


def _listed(found: dict[str, list[str]]) -> str:
    """``found`` (``CheckpointDir.entries``) as a phrase: how many of each kind and a few names."""
    said = {"sealed": "sealed", "unsealed": "unsealed (no manifest)", "set_aside": "set aside"}
    return "; ".join(f"{len(names)} {said[kind]}: {_some(names)}" for kind, names in found.items() if names)


def _some(names: list[str]) -> str:
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def _name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]
