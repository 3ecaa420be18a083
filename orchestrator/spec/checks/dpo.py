"""What `train.objective: dpo` (Direct Preference Optimization, `workers/model/dpo.py`) needs, refused before start.

Each pair is two consecutive sequences of the batch (chosen, rejected), scored against the reference policy: the
model with its LoRA adapters disabled. So the job needs `model.lora`, and every microbatch an even number of
sequences (a pair never split across ranks or microbatches). This first version runs on dp, ZeRO 0-3 and tp (with
or without sequence parallelism); the layouts whose loss is not one forward of whole sequences on one rank
(pipeline stages, context-parallel shares, chunked heads), the parameter server's own-mean pushes, mixtures of
experts (their routing would be tallied by the reference forward too), data mixtures and the held-out loss
(scored as cross entropy, not as DPO) are refused. The data must be preference pairs, and preference pairs are
refused under `objective: lm`, which would train on the rejected answers as on the chosen ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


PREFERENCE = "preference"  # the manifest's key (workers.data.prepare.PREFERENCE: not imported, it loads pyarrow)


PREPARE = "prepare it with `raymesh prepare-data --format preference --seq-len N` (JSONL prompt/chosen/rejected)"


Sources = list[tuple[str, float, dict]]  # (path, weight, manifest) of each training directory checked


def check_dpo(job: JobSpec) -> None:
    """Refuse a DPO job this version cannot train exactly, and `train.dpo_beta` without DPO."""
    t = job.train
    if t.objective != "dpo":
        if t.dpo_beta != type(t).model_fields["dpo_beta"].default:
            raise SpecError("train.dpo_beta", t.dpo_beta, "scales DPO's rewards, and this job has train.objective: "
                            f"{t.objective}", "set train.objective: dpo, or remove train.dpo_beta")
        return
    if job.model.lora is None:
        raise SpecError("train.objective", "dpo", "needs model.lora: the reference policy is the model with its "
                        "adapters disabled", "add a model.lora section (e.g. model.lora: {rank: 8})")
    _check_pairs_stay_together(job)
    for field, value, refused, fix in _unsupported(job):
        if refused:
            raise SpecError(field, value, "is not supported with train.objective: dpo in this version (supported: "
                            "dp, ZeRO 0-3 and tp, with or without sequence parallelism)", fix)


def _check_pairs_stay_together(job: JobSpec) -> None:
    """Every microbatch holds whole pairs: an even count of sequences per rank and microbatch."""
    t, dp = job.train, job.parallel.dp
    per_microbatch = t.global_batch_size // (dp * t.microbatches)
    if per_microbatch % 2:
        raise SpecError("train.global_batch_size", t.global_batch_size, f"gives each microbatch {per_microbatch} "
                        f"sequence(s) (/ parallel.dp {dp} / train.microbatches {t.microbatches}), an odd count: a "
                        "preference pair's chosen and rejected sequences must stay on one rank and microbatch",
                        f"use a multiple of 2 x dp x microbatches = {2 * dp * t.microbatches}")


def _unsupported(job: JobSpec) -> list[tuple]:
    """(field, value, whether this job sets it, fix) of what a DPO job refuses."""
    p, t = job.parallel, job.train
    return [
        ("parallel.pp", p.pp, p.pp > 1, "set parallel.pp: 1 (use dp, ZeRO or tp)"),
        ("parallel.cp", p.cp, p.cp > 1, "set parallel.cp: 1 (use dp, ZeRO or tp)"),
        ("parallel.dp_sync", p.dp_sync, p.dp_sync == "ps", "set parallel.dp_sync: allreduce"),
        ("train.loss_chunks", t.loss_chunks, t.loss_chunks > 1, "set train.loss_chunks: 1"),
        ("model.moe", "set", job.model.moe is not None, "remove model.moe (a dense model)"),
        ("data.mix", "set", bool(job.data.mix), "train on one directory of pairs (data.path)"),
        ("eval.every", job.eval.every, job.eval.every > 0, "remove the eval section: the held-out loss is cross "
         "entropy, not DPO's"),
    ]


def check_dpo_data(spec: JobSpec, sources: Sources) -> None:
    """The training data fits the objective: preference pairs padded to `model.seq_len` under dpo, and none
    under lm."""
    for path, _, manifest in sources:
        field, pairs = spec.data.field_of(path), manifest.get(PREFERENCE)
        if spec.train.objective == "dpo" and not pairs:
            raise SpecError(field, path, "holds no preference pairs, which train.objective: dpo trains on",
                            f"{PREPARE}, or set train.objective: lm")
        if spec.train.objective == "lm" and pairs:
            raise SpecError(field, path, "holds preference pairs: train.objective: lm would train on the rejected "
                            "answers as on the chosen ones", "set train.objective: dpo (with model.lora)")
        if pairs and pairs["seq_len"] != spec.model.seq_len:
            raise SpecError("model.seq_len", spec.model.seq_len, f"does not match the {pairs['seq_len']} tokens "
                            f"every sequence of {field} {path} was padded to", f"set model.seq_len: "
                            f"{pairs['seq_len']}, or prepare the pairs again with --seq-len {spec.model.seq_len}")
