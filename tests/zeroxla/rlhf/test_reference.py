"""The frozen PPO reference stored as int8 codes (MixZ++), against the same model whose weights
are quantized and dequantized in float64 numpy (DeepSpeed's group formulas, tests/support)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reference import int8_rounded
from zeroxla import models, rlhf
from zeroxla.rlhf.ppo_losses import answer_logprobs
from zeroxla.rlhf.reference import GROUP_SIZE, FrozenReference


def numpy_rounded(model):
    """A copy of `model` whose floating parameters of >= one group hold their int8 round trip,
    computed in float64 numpy."""
    return int8_rounded(model, GROUP_SIZE)


def test_int8_reference_equals_the_dequantized_model_and_holds_a_quarter_of_the_bytes():
    model = models.build("gpt-tiny", seed=3)
    device = jax.local_devices()[0]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 65, size=(4, 24)), jnp.int32)
    exact = FrozenReference(model, device=device)
    codes = FrozenReference(model, device=device, int8=True)

    want = np.asarray(nnx.jit(lambda m, t: answer_logprobs(m, t, 8))(       # one program
        numpy_rounded(model), tokens))
    got = np.asarray(codes(answer_logprobs, tokens, 8))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # and rounding is visible: the codes are not the float weights
    assert np.abs(got - np.asarray(exact(answer_logprobs, tokens, 8))).max() > 1e-5
    print(f"reference bytes: float32 {exact.nbytes}, int8 codes {codes.nbytes}")
    assert codes.nbytes < 0.3 * exact.nbytes


def test_reference_int8_is_validated():
    assert rlhf.PPOConfig(reference_int8=True).reference_int8
    with pytest.raises(ValueError, match="reference_int8"):
        rlhf.PPOConfig(reference_int8="yes")
