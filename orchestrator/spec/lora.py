"""What the driver does with `model.lora` (LoRA / QLoRA fine-tuning; its fields in
``workers.contract.sections.LoraSection``): the base checkpoint's checks, the merged and Hugging Face exports, the
checkpoint an export reads, and the parameter split the planner prices. The checks against the rest of the job
are in ``checks/lora.py``."""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoints.base_pin import check_base_unchanged
from orchestrator.checkpoints.job_record import check_readable
from orchestrator.errors import SpecError
from workers.model.config import HF_MOE_TYPES
from workers.model.registry import model_config
from workers.storage import is_url, location, staged_output


def default_targets(arch: str) -> list[str]:
    """The family's own default (``ModelFamily.lora_targets``), so each list is declared once, beside its model.

    The registry is imported here, not at the top: it loads the model code (torch), and the CLI checks a job
    file without LoRA, and the controller runs one, without importing torch."""
    from workers.model.registry import family

    return list(family(arch).lora_targets)


def meta_model(model):
    """The `model` section's model (no adapters), built weightless on the meta device: its names and shapes."""
    import torch

    from workers.model.registry import build_model

    raw = model.model_dump()
    raw["d_ff"] = model.ffn_dim
    with torch.device("meta"):
        return build_model(model_config(raw))


def _linear_names(model):
    """Names of the model's Linear layers and the model itself, built weightless on the meta device."""
    from torch import nn

    built = meta_model(model)
    return [n for n, m in built.named_modules() if isinstance(m, nn.Linear)], built


def check_base_checkpoint(job) -> None:
    """Refuse `model.lora.base_checkpoint` before actors start when it is not there or fails its checksums
    (the manifest `--resume` checks; a `.pt` from `export-merged` carries one beside it)."""
    lora = job.model.lora
    if lora is None or lora.base_checkpoint is None:
        return
    p = Path(lora.base_checkpoint)
    if not (p.is_file() or (p / ".metadata").is_file()):
        raise SpecError(
            "model.lora.base_checkpoint", lora.base_checkpoint,
            "is neither a .pt file nor a complete DCP checkpoint directory (no .metadata inside)",
            "point it at one step directory of a full run, e.g. runs/<job>/checkpoints/step-00000100, "
            "or at a .pt file written by `raymesh export-merged`",
        )
    verify_checkpoint("model.lora.base_checkpoint", p)


def verify_checkpoint(field: str, path: Path) -> None:
    """The checksum check `--resume` makes (orchestrator.checkpoints.checksums), as a SpecError naming the file."""
    from orchestrator.checkpoints import checksums

    why = checksums.file_problem(path) if path.is_file() else checksums.problem(path)
    if why is not None:
        raise SpecError(field, str(path), f"fails its checksum verification: {why}",
                        "use an intact checkpoint (an earlier step directory, or export the .pt again)")


def export_merged_weights(job, checkpoint: str | None, out: str, fmt: str = "pt") -> Path:
    """`raymesh export-merged`: fold a LoRA run's adapters (its latest checkpoint by default) into a `.pt`,
    or with `fmt="hf"` into a Hugging Face directory."""
    if job.model.lora is None:
        raise SpecError("model.lora", None, "is not set, so the job has no adapters to merge",
                        "pass the job file of a LoRA run (one with a model.lora section), or use `raymesh export-hf`")
    return _export(job, checkpoint, out, fmt)


def export_hf_weights(job, checkpoint: str | None, out: str) -> Path:
    """`raymesh export-hf`: a checkpoint of any layout (the job's latest by default) as a Hugging Face
    directory (config.json + model.safetensors); a LoRA run's adapters are merged in."""
    return _export(job, checkpoint, out, "hf")


def _check_out_kind(out: str, fmt: str) -> None:
    """Before the checkpoint is read: a `.pt` cannot be written over a directory, nor a Hugging Face directory
    over a file."""
    if is_url(out):
        return
    if fmt == "pt" and Path(out).is_dir():
        raise SpecError("--out", out, "is a directory, and export-merged writes one .pt file",
                        f"name the file, e.g. --out {Path(out) / 'merged.pt'}")
    if fmt == "hf" and Path(out).exists() and not Path(out).is_dir():
        raise SpecError("--out", out, "is a file, and a Hugging Face checkpoint is a directory",
                        "name a directory (new or empty)")


def _export(job, checkpoint: str | None, out: str, fmt: str) -> Path:
    """Both exports. The checkpoint and the base are verified against their checksums first, and a `.pt`
    gets its own manifest beside it, so a later `base_checkpoint` pointing at it is verified too."""
    from orchestrator.checkpoints import checksums
    from workers.finetune import export_merged

    if fmt == "hf":
        _check_hf_layout(job)
    if fmt == "pt" and is_url(out):
        raise SpecError("--out", out, "is a URL, and a .pt is written as one local file",
                        "write it to a local path (then copy it), or export with --format hf, which writes to a URL")
    _check_out_kind(out, fmt)
    if fmt == "pt":
        _check_tied_head(job)
    path = checkpoint_to_read(job, checkpoint, "export")
    if fmt == "hf":  # a URL: the directory is written locally, then copied up
        with staged_output(out) as target:
            export_merged(job.worker_dict(), path, target, fmt, vocab=job.model.vocab_size)
        return location(out)
    exported = export_merged(job.worker_dict(), path, out, fmt)
    checksums.write_file_manifest(exported)
    return exported


def _check_hf_layout(job) -> None:
    """Before the checkpoint is read: only a Llama has a Hugging Face layout here, and an MoE one only as a
    Qwen3-MoE or Mixtral (`model.hf_model_type`; `ModelSpec` checks its MoE is one they hold); a dense family's
    feed-forward has no name for routers and experts, which used to end the export after the whole read."""
    if job.model.arch not in ("llama", "deepseek_v3", "gpt_oss", "hf"):  # hf: a transformers model, its save_pretrained
        raise SpecError("model.arch", job.model.arch, "has no Hugging Face layout in raymesh",
                        "export a model.arch: llama, deepseek_v3, gpt_oss or hf job, or write a .pt with "
                        "`raymesh export-merged`")
    if job.model.arch == "llama" and job.model.moe is not None and job.model.hf_model_type not in HF_MOE_TYPES:
        raise SpecError("model.moe", {"experts": job.model.moe.experts}, "has no Hugging Face layout in raymesh "
                        f"under model.hf_model_type {job.model.hf_model_type!r}: its feed-forward is dense, so the "
                        "routers and experts have no names there", "set model.hf_model_type: mixtral (a topk MoE in "
                        "every layer) or qwen3_moe (with model.qk_norm: true) where the job's MoE is one, or export "
                        "a dense job (model.moe: null), or use the checkpoint with `raymesh generate`")


def _check_tied_head(job) -> None:
    """A `.pt` of a tied model (`model.tie_embeddings`) holds one matrix for the embedding and the head; an adapter
    on `output` makes the merged head another one, so the `.pt` would load into the job's model with one of them
    wrong. The Hugging Face directory is written untied instead (`workers.model.hf_io.written_config`)."""
    if not job.model.tie_embeddings or "output" not in adapted_linears(job.model):
        return
    raise SpecError("model.lora.targets", job.model.lora.targets,
                    "adapts the output head, which model.tie_embeddings: true shares with the token embedding; merged, "
                    "the head is no longer the embedding, and a .pt of this tied model holds only one of them",
                    "export with --format hf (written untied, tie_word_embeddings: false), or leave output out of "
                    "model.lora.targets in the next run")


BEST = "best"  # --checkpoint best: the checkpoint saved with the lowest held-out loss


def checkpoint_to_read(job, checkpoint: str | None, purpose: str) -> Path:
    """The complete checkpoint an export or `raymesh generate` reads: `checkpoint` (a step directory, `--checkpoint`;
    `best`: the one with the lowest held-out loss) or the job's latest, verified against its checksums, with the
    LoRA base it sits on (refused naming the field and the fix otherwise)."""
    from orchestrator.checkpoints.directory import CheckpointDir

    root = job.checkpoint_dir()
    path = _best_checkpoint(root, purpose) if checkpoint == BEST else (
        location(checkpoint) if checkpoint else CheckpointDir(root, 1).latest())
    if path is None or not (path / ".metadata").is_file():
        raise SpecError("--checkpoint" if checkpoint else "checkpoint.dir", str(path or root),
                        f"holds no complete checkpoint to {purpose} (no DCP .metadata file in it)",
                        "run the job with checkpoint.every > 0 first, or pass --checkpoint STEP_DIR")
    verify_checkpoint("--checkpoint" if checkpoint else "checkpoint.dir", path)
    check_base_checkpoint(job)
    check_base_unchanged(job, path.parent, purpose)
    check_readable(job, path, purpose)
    return path


def _best_checkpoint(root, purpose: str) -> Path:
    """`--checkpoint best`: the complete checkpoint with the lowest held-out loss."""
    from orchestrator.checkpoints.directory import CheckpointDir

    ckpt = CheckpointDir(root, 1)
    step = ckpt.best()
    if step is None:
        raise SpecError("--checkpoint", BEST, f"finds no checkpoint in {root} saved with a held-out loss to "
                        f"{purpose}", "train with eval.every dividing checkpoint.every (and checkpoint.keep_best: "
                        "true so it is not pruned), or pass --checkpoint STEP_DIR")
    return ckpt.path_for(step)


# per family, the base Linears its TP plan places row-parallel (workers.parallel.gpt_parallel, llama_parallel);
# the others are column-parallel
ROW_PARALLEL = {"gpt": ("wo", "w2"), "llama": ("wo", "w2")}


def _row_parallel(name: str, arch: str) -> bool:
    return name.rsplit(".", 1)[-1] in ROW_PARALLEL[arch]


def parameter_split(job, holds=None, tp: int = 1, total: int | None = None) -> dict[str, int]:
    """Parameters by how LoRA stores them, for memory estimates: `trainable` (adapters: grads and optimizer
    state), `frozen` (full precision, no grads), `nf4` (4-bit base, `workers.model.nf4` bytes per weight).
    Without `model.lora` every parameter is trainable.

    For one rank: `holds(module_name)` says which adapted Linears are in its pipeline stages, `tp` shards
    base weights and adapters the way `workers.parallel.lora_tp` places them (B sharded beside a
    column-parallel base, A beside a row-parallel one, the other replicated), and `total` is the rank's
    base parameters (the planner's count; default the whole model)."""
    _, gpt = _linear_names(job.model)
    if total is None:
        total = sum(p.numel() for p in gpt.parameters())
    lora = job.model.lora
    if lora is None:
        return {"trainable": total, "frozen": 0, "nf4": 0}
    adapted = adapted_linears(job.model, gpt)
    trainable = base = 0
    for name in adapted:
        if holds is not None and not holds(name):
            continue
        rows, cols = gpt.get_submodule(name).weight.shape
        row_parallel = _row_parallel(name, job.model.arch)
        trainable += lora.rank * (rows + cols // tp if row_parallel else rows // tp + cols)
        base += rows * cols // tp
    nf4 = base if lora.quantize == "nf4" else 0
    return {"trainable": trainable, "frozen": total - nf4, "nf4": nf4}


def adapted_linears(model, gpt=None) -> set[str]:
    """Module names of the Linears the `model` section's `lora.targets` puts adapters on (none without LoRA)."""
    from workers.model.lora import target_names

    if model.lora is None:
        return set()
    gpt = gpt if gpt is not None else _linear_names(model)[1]
    return {n for hits in target_names(gpt, model.lora.targets).values() for n in hits}
