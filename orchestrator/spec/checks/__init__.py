"""Checks that span sections, one module per section or feature, each `check_<name>(job)` raising a `SpecError`
that names the field, the value and the fix.

`JobSpec` runs them all, in `CROSS_FIELD_CHECKS` order (the first refusal is the one reported), after every
section validated on its own (the checks within one section are its class's validators: `sections.py`, `model.py`,
`moe.py`). Checks against files on disk (the data, outputs, a base checkpoint) are `runtime_checks.py`'s; the
per-feature data checks it calls (`dpo.check_dpo_data`, `loss_mask`) live here beside the feature's other checks.
"""

from __future__ import annotations

from orchestrator.spec.checks.async_pipeline import check_async_pipeline
from orchestrator.spec.checks.batching import check_batch_ramp, check_batching
from orchestrator.spec.checks.comm import check_comm
from orchestrator.spec.checks.compile import check_compile
from orchestrator.spec.checks.context import check_context_parallel
from orchestrator.spec.checks.diloco import check_diloco
from orchestrator.spec.checks.document_mask import check_document_mask
from orchestrator.spec.checks.dpo import check_dpo
from orchestrator.spec.checks.eval import check_eval
from orchestrator.spec.checks.faults import check_faults
from orchestrator.spec.checks.hf_any import check_hf_any
from orchestrator.spec.checks.inert import check_settings_without_their_feature
from orchestrator.spec.checks.lora import check_lora
from orchestrator.spec.checks.loss_chunks import check_loss_chunks
from orchestrator.spec.checks.memory import check_offload, check_partitioned_activations, check_recompute
from orchestrator.spec.checks.moe import check_expert_parallel, check_moe
from orchestrator.spec.checks.mtp import check_mtp
from orchestrator.spec.checks.optim import check_muon, check_optim_implementation, check_optim_state_dtype
from orchestrator.spec.checks.parameter_server import check_parameter_server, check_ps_resize
from orchestrator.spec.checks.pipeline import check_pipeline_split
from orchestrator.spec.checks.precision import check_float8, check_precision
from orchestrator.spec.checks.recovery import check_keep_training
from orchestrator.spec.checks.stage_replicas import check_stage_replicas
from orchestrator.spec.checks.tensor import check_init_from_vocab, check_tensor_split
from orchestrator.spec.checks.zero import check_fsdp_buckets, check_fsdp_prefetch, check_zero

CROSS_FIELD_CHECKS = (check_hf_any, check_settings_without_their_feature, check_diloco, check_stage_replicas,
                      check_pipeline_split,
                      check_tensor_split,
                      check_init_from_vocab, check_batching, check_batch_ramp, check_zero, check_precision,
                      check_float8,
                      check_recompute,
                      check_partitioned_activations, check_faults, check_muon, check_parameter_server, check_offload,
                      check_lora,
                      check_context_parallel, check_document_mask, check_comm, check_moe, check_expert_parallel,
                      check_mtp,
                      check_async_pipeline, check_ps_resize, check_compile, check_optim_implementation,
                      check_optim_state_dtype,
                      check_fsdp_prefetch, check_fsdp_buckets, check_eval, check_loss_chunks, check_dpo,
                      check_keep_training)
