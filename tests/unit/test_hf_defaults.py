"""A ``config.json`` that leaves optional keys out is read as ``transformers`` reads it: each family's own config
class's defaults (``hf_io.FAMILY_DEFAULTS``), never Llama's (a Mixtral without ``rms_norm_eps`` / ``rope_theta`` is
1e-5 / 1e6, a Mistral without ``sliding_window`` has a 4096-token window)."""

from __future__ import annotations

import json

import pytest

from tests.support.hf import TINY_FAMILIES, TINY_HF
from workers.model import hf_io

FAMILIES = sorted(hf_io.FAMILIES)
# what a config.json must state (shapes): everything else is left out below
KEPT = {"model_type", *hf_io.SIZE_KEYS}


def _stripped(kind: str, directory) -> dict:
    """A tiny ``kind`` config.json holding only its sizes, written to ``directory``; returns what transformers reads
    from it (``AutoConfig.from_pretrained``: its config class's defaults filled in)."""
    from transformers import AutoConfig

    shape = {k: v for k, v in TINY_HF.items() if k != "rope_scaling"}
    full = AutoConfig.for_model(kind, **{**shape, **TINY_FAMILIES.get(kind, {})}).to_dict()
    keep = KEPT | set(hf_io.FAMILY_SIZE_KEYS.get(kind, ()))
    (directory / hf_io.CONFIG).write_text(json.dumps({k: v for k, v in full.items() if k in keep}))
    return AutoConfig.from_pretrained(directory).to_dict()


@pytest.mark.parametrize("kind", FAMILIES)
def test_missing_keys_read_as_transformers_fills_them(kind, tmp_path):
    theirs = _stripped(kind, tmp_path)
    ours = hf_io.read_config(tmp_path)
    assert hf_io.config_fields(ours) == hf_io.config_fields(theirs)
    assert hf_io.sliding_window(ours) == hf_io.sliding_window(theirs)


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_defaults_table_is_the_config_classes(kind):
    """Each written-out default is the family's transformers config class's own (its ``__init__`` default, under
    the name its ``attribute_map`` gives; rotary base: ``default_theta``). A key the class has no argument for is
    one its model reads with a fallback (``getattr(config, "head_dim", hidden // heads)``): null here."""
    import inspect

    from transformers import AutoConfig

    cls = type(AutoConfig.for_model(kind))
    arguments = inspect.signature(cls.__init__).parameters
    renamed = {saved: argument for argument, saved in getattr(cls, "attribute_map", {}).items()}
    for key, value in {**hf_io._SHARED_DEFAULTS, **hf_io.FAMILY_DEFAULTS[kind]}.items():
        if key == "rope_theta":
            assert cls.default_theta == value, kind
        elif key in arguments or renamed.get(key) in arguments:
            assert arguments[key if key in arguments else renamed[key]].default == value, (kind, key)
        else:
            assert value is None, (kind, key)


def test_mixtral_and_mistral_get_their_own_defaults_not_llamas(tmp_path):
    _stripped("mixtral", tmp_path)
    fields = hf_io.config_fields(hf_io.read_config(tmp_path))
    assert (fields["norm_eps"], fields["rope_theta"], fields["n_kv_heads"]) == (1e-5, 1e6, 8)
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    _stripped("mistral", mistral)
    assert hf_io.sliding_window(hf_io.read_config(mistral)) == 4096
    # the default window is trained (model.sliding_window), not refused, past it
    assert hf_io.config_fields(hf_io.read_config(mistral))["sliding_window"] == 4096
    hf_io.check_sliding_window(hf_io.read_config(mistral), 8192)
