"""A NaN or inf under ZeRO++ quantization still makes the fp16 step skip and halve the scale.

Block quantization divides by a per-group scale (the group's absolute maximum): a NaN or inf
in a group must survive quantization, the int4 two-hop exchange of qgZ and the int8 gather of
qwZ, so that the step's overflow check sees it — exactly as without quantization, which is the
reference here. A quantizer that turned it into finite codes would apply a corrupted update
silently.

The NaN is injected into one element of one device's gradient (not the loss): `_inject` adds
nothing in forward and gives the element the cotangent `sum(poison)` in backward, where
`poison` is 0 on every example except one (on one device).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla

IN, OUT = 256, 512               # 131072 elements: quantized by qwZ and qgZ in 2048-groups
BASE = zeroxla.ZeroConfig(stage=3, persistence_threshold=0, compute_dtype="float16",
                          hysteresis=1, initial_scale_power=8)
ZEROPP = {"plain ZeRO-3": {}, "qgZ": {"quantized_gradients": True},
          "qwZ": {"quantized_weights": True},
          "qwZ + qgZ + hpZ": {"quantized_weights": True, "quantized_gradients": True,
                              "hpz_partition_size": 4}}


@jax.custom_vjp
def _inject(element, poison):
    return jnp.zeros_like(element)


def _inject_fwd(element, poison):
    return jnp.zeros_like(element), poison


def _inject_bwd(poison, g):
    return g * jnp.sum(poison).astype(g.dtype), None


_inject.defvjp(_inject_fwd, _inject_bwd)


class Probe(nnx.Module):
    def __init__(self, element, weight=None):
        self.element = element
        init = jax.random.normal(jax.random.key(0), (IN, OUT)) * 0.05
        self.w = nnx.Param(init if weight is None else weight)

    def __call__(self, x, poison):                          # x: [B, IN], poison: [B]
        w = self.w[...]
        return x @ w + _inject(w.reshape(-1)[self.element], poison)


def _loss(model, batch):
    return jnp.mean((model(batch["x"], batch["poison"]).astype(jnp.float32) - 1.0) ** 2)


def _one_step(zeropp, element, device, value, weight=None):
    step = zeroxla.make_step(Probe(element, weight), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.1), loss_fn=_loss,
                             config=BASE.replace(**zeropp))
    state = step.init()
    before = np.asarray(zeroxla.gather_params(state)["w"][...])
    scale = float(state.loss_scale.scale)
    poison = np.zeros(8, np.float32)                          # one example per device
    poison[device] = value
    batch = {"x": np.random.default_rng(0).normal(size=(8, IN)).astype(np.float32),
             "poison": poison}
    state, metrics = step(state, batch)
    after = np.asarray(zeroxla.gather_params(state)["w"][...])
    return bool(metrics["overflow"]), float(state.loss_scale.scale) / scale, before, after


@pytest.mark.parametrize("name", list(ZEROPP))
@pytest.mark.parametrize("element, device, value", [(12345, 3, np.nan), (20000, 6, np.inf)],
                         ids=["NaN on device 3", "inf on device 6"])
def test_gradient_nan_or_inf_skips_the_step(name, element, device, value):
    overflow, scale_ratio, before, after = _one_step(ZEROPP[name], element, device, value)
    assert overflow and scale_ratio == 0.5
    np.testing.assert_array_equal(after, before)              # skipped: bit-identical
    # Without the poison, the same step updates (the check is not always true).
    overflow, scale_ratio, before, after = _one_step(ZEROPP[name], element, device, 0.0)
    assert not overflow and scale_ratio == 1.0 and np.abs(after - before).max() > 0


@pytest.mark.parametrize("name", ["plain ZeRO-3", "qwZ"])
def test_weight_nan_skips_the_step(name):
    """A NaN weight (in one 2048-element qwZ group) is gathered as NaN, not as finite codes."""
    weight = np.array(jax.random.normal(jax.random.key(0), (IN, OUT)) * 0.05)
    weight.reshape(-1)[54321] = np.nan
    overflow, scale_ratio, before, after = _one_step(ZEROPP[name], 0, 0, 0.0,
                                                     weight=jnp.asarray(weight))
    assert overflow and scale_ratio == 0.5
    np.testing.assert_array_equal(after, before)
