"""The `model:` section: the transformer's shape (and its LoRA/QLoRA fine-tuning, `model.lora`).

Two fields fill the shape in for the user before validation: `preset` (a published or small Llama shape,
`workers.model.presets.PRESETS`; the job's own fields override it) and `init_from` (a Hugging Face
directory whose `config.json` decides the shape; a field the job also sets must agree with it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from orchestrator.errors import SpecError
from orchestrator.spec.fields import STRICT, _divisors
from orchestrator.spec.lora import default_targets
from orchestrator.spec.moe import MoESpec
from workers.contract.sections import FineTuningSection
from workers.model.config import (
    DEEPSEEK_ONLY,
    DEEPSEEK_UNREAD,
    GPT_OSS_ONLY,
    GPT_OSS_UNREAD,
    HF_FAMILY_FIELDS,
    HF_MOE_TYPES,
    LLAMA_ONLY,
    ModelConfig,
)
from workers.model.presets import PRESETS

Preset = Literal[tuple(PRESETS)]  # type: ignore[valid-type]

MAX_LAYERS = 10_000


def _hf_moe_fixes(kind: str, moe: MoESpec) -> list[tuple[str, str, str]]:
    """The ``model.moe`` fields a ``kind`` checkpoint cannot hold: (field, the value it needs, why)."""
    fixes = [("router", "topk", "its router is a dropless softmax top-k over every expert; noisy, capacity-limited "
              "and expert-choice routing would compute another model than transformers'"),
             ("bias_balancing", "false", "the learnt bias would change which experts a token gets, and the "
              "checkpoint has no place for it"),
             ("shared_experts", "0", "it has no shared experts")]
    if kind == "mixtral":
        fixes += [("every", "1", "Mixtral has experts in every layer"),
                  ("norm_topk", "true", "Mixtral always renormalises the top-k gates")]
    return [fix for fix in fixes if str(getattr(moe, fix[0])).lower() != fix[1]]


class ModelSpec(FineTuningSection, ModelConfig):
    """Transformer shape (fields in ``workers.model.config.ModelConfig``) and its fine-tuning (``init_from`` and
    ``lora``, in ``workers.contract.sections.FineTuningSection``), with the checks that name the fix."""

    model_config = STRICT  # ModelConfig's fields, validated as strictly as every other section's

    preset: Preset | None = None  # a named shape (llama-150m, llama-1b, llama3-8b/70b/405b); own fields override
    # the MoE section with its checks (fields in MoEConfig); the default is ModelConfig's
    moe: MoESpec | None = ModelConfig.model_fields["moe"].default

    @model_validator(mode="before")
    @classmethod
    def _fill_shape(cls, data: Any) -> Any:
        """Expand `preset` under the job's fields, then make `init_from`'s config.json decide the shape."""
        if not isinstance(data, dict):
            return data
        preset = data.get("preset")
        if isinstance(data.get("init_from"), str):
            if preset is not None:
                raise SpecError("model.preset", preset, "and model.init_from both set the model's shape",
                                "remove model.preset: the checkpoint's config.json decides the shape")
            data = _with_hf_config(data)
        if isinstance(preset, str) and preset in PRESETS:
            data = {**PRESETS[preset], **data}
        return data

    @model_validator(mode="after")
    def _check_depth(self) -> ModelSpec:
        if self.n_layers > MAX_LAYERS:
            raise SpecError("model.n_layers", self.n_layers, f"is above {MAX_LAYERS:,}: the deepest transformers "
                            "trained have a few hundred layers, and the planner and the pipeline builder walk "
                            "layers one by one", f"set model.n_layers to at most {MAX_LAYERS:,}")
        return self

    @model_validator(mode="after")
    def _check_one_base(self) -> ModelSpec:
        """`init_from` and `lora.base_checkpoint` both name the weights the adapters start from; the ranks
        load the base checkpoint over init_from's, so one of them would be silently ignored."""
        if self.init_from is not None and self.lora is not None and self.lora.base_checkpoint is not None:
            raise SpecError("model.lora.base_checkpoint", self.lora.base_checkpoint,
                            f"and model.init_from {self.init_from!r} both give the base weights, and the base "
                            "checkpoint would overwrite init_from's", "remove model.lora.base_checkpoint to adapt "
                            "the Hugging Face checkpoint, or remove model.init_from to adapt the base checkpoint")
        return self

    @model_validator(mode="after")
    def _check_pad_token(self) -> ModelSpec:
        if self.pad_token_id is not None and self.pad_token_id >= self.vocab_size:
            raise SpecError("model.pad_token_id", self.pad_token_id, f"is not an id of the vocabulary "
                            f"(model.vocab_size={self.vocab_size})", f"set it below {self.vocab_size}, or remove it")
        return self

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        """Heads that split d_model (or an explicit ``head_dim``) and an even head width for rotary."""
        if self.arch == "hf":
            return self  # transformers checks its own config's heads
        if self.head_dim is not None:
            return self._check_head_dim()
        if self.d_model % self.n_heads:
            raise SpecError(
                "model.n_heads",
                self.n_heads,
                f"does not divide model.d_model={self.d_model}",
                f"pick n_heads from {_divisors(self.d_model)}, or make d_model a multiple of {self.n_heads}",
            )
        if self.positions == "rotary" and self.head_size % 2:
            even = [h for h in _divisors(self.d_model) if (self.d_model // h) % 2 == 0]
            raise SpecError(
                "model.n_heads",
                self.n_heads,
                f"gives an odd head_dim d_model/n_heads = {self.d_model}/{self.n_heads} = {self.head_size}, "
                "which rotary positions cannot rotate in pairs",
                f"pick n_heads from {even}, or set model.positions: learned",
            )
        return self

    def _check_head_dim(self) -> ModelSpec:
        """An explicit ``head_dim`` (Qwen3's, a Mistral's): even for rotary; q/k/v/o are n_heads * head_dim wide."""
        if self.positions == "rotary" and self.head_dim % 2:
            raise SpecError("model.head_dim", self.head_dim, "is odd, and rotary positions rotate channels in pairs",
                            f"set model.head_dim to an even width such as {self.head_dim + 1}, or remove it "
                            f"(d_model/n_heads = {self.d_model // self.n_heads})")
        return self

    @model_validator(mode="after")
    def _check_family_fields(self) -> ModelSpec:
        """Llama-only fields on a GPT, a Llama without rotary positions, K/V heads that do not group queries."""
        if self.arch != "hf" and self.hf_config is not None:
            raise SpecError("model.hf_config", "{...}", f"is read only under model.arch hf, not {self.arch}",
                            "remove model.hf_config (model.init_from fills it in for a model raymesh has no "
                            "family for)")
        if self.lora is not None and self.lora.targets is None and self.arch != "hf":
            self.lora.targets = default_targets(self.arch)
        self._check_deepseek_fields()
        self._check_gpt_oss_fields()
        if self.arch == "deepseek_v3":
            return self
        if self.arch == "gpt":
            given = [f for f in LLAMA_ONLY if getattr(self, f) != ModelConfig.model_fields[f].default]
            if given:
                raise SpecError(f"model.{given[0]}", getattr(self, given[0]),
                                "is a Llama-family field; model.arch: gpt does not read it",
                                f"set model.arch: llama, or remove {', '.join('model.' + g for g in given)}")
            return self
        if self.arch == "hf":
            return self._check_hf_any()
        if self.positions != "rotary":
            raise SpecError("model.positions", self.positions, "is not supported by model.arch: llama",
                            "remove model.positions (Llama uses rotary positions)")
        if self.n_heads % self.kv_heads:
            raise SpecError("model.n_kv_heads", self.n_kv_heads,
                            f"does not divide model.n_heads={self.n_heads}: each K/V head must serve a whole "
                            "group of query heads",
                            f"pick n_kv_heads from {_divisors(self.n_heads)}")
        return self

    def _check_hf_any(self) -> ModelSpec:
        """`model.arch: hf` comes only with `init_from`'s config.json (it is the model's whole shape); the
        Llama-only fields and `model.moe` describe raymesh's own layers, which this model does not have."""
        if self.hf_config is None or self.init_from is None:
            raise SpecError("model.arch", self.arch, "is set by model.init_from (a Hugging Face causal LM raymesh "
                            "has no family for), not by hand", "set model.init_from to the model's directory, or "
                            "model.arch: gpt/llama")
        given = [f for f in (*LLAMA_ONLY, "moe") if f != "hf_model_type"
                 and getattr(self, f) != ModelConfig.model_fields[f].default]
        if given:
            raise SpecError(f"model.{given[0]}", getattr(self, given[0]), "describes raymesh's own layers, which "
                            "a model.arch hf model (built by transformers from model.init_from) does not have",
                            f"remove model.{given[0]}")
        return self
    def _own_fields_only(self, arch: str, label: str, only: tuple[str, ...], unread: tuple[str, ...]) -> bool:
        """Refuse family ``arch``'s fields (``only``) on another arch and the Llama fields it does not read
        (``unread``) on it, naming the first one set and the fix; True when the job is of that arch."""
        own = self.arch == arch
        given = [f for f in (unread if own else only) if getattr(self, f) != ModelConfig.model_fields[f].default]
        if given:
            why = (f"is a Llama-family field; model.arch: {arch} does not read it" if own
                   else f"is a {label} field; model.arch: {self.arch} does not read it")
            raise SpecError(f"model.{given[0]}", getattr(self, given[0]), why,
                            f"remove {', '.join('model.' + g for g in given)}"
                            + ("" if own else f", or set model.arch: {arch}"))
        return own

    def _check_deepseek_fields(self) -> None:
        """DeepSeek-V3's fields on another arch, the Llama fields it does not read, and what its MLA computes:
        rotary positions (interleaved pairs: an even rope width), a plain causal mask."""
        if not self._own_fields_only("deepseek_v3", "DeepSeek-V3", DEEPSEEK_ONLY, DEEPSEEK_UNREAD):
            return
        checks = [("positions", "rotary", "MLA rotates its decoupled key"),
                  ("attention_mask", "causal", "MLA has no document mask yet")]
        for name, needed, why in checks:
            if getattr(self, name) != needed:
                raise SpecError(f"model.{name}", getattr(self, name), f"is not supported by model.arch: "
                                f"deepseek_v3 ({why})", f"set model.{name}: {needed}")
        if self.qk_rope_head_dim % 2:
            raise SpecError("model.qk_rope_head_dim", self.qk_rope_head_dim, "is odd, and rotary positions rotate "
                            "channels in pairs", f"set it to {self.qk_rope_head_dim + 1}")

    def _check_gpt_oss_fields(self) -> None:
        """gpt-oss's fields on another arch, the Llama fields it does not read, one attention kind per layer, and
        the mixture of experts its blocks are (a softmax top-k router, every block, no shared experts)."""
        if not self._own_fields_only("gpt_oss", "gpt-oss", GPT_OSS_ONLY, GPT_OSS_UNREAD):
            return
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise SpecError("model.layer_types", self.layer_types, f"gives {len(self.layer_types)} attention kinds "
                            f"for model.n_layers={self.n_layers}", "give one per layer, or remove it (sliding and "
                            "full alternate)")
        moe = self.moe
        if moe is None:
            raise SpecError("model.moe", None, "is null, but every gpt_oss block is a mixture of experts",
                            "set model.moe (experts, top_k), or model.init_from a GptOss checkpoint")
        for name, needed in (("router", "topk"), ("every", 1), ("shared_experts", 0), ("norm_topk", True),
                             ("bias_balancing", False)):
            if getattr(moe, name) != needed:
                raise SpecError(f"model.moe.{name}", getattr(moe, name), "is not gpt-oss's (a biased softmax over "
                                "the top-k logits in every block)", f"set model.moe.{name}: {needed}")

    @model_validator(mode="after")
    def _check_hf_family(self) -> ModelSpec:
        """The fields ``hf_model_type``'s weights always have (Qwen2's q/k/v biases, Qwen3's q/k norms) and no
        other family's: an export's config.json must build a model with exactly our tensors."""
        if self.arch != "llama":
            return self  # a gpt's Llama-only fields are refused by _check_family_fields, an hf's by _check_hf_any
        for name, value in HF_FAMILY_FIELDS[self.hf_model_type].items():
            if getattr(self, name) != value:
                kinds = [k for k, f in HF_FAMILY_FIELDS.items() if f[name] == getattr(self, name)]
                raise SpecError(f"model.{name}", getattr(self, name), f"does not match model.hf_model_type "
                                f"{self.hf_model_type!r}, whose checkpoints {'have' if value else 'lack'} it",
                                f"set model.{name}: {str(value).lower()}, or model.hf_model_type to one of {kinds}")
        return self

    @model_validator(mode="after")
    def _check_hf_moe(self) -> ModelSpec:
        """A Qwen3-MoE or Mixtral model (``hf_model_type``) computes what ``transformers``' does: a dropless,
        unbiased softmax top-k router and no shared experts, Mixtral's in every layer and renormalised; anything
        else would train (and export) a model the checkpoint's family cannot hold. ``expert_dropout``, the aux
        and z losses are training choices the job may make (the model in eval mode is the same)."""
        kind, moe = self.hf_model_type, self.moe
        if kind not in HF_MOE_TYPES:
            return self
        if moe is None:
            raise SpecError("model.moe", None, f"is null, but model.hf_model_type {kind!r} is a mixture-of-experts "
                            "family", f"set model.init_from to a {kind} checkpoint (it fills model.moe in), or "
                            "set model.moe, or another model.hf_model_type")
        fixes = _hf_moe_fixes(kind, moe)
        if fixes:
            field, value, fix = fixes[0]
            raise SpecError(f"model.moe.{field}", getattr(moe, field), f"cannot be held by a Hugging Face {kind} "
                            f"checkpoint: {fix}", f"set model.moe.{field}: {value}")
        return self


def _with_hf_config(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the shape `config.json` of `init_from` gives; a field set to another value is an error
    naming both. A missing or unreadable directory is reported here, before any actor starts."""
    from workers.model.hf_io import FAMILIES, OWN_FAMILIES, check_sliding_window, config_fields, read_config

    directory = data["init_from"]
    try:
        config = read_config(directory)
    except (ValueError, OSError) as exc:
        raise SpecError("model.init_from", directory, f"is not a readable Hugging Face model directory ({exc})",
                        "point it at a directory written by save_pretrained (config.json + *.safetensors)") from None
    if config.get("model_type") not in (*FAMILIES, *OWN_FAMILIES):  # a family raymesh has no own for: arch hf
        return _with_any_hf_config(data, config, directory)
    try:
        hf = config_fields(config)
    except (ValueError, KeyError) as exc:
        raise SpecError("model.init_from", directory, f"holds a model raymesh's Llama cannot represent ({exc})",
                        "use a checkpoint without that setting, or change its config.json as the message says"
                        ) from None
    try:
        check_sliding_window(config, data.get("seq_len") or ModelConfig.model_fields["seq_len"].default)
    except ValueError as exc:
        raise SpecError("model.init_from", directory, f"uses sliding-window attention ({exc})",
                        "lower model.seq_len to the window as the message says") from None
    _check_agrees(data, hf, directory)
    if config.get("model_type") == "deepseek_v3":
        hf["mtp_layers"] = _mtp_layers(data, config, directory)
    if isinstance(data.get("moe"), dict) and hf.get("moe") is not None:  # the job's own MoE settings are kept
        hf = {**hf, "moe": {**data["moe"], **hf["moe"]}}
    return {**data, **hf}


def _mtp_layers(data: dict[str, Any], config: dict[str, Any], directory: str) -> int:
    """The multi-token prediction depths a DeepseekV3 `init_from` trains: those its safetensors hold
    (`num_nextn_predict_layers` of them; a transformers-saved directory says 1 and holds none), or fewer where the
    job's `model.mtp_layers` asks; more than it holds is refused (they would have no weights to load)."""
    from workers.model.deepseek import held_mtp_layers
    from workers.model.hf_io import weight_files

    try:
        held = held_mtp_layers(config, weight_files(directory))
    except ValueError as exc:
        raise SpecError("model.init_from", directory, f"has no readable weights ({exc})",
                        "point it at a directory written by save_pretrained (config.json + *.safetensors)") from None
    asked = data.get("mtp_layers")
    if asked is not None and asked > held:
        raise SpecError("model.mtp_layers", asked, f"asks for more multi-token prediction depths than "
                        f"{directory} holds ({held}: its safetensors have no model.layers."
                        f"{config['num_hidden_layers'] + held}.eh_proj.weight)",
                        f"set model.mtp_layers to at most {held}, or init_from a checkpoint that holds them")
    return held if asked is None else asked


def _with_any_hf_config(data: dict[str, Any], config: dict[str, Any], directory: str) -> dict[str, Any]:
    """`data` as `model.arch: hf` (``workers.model.hf_any``): a causal LM of a family raymesh has no own for,
    which transformers builds from `config.json`; a context longer than its position table is refused here."""
    from workers.model.hf_any import max_positions, model_fields

    try:
        hf = model_fields(config, directory)
    except ValueError as exc:
        raise SpecError("model.init_from", directory, f"holds a model raymesh cannot train ({exc})",
                        "point it at a transformers causal LM (AutoModelForCausalLM loads it without "
                        "trust_remote_code)") from None
    _check_agrees(data, {k: v for k, v in hf.items() if k != "hf_config"}, directory)
    seq_len, longest = data.get("seq_len") or ModelConfig.model_fields["seq_len"].default, max_positions(config)
    if longest is not None and seq_len > longest:
        raise SpecError("model.seq_len", seq_len, f"is longer than the {longest} positions {directory}/config.json "
                        "gives the model", f"set model.seq_len to at most {longest}")
    return {**data, **hf}


def _check_agrees(data: dict[str, Any], hf: dict[str, Any], directory: str, prefix: str = "") -> None:
    """Refuse a field the job sets to another value than `init_from`'s config.json gives, naming it (an MoE
    checkpoint's `model.moe` fields one by one)."""
    for name, value in hf.items():
        ours = data.get(name)
        if name == "moe" and isinstance(ours, dict) and isinstance(value, dict):
            _check_agrees(ours, value, directory, "moe.")
        elif ours is not None and not _same(ours, value):
            raise SpecError(f"model.{prefix}{name}", ours,
                            f"disagrees with {directory}/config.json, which gives {prefix}{name} = {value!r}",
                            f"remove model.{prefix}{name} from the job file (init_from sets it), or set it to "
                            f"{value!r}")


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(theirs, dict) and isinstance(ours, dict):
        return all(_same(ours.get(k), v) for k, v in theirs.items())
    if isinstance(theirs, float) or isinstance(ours, float):
        return ours is not None and theirs is not None and float(ours) == float(theirs)
    return ours == theirs
