"""ZeroConfig checks its fields: a bad value raises a ValueError naming the field and the
accepted values (DeepSpeed's option names where they exist). No program is built."""

import pytest

import zeroxla


@pytest.mark.parametrize("field,value,accepted", [
    ("stage", 5, "0, 1, 2 or 3"),
    ("compute_dtype", "float8", "float32, bfloat16, float16, float64"),
    ("compute_dtype", "float64", "float32, bfloat16, float16; float64 needs .*jax_enable_x64"),
    ("gradient_accumulation_steps", 0, "an integer >= 1"),
    ("persistence_threshold", -1, "an integer >= 0"),
    ("gradient_clipping", -1.0, "0 \\(off\\) or a positive max norm"),
    ("weight_quantization_bits", 3, "4 or 8"),
])
def test_config_field_errors(field, value, accepted):
    with pytest.raises(ValueError, match=rf"ZeroConfig\.{field}={value!r}.*accepted: {accepted}"):
        zeroxla.ZeroConfig(**{field: value})


def test_zeropp_needs_stage3():
    with pytest.raises(ValueError, match=r"ZeroConfig\.stage=2 .* accepted: 3 when ZeRO\+\+"):
        zeroxla.ZeroConfig(stage=2, quantized_weights=True)


def test_config_field_of_the_wrong_type():
    with pytest.raises(ValueError, match=r"ZeroConfig.stage=True is invalid; accepted: an integer"):
        zeroxla.ZeroConfig(stage=True)
    with pytest.raises(ValueError, match=r"ZeroConfig.prefetch=1 is invalid; accepted: True or False"):
        zeroxla.ZeroConfig(prefetch=1)
    with pytest.raises(ValueError, match=r"ZeroConfig.persistence_threshold=1.5 is invalid"):
        zeroxla.ZeroConfig(persistence_threshold=1.5)
