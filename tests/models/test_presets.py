"""The real-shape presets (`models.presets`) have their models' published parameter counts."""

import jax
import pytest
from flax import nnx

from zeroxla import models
from zeroxla.models import presets

# Parameter counts the model cards publish (billions, rounded or cut there: Qwen2.5-7B's
# 7,615,616,512 is "7.61B").
PUBLISHED = {"Llama-3.2-1B": 1.24, "Llama-3.1-8B": 8.03, "Qwen2.5-0.5B": 0.49,
             "Qwen2.5-1.5B": 1.54, "Qwen2.5-7B": 7.61, "Qwen3-0.6B": 0.6, "Qwen3-8B": 8.2,
             "Qwen3-30B-A3B": 30.5, "gpt-oss-20b": 20.9}


@pytest.mark.parametrize("name", presets.NAMES)
def test_parameter_count_is_the_published_one(name):
    model = models.abstract_model(presets.config(name))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    digits = len(str(PUBLISHED[name]).split(".")[1])
    assert abs(count / 1e9 - PUBLISHED[name]) < 10**-digits       # within the last digit shown


def test_an_unknown_preset_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="accepted: Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B"):
        presets.config("Llama-2-7B")
