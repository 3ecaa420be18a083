"""What data carrying a loss mask (`raymesh prepare-data --format prompt-completion`) needs, refused before start.

Such data scores only completion tokens, and a step's loss is the sum of cross entropy over the global batch's
counted targets over their count (`workers.step.objectives.MaskedLM`). A `data.mix` may mix sources with and
without a mask (every target of one without counts). Refused: what cannot normalise so (the parameter server's
ranks, an asynchronous pipeline's updates between microbatches), and a held-out set scored otherwise than training
(`eval.path` with a mask and the training data without, or the reverse): its figure would measure another loss,
and `checkpoint.keep_best` would choose by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.checks.async_pipeline import ASYNC

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


LOSS_MASK = "loss_mask"  # the manifest's key (workers.data.prepare.LOSS_MASK: not imported, it loads pyarrow)


Sources = list[tuple[str, float, dict]]  # (path, weight, manifest) of each training directory checked


def masked(manifest: dict) -> bool:
    """Whether the prepared directory of ``manifest`` carries a loss mask."""
    return bool(manifest.get(LOSS_MASK))


def check_training_mask(spec: JobSpec, sources: Sources) -> None:
    """Refuse a way of training that cannot take the step's loss over the global count of counted targets."""
    paths = [path for path, _, manifest in sources if masked(manifest)]
    if not paths:
        return
    data = f"{spec.data.field_of(paths[0])} {paths[0]} carries a loss mask (completion tokens only are targets)"
    par = spec.parallel
    if par.dp_sync == "ps":
        raise SpecError("parallel.dp_sync", "ps", f"cannot train on such data: {data}, and the parameter server's "
                        "ranks push gradients of their own mean loss, not of the global batch's counted targets",
                        "set parallel.dp_sync: allreduce, or prepare the data with --format text")
    if par.pp > 1 and par.pp_schedule in ASYNC:
        raise SpecError("parallel.pp_schedule", par.pp_schedule, f"cannot train on such data: {data}, and an "
                        "asynchronous pipeline updates the weights between microbatches, before the global batch's "
                        "count of counted targets weighs them", "use a synchronous schedule (e.g. 1f1b or "
                        "interleaved_1f1b), or prepare the data with --format text")


def check_eval_mask(spec: JobSpec, manifest: dict, sources: Sources) -> None:
    """Refuse an `eval.path` (its ``manifest``) scored otherwise than the training data: with a loss mask where
    training has none, or without one where any training source has one."""
    if not sources or masked(manifest) == any(masked(m) for _, _, m in sources):
        return
    path = next((p for p, _, m in sources if masked(m) != masked(manifest)), sources[0][0])
    field = spec.data.field_of(path)
    if masked(manifest):
        problem = f"carries a loss mask (scores completion tokens only), but {field} {path} has none"
        fix = "prepare the held-out text as the training data (--format text), or point eval.path at such a directory"
    else:
        problem = (f"has no loss mask (it would score prompt tokens too), but {field} {path} carries one (training "
                   "scores completion tokens only)")
        fix = ("prepare the held-out examples with --format prompt-completion (`raymesh prepare-data --heldout` "
               "writes them beside the training data), or point eval.path at such a directory")
    raise SpecError("eval.path", spec.eval.path, f"{problem}: the held-out loss would measure another loss", fix)
