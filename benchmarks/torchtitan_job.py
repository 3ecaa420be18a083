"""torchtitan's side of the GPU benchmark's job: imported by torchtitan's own entry point, not by raymesh.

    python -m torch.distributed.run --nproc_per_node 1 -m torchtitan.train \
        --module benchmarks.torchtitan_job --config raymesh_job          # torchtitan 0.3
    python -m torch.distributed.run --nproc_per_node 1 -m torchtitan.train \
        --job.config_file raymesh_job.toml                                # torchtitan 0.2 (the TOML names this
                                                                          # module in experimental.custom_import)

A job whose model shape is not one of torchtitan's flavours needs code of its own: torchtitan 0.3 takes a config
function (``raymesh_job``); 0.2 takes a TOML job and a flavour name, so importing this module there adds the
flavour ``raymesh`` to its Llama 3 table. Either reads the job raymesh trained from ``RAYMESH_TORCHTITAN_JOB``
(the JSON ``benchmarks/gpu_torchtitan.py`` writes: the ``job`` section of the benchmark's report plus steps,
data and tokenizer folders): the same model shape, sequence length, batch, precision (bf16 autocast over fp32
weights, which is what torchtitan does on one device) and recompute. On 0.3 the layer list is built by
torchtitan's Llama 3 builder (``_build_llama3_layers``, private: the one place its flavours get their blocks
from), the ends as its ``_1b`` flavour builds them; 0.2's Llama has no weight tying, so its head is a matrix of
its own there (same FLOPs, 0.26B more parameters at the 1B shape).
"""

from __future__ import annotations

import importlib.util
import json
import os

JOB_ENV = "RAYMESH_TORCHTITAN_JOB"


def _model_spec(job: dict):
    """torchtitan's Llama 3 with the job's shape (rotary and initialisation as its 1B flavour)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_SKIP_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
        model_registry,
    )

    d, vocab = job["d_model"], job["vocab_size"]
    model = Llama3Model.Config(
        dim=d, vocab_size=vocab, enable_weight_tying=job["tie_embeddings"],
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=d, param_init=_EMBEDDING_SKIP_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=vocab, param_init=_output_linear_init(d)),
        layers=_build_llama3_layers(
            n_layers=job["n_layers"], dim=d, n_heads=job["n_heads"], n_kv_heads=job["n_kv_heads"],
            hidden_dim=job["d_ff"], attn_backend=job.get("attn_backend", "flex"),
            rope=ComplexRoPE.Config(dim=d // job["n_heads"], max_seq_len=max(job["seq_len"], 8192), theta=500000,
                                    scaling="llama")),
    )
    spec = model_registry("1B")  # its parallelize/pipelining functions and state-dict adapter, with our shape
    spec.model = model
    return spec


def _recompute(mode: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"full": FullAC.Config(), "selective": SelectiveAC.Config(), "none": None}[mode]


def raymesh_job():
    """The ``--config`` function: a ``Trainer.Config`` for the job in ``RAYMESH_TORCHTITAN_JOB``."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.trainer import Trainer

    job = json.loads(os.environ[JOB_ENV])
    spec = _model_spec(job)
    config = Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path=job["tokenizer_dir"], dump_folder=job["dump_folder"], model_spec=spec,
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0),
        training=TrainingConfig(local_batch_size=job["global_batch_size"], seq_len=job["seq_len"],
                                steps=job["steps"], mixed_precision_param="bfloat16"
                                if job["precision"] == "bf16" else "float32"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=job["dataset_dir"]),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=_recompute(job["recompute"]),
        validator=Validator.Config(enable=False),
        compile=CompileConfig(enable=job.get("compile", False)),
    )
    _float8(config, job)
    return config


def float8_settings(job: dict) -> dict:
    """torchtitan's float8 converter settings for the job's ``float8`` recipe (empty without one): the recipe, the
    output head left in bf16 as raymesh leaves it, and float8 all-gather with tensorwise, as raymesh gathers."""
    recipe = job.get("float8", "none")
    if recipe == "none":
        return {}
    return {"recipe_name": recipe, "filter_fqns": ["output", "lm_head"],  # the head: 0.2's name, 0.3's
            "enable_fsdp_float8_all_gather": recipe == "tensorwise"}


def _float8(config, job: dict) -> None:
    """torchtitan 0.3's float8 converter on the job's recipe (``float8_settings``), if it has one."""
    settings = float8_settings(job)
    if settings:
        from torchtitan.components.quantization.float8 import Float8LinearConverter

        config.model_converters.converters = [Float8LinearConverter.Config(**settings)]


def _register_flavour() -> None:
    """torchtitan 0.2: the job's shape as the Llama 3 flavour ``raymesh`` (its trainer imports this module,
    ``experimental.custom_import``, before it looks the flavour up)."""
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    job = json.loads(os.environ[JOB_ENV])
    d = job["d_model"]  # SwiGLU width 2/3 of 4d, then rounded: d_ff exactly when multiple_of is d_ff itself
    llama3_args["raymesh"] = TransformerModelArgs(
        dim=d, n_layers=job["n_layers"], n_heads=job["n_heads"], n_kv_heads=job["n_kv_heads"],
        vocab_size=job["vocab_size"], multiple_of=job["d_ff"], ffn_dim_multiplier=3 * job["d_ff"] / (8 * d),
        rope_theta=500000, max_seq_len=max(job["seq_len"], 8192))


if JOB_ENV in os.environ and importlib.util.find_spec("torchtitan.config.job_config") is not None:
    _register_flavour()
