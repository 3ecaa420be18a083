"""What decides how a checkpoint's tensors are read, recorded in each step directory, so a resume, an export or
`generate` with a job file that would read them otherwise is refused before anything starts, naming the field.

DCP loads by name and shape, and the ranks load only the names the job's model asks for. A changed shape
(`model.d_model`, `n_kv_heads`, the vocabulary, the expert count, the LoRA rank) used to fail on every rank after
the actors had started, as a DCP traceback tens of lines long; fewer layers, or more heads over the same width,
loaded without a word (the checkpoint's other layers dropped, the same matrices cut into other heads); another
optimizer's state, or an fp16 run's loss scale, is not there to load. The controller writes `RECORD` into each save
before its seal (so its checksums cover it); a checkpoint saved before it was written has none and is not checked
here (the ranks still refuse one holding model weights the job's model lacks: `workers.state.known_weights`).
Layout fields (dp, pp, tp, ZeRO, cp, ep) are not recorded: DCP reshards them, except where tp pads the vocabulary
to other rows (`JobSpec.padded_vocab_size`), which is checked on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.errors import SpecError

RECORD = "job.json"  # {"fields": {dotted field: value}, "vocab_rows": int, "tp": int}
MAX_TP_SHOWN = 64  # the tp values a vocabulary refusal suggests are looked for up to this
# optimizer names whose checkpointed state is the same tensors, read the same way
SAME_STATE = ({"adam", "adamw"},)


def saved_fields(job) -> dict[str, Any]:
    """The job's fields a checkpoint's tensors are shaped or read by (resolved: `d_ff`, `n_kv_heads`, LoRA targets)."""
    m = job.model
    fields = {"model.arch": m.arch, "model.vocab_size": m.vocab_size, "model.d_model": m.d_model,
              "model.n_layers": m.n_layers, "model.n_heads": m.n_heads, "model.n_kv_heads": m.kv_heads,
              "model.d_ff": m.ffn_dim, "model.positions": m.positions, "model.tie_embeddings": m.tie_embeddings,
              # a head width over the same q/k/v rows cuts them into other heads; biases or q/k norms missing
              # from the checkpoint are DCP's "Missing key" on every rank
              "model.head_dim": m.head_size, "model.qkv_bias": m.qkv_bias, "model.qk_norm": m.qk_norm,
              "model.seq_len": m.seq_len if m.positions == "learned" else None,  # learned positions: a table of it
              "optim.name": job.optim.name, "precision.dtype": job.precision.dtype}
    fields.update(_section("model.moe", m.moe, ("experts", "every", "shared_experts", "d_expert")))
    fields.update(_section("model.lora", m.lora, ("rank", "alpha", "targets", "quantize")))
    return fields


def _section(name: str, section, keys: tuple[str, ...]) -> dict[str, Any]:
    """An optional section's fields, each None when the section is off (so turning it on names a field)."""
    values = {f"{name}.{key}": getattr(section, key) if section is not None else None for key in keys}
    if values.get("model.lora.targets"):
        values["model.lora.targets"] = sorted(values["model.lora.targets"])
    return values


def record(job) -> dict[str, Any]:
    """What `write` puts beside a save of `job`'s ranks."""
    return {"fields": saved_fields(job), "vocab_rows": job.padded_vocab_size, "tp": job.parallel.tp}


def write(checkpoint: Path, saved: dict[str, Any]) -> None:
    """`saved` (a `record`) into the step directory `checkpoint`, before its seal."""
    (checkpoint / RECORD).write_text(json.dumps(saved, indent=2))


def check_readable(job, checkpoint: Path, purpose: str) -> None:
    """Refuse to `purpose` (resume, export, generate from) `checkpoint` with `job` when the job reads its tensors
    otherwise than the run that saved them; a checkpoint without `RECORD` passes."""
    path = checkpoint / RECORD
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    now = saved_fields(job)
    for field, was in saved["fields"].items():
        if not _readable(field, was, now.get(field)):
            raise SpecError(field, now.get(field), f"is not what the checkpoint {checkpoint} was saved with "
                            f"({field}: {json.dumps(was)}): {_why(field)}, so it cannot be read to {purpose}",
                            f"{purpose} with the job file it was trained with (--set {field}={_setting(was)}), or "
                            "start a fresh run in another run_dir or checkpoint.dir")
    _check_vocab_rows(job, saved, checkpoint, purpose)


def check_resume(job) -> None:
    """`--resume`: the newest complete checkpoint of `job`'s directory against `job` (none: nothing to check)."""
    from orchestrator.checkpoints.directory import CheckpointDir

    latest = CheckpointDir(job.checkpoint_dir(), job.checkpoint.keep).latest()
    if latest is not None:
        check_readable(job, latest, "resume")


def _readable(field: str, was, now) -> bool:
    """Whether a checkpoint saved with `field: was` is read right by a job with `field: now`."""
    if was == now:
        return True
    if field == "optim.name":
        return any({was, now} <= names for names in SAME_STATE)
    if field == "precision.dtype":  # only fp16 keeps a loss scale in the checkpoint; fp32 masters read in any dtype
        return now != "fp16"
    return False


def _why(field: str) -> str:
    """What goes wrong when `field` differs, for the refusal."""
    if field == "optim.name":
        return "the optimizer's state (its moments) is another optimizer's"
    if field == "precision.dtype":
        return "an fp16 run resumes its dynamic loss scale, which a run saved in another precision has none of"
    return "the weights are saved in that shape and layer order, and would fail to load or load into the wrong places"


def _setting(value) -> str:
    """`value` as `--set` writes it."""
    return value if isinstance(value, str) else json.dumps(value).replace(" ", "")


def _check_vocab_rows(job, saved: dict[str, Any], checkpoint: Path, purpose: str) -> None:
    """The same `model.vocab_size` padded to other rows by another `parallel.tp` (the checkpoint's embedding and head
    have the rows the saving run's tp padded to): refused, naming the tp values that pad to the saved rows."""
    rows, vocab = saved["vocab_rows"], job.model.vocab_size
    if job.padded_vocab_size == rows:
        return
    fitting = [tp for tp in range(1, MAX_TP_SHOWN + 1) if -(-vocab // tp) * tp == rows]
    raise SpecError("parallel.tp", job.parallel.tp,
                    f"pads model.vocab_size {vocab} to {job.padded_vocab_size} rows, and the checkpoint {checkpoint} "
                    f"(saved at parallel.tp={saved['tp']}) holds embedding and head rows for {rows}, so it cannot be "
                    f"read to {purpose}",
                    f"{purpose} with a parallel.tp that pads {vocab} to {rows} rows: "
                    f"{', '.join(map(str, fitting))}")
