"""config/moe_settings.py lists every MoE setting once, and agrees with the schema, MoEOptions and
megatron-core's TransformerConfig it maps between."""
import dataclasses

from megatron_dmoe.config.fields import section_types
from megatron_dmoe.config.moe_settings import MOE_SETTINGS, REQUIRED
from megatron_dmoe.moe.options import MoEOptions


def test_every_moe_key_and_every_layer_option_has_one_row():
    keys = [s.key for s in MOE_SETTINGS]
    options = [s.option for s in MOE_SETTINGS if s.option]
    assert len(set(keys)) == len(keys) and len(set(options)) == len(options)
    assert {f"moe.{name}" for name in section_types()["moe"]} <= set(keys)
    assert set(options) == {f.name for f in dataclasses.fields(MoEOptions)}
    assert all(key.split(".")[1] in section_types()[key.split(".")[0]] for key in keys)


def test_defaults_are_the_layer_options_defaults():
    for field in dataclasses.fields(MoEOptions):
        row = next(s for s in MOE_SETTINGS if s.option == field.name)
        expected = REQUIRED if field.default is dataclasses.MISSING else field.default
        assert row.default == expected or row.default is expected, field.name


def test_megatron_fields_exist_in_transformer_config():
    from megatron.core.transformer import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert {s.megatron for s in MOE_SETTINGS if s.megatron} <= names
