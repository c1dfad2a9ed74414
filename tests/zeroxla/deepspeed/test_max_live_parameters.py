"""DeepSpeed's `stage3_max_live_parameters` -> `ZeroConfig.max_live_parameters`, honoured.

ZeRO-3 gathers whole layers: the layer loop prefetches the next layer (two layers live) only
while two layers fit the bound, else gathers each layer just in time (one live); a gather unit
larger than the bound is refused, naming the key. Compiled only (gpt-tiny), never run.
"""

import re
import warnings

import jax
import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import models
from zeroxla.deepspeed.config import load_deepspeed_config


def _load(zero):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_deepspeed_config({"zero_optimization": {"stage": 3, **zero}},
                                     data_parallel_size=8)


@pytest.mark.parametrize("key", ["stage3_max_live_parameters", "max_live_parameters"])
def test_key_maps_to_max_live_parameters(key):
    assert _load({key: 3e6}).zero.max_live_parameters == 3_000_000
    assert _load({}).zero.max_live_parameters == 1_000_000_000      # DeepSpeed's default


def _make(**config):
    return zeroxla.make_step(lambda: models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=100,
                                                       **config))


def _step(**config):
    step = _make(**config)
    tokens = np.random.default_rng(0).integers(0, 65, (8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return step, step.compile(jax.eval_shape(step.init), batch)


def _layer_numel(step):
    return sum(leaf.unit_numel for leaf in step.layout.plan.leaves
               if leaf.stacked and leaf.params_partitioned)


def _program(compiled) -> str:
    """The compiled HLO's computations, without the module header, the source tables (file
    names ... stack frames, when the trace kept Python frames) and source metadata."""
    text = compiled.as_text()
    body = text[min(i for i in (text.find("\n%"), text.find("\nENTRY")) if i >= 0):]
    return re.sub(r", metadata=\{[^}]*\}", "", body)


def test_between_one_and_two_layers_gathers_just_in_time():
    """1.5 layers: the same program as prefetch off (one gathered layer live)."""
    plain, just_in_time = _step(prefetch=False)
    layer = _layer_numel(plain)
    _, bounded = _step(max_live_parameters=layer * 3 // 2)
    _, unbounded = _step(max_live_parameters=2 * layer)
    assert _program(bounded) == _program(just_in_time)
    assert _program(unbounded) != _program(just_in_time)


def test_smaller_than_a_layer_is_refused_naming_the_key():
    layer = _layer_numel(_make(prefetch=False))             # the layout, before any compile
    with pytest.raises(ValueError, match="stage3_max_live_parameters"):
        _step(max_live_parameters=layer - 1)
