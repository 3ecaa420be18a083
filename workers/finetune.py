"""Fine-tuning setup: base weights from an earlier run, adapters on top; merged export.

``model.lora.base_checkpoint`` names either one complete DCP checkpoint of a
full (non-LoRA) raymesh run, e.g. ``runs/pretrain/checkpoints/step-00000100``,
whose ``model`` weights are read whatever layout wrote them (DCP reshards to
the full model on load), or a ``.pt`` state dict as written by
``raymesh export-merged`` — so fine-tunes chain. The base is loaded into the
full model before adapters are added and before it is quantized, on every
rank, so the quantized NF4 state never needs to be checkpointed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from workers.contract.sections import LoraSection
from workers.model.lora import apply_lora, merged_state_dict
from workers.spec import WorkerSpec
from workers.state.dcp_reading import CheckpointRefusal
from workers.state.known_weights import load_known
from workers.state.train_state import replica_prefix


def load_dcp_model(model: nn.Module, checkpoint: str | Path, diloco_replicas: int = 0) -> None:
    """Read the ``model`` entries of a DCP checkpoint into ``model`` in this process alone; one holding weights
    ``model`` has none of (more layers) is refused (``workers.state.known_weights``). A ``dp_sync: diloco`` run's
    checkpoint (``diloco_replicas``: its dp) holds each replica's own weights, which differ mid-round; the model it
    trained is theta_outer, the weights every replica takes at a sync, so that is what is read."""
    weights = model.state_dict()
    state, known = {"model": weights}, list(weights)
    if diloco_replicas:
        state = {"diloco": {"outer": {name: p.detach() for name, p in model.named_parameters()}}}
        known = [f"{replica_prefix(k)}.{name}" for k in range(diloco_replicas) for name in weights]
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: what this function is for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load_known(state, checkpoint, known, no_dist=True)
        if not diloco_replicas:
            model.load_state_dict(weights)
    except (CheckpointException, RuntimeError) as exc:  # DCP's is a BaseException, tens of lines long
        mismatch = _first_mismatch(exc)
        if mismatch is None:  # a file missing or cut short under a re-written manifest: no shape to blame
            raise ValueError(f"checkpoint {checkpoint} cannot be read ({_first_failure(exc)}); fix: load an earlier "
                             "step directory, or save this one again") from None
        raise ValueError(f"checkpoint {checkpoint} holds a model of another shape than the job file describes "
                         f"({mismatch}); fix: pass the job file, and the --set overrides, it was trained "
                         "with") from None


MISMATCH_MARKS = ("Size mismatch", "Missing key", "Unexpected key", "size mismatch", "mismatch sizes")


def _first_mismatch(exc: BaseException) -> str | None:
    """The line of a failed load that names the first tensor that does not fit (DCP wraps it in tracebacks), or
    None when the load failed for another reason."""
    lines = [line.strip() for line in _texts(exc)]
    return next((line for line in lines if any(m in line for m in MISMATCH_MARKS)), None)


def _texts(exc: BaseException) -> list[str]:
    """The lines of ``exc`` and of each rank's failure DCP wraps in it."""
    failures = getattr(exc, "failures", None) or {}
    return [line for e in (exc, *(f[0] for f in failures.values())) for line in str(e).splitlines()]


def _first_failure(exc: BaseException) -> str:
    """What went wrong first, as one line: the first rank failure DCP wraps (its type and message), else ``exc``."""
    failures = getattr(exc, "failures", None) or {}
    first = next((f[0] for f in failures.values()), exc)
    text = (str(first).strip().splitlines() or [""])[0]
    return f"{type(first).__name__}: {text}" if text else type(first).__name__


def load_base(model: nn.Module, path: str | Path) -> None:
    """Base weights from a `.pt` or a DCP step directory. The driver has verified its checksums before any actor
    started (orchestrator.spec.lora.check_base_checkpoint); a `.pt` without a manifest can only be judged here."""
    p = Path(path)
    if p.is_file():
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle, zip and torch errors alike: the file is not a state dict
            raise ValueError(f"model.lora.base_checkpoint {str(p)!r} cannot be read as a state dict ({exc}); "
                             "point it at a .pt written by `raymesh export-merged`") from None
        model.load_state_dict(state)
        return
    if not (p / ".metadata").is_file():
        raise ValueError(
            f"model.lora.base_checkpoint {str(p)!r} is neither a .pt file nor a complete DCP checkpoint "
            "(no .metadata); "
            "point it at one step directory such as runs/<job>/checkpoints/step-00000100"
        )
    try:
        load_dcp_model(model, p)
    except CheckpointRefusal as exc:  # already says what is wrong with which file, and the fix
        raise ValueError(f"model.lora.base_checkpoint {str(p)!r}: {exc}") from None
    except Exception as exc:  # DCP names the first missing key; say what it means here
        raise ValueError(
            f"model.lora.base_checkpoint {str(p)!r} does not hold this model's full weights ({exc}); "
            "use a checkpoint of a non-LoRA run with the same model section, or merge a LoRA run first "
            "with `raymesh export-merged` and pass the .pt file"
        ) from None


def prepare_model(model: nn.Module, lora: LoraSection, seed: int | None = None) -> list[str]:
    """Load the base weights (if any), then freeze, adapt and quantize; returns the adapted layers.

    ``seed`` draws the adapters of a materialised model (``workers.model.lora.apply_lora``)."""
    if lora.base_checkpoint:
        load_base(model, lora.base_checkpoint)
    return apply_lora(model, lora, seed)


def rebuilt_model(spec: dict, checkpoint: str | Path) -> tuple[WorkerSpec, nn.Module]:
    """The whole model rebuilt exactly as the run built it (seed, ``init_from`` or base checkpoint under
    adapters, NF4), with a checkpoint's weights loaded over it in this process alone (DCP reshards
    whatever layout wrote it)."""
    from workers.model.hf_io import load_hf_weights
    from workers.model.meta_init import build_full

    job = WorkerSpec.from_dict(spec)
    torch.manual_seed(job.train.seed)
    model = build_full(job.model, job.train.seed)
    tuning = job.finetune
    if tuning.init_from and tuning.lora:  # the NF4 base is not checkpointed: it comes from where the run read it
        load_hf_weights(model, tuning.init_from)
    if tuning.lora:
        prepare_model(model, tuning.lora, job.train.seed)
    load_dcp_model(model, checkpoint, job.parallel.dp if job.parallel.dp_sync == "diloco" else 0)
    return job, model


def export_merged(spec: dict, checkpoint: str | Path, out: str | Path, fmt: str = "pt",
                  vocab: int | None = None) -> Path:
    """Merge the adapters of a LoRA run's checkpoint into plain-model weights: a ``.pt`` state dict, or with
    ``fmt="hf"`` a Hugging Face directory (Llama family) of ``vocab`` tokens (the job's ``model.vocab_size``,
    without the rows tp padded it with; the ``.pt`` keeps them, as the job's model it loads into has them).

    ``W + (alpha/rank) B A`` replaces every adapted layer; ``build_model(cfg).load_state_dict`` takes the
    ``.pt``, and so does ``model.lora.base_checkpoint``; the directory serves as ``model.init_from``.
    """
    job, model = rebuilt_model(spec, checkpoint)
    if fmt == "hf" and job.model.arch == "hf":  # transformers' own model: its save_pretrained writes it
        from workers.model.hf_any import write_hf_any

        return write_hf_any(model, out, job.finetune.init_from)
    if fmt == "hf":
        from workers.model.hf_io import write_hf

        return write_hf(merged_state_dict(model), job.model, out, source=job.finetune.init_from, vocab=vocab)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(merged_state_dict(model), out)
    return out
