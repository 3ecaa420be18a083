"""Tensor parallelism: `parallel.tp` must divide the model's sharded sizes (and a loaded vocabulary)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import SpecError
from orchestrator.spec.fields import _divisors

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec


def check_tensor_split(job: JobSpec) -> None:
    m, p = job.model, job.parallel
    dims = {
        "model.n_heads": m.n_heads,
        "model.d_model": m.d_model,
        # grouped K/V heads are split over tp, never replicated (workers.parallel.llama_parallel)
        **({"model.n_kv_heads": m.kv_heads} if m.n_kv_heads is not None else {}),
        "model.d_ff" if m.d_ff is not None else "model.ffn_dim (4*d_model)": m.ffn_dim,
    }  # model.vocab_size need not divide: it is padded to a multiple of tp (JobSpec.padded_vocab_size)
    if p.sequence_parallel:
        dims["model.seq_len (split by sequence_parallel)"] = m.seq_len
    bad = [f"{k}={v}" for k, v in dims.items() if v % p.tp]
    if not bad:
        return
    valid = [t for t in _divisors(min(dims.values())) if all(v % t == 0 for v in dims.values())]
    fix = f"pick parallel.tp from {valid}, or change the listed model sizes to multiples of {p.tp}"
    if p.sequence_parallel and m.seq_len % p.tp:
        fix += ", or set parallel.sequence_parallel: false"
    raise SpecError("parallel.tp", p.tp, f"does not divide {', '.join(bad)}", fix)


def check_init_from_vocab(job: JobSpec) -> None:
    """A Hugging Face checkpoint's vocabulary must split evenly over `parallel.tp`: it is not padded as a model
    trained from scratch is (`JobSpec.padded_vocab_size`), because the padded rows of a loaded output head would
    add logits to the softmax that transformers' model does not have, and the loss and gradients would differ."""
    m, tp = job.model, job.parallel.tp
    if m.init_from is None or m.vocab_size % tp == 0:
        return
    shape = (m.n_heads, m.d_model, m.kv_heads, m.ffn_dim)
    valid = [t for t in _divisors(m.vocab_size) if all(v % t == 0 for v in shape)]
    raise SpecError("parallel.tp", tp, f"does not divide vocab_size = {m.vocab_size} of model.init_from "
                    f"{m.init_from}/config.json; a loaded vocabulary is not padded (padded rows would add logits "
                    "transformers' model does not have)", f"pick parallel.tp from {valid}, or resize the "
                    f"checkpoint's vocabulary to a multiple of {tp} (transformers' resize_token_embeddings)")
