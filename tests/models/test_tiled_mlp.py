"""The tiled MLP (`models.tiled_mlp`, ALST's TiledMLP): the MLP over chunks of the sequence
equals the MLP over the whole sequence, forward and gradients (of the input and of the weights)
within 1e-6 in float32 (relative to each array's largest value where
that is over 1), for a chunk that does not divide T; a model with `mlp_chunk` set gives
its plain logits, token log-probs and gradients; the compiled gradient holds no [T, F] buffer,
and, in bf16, no float32 image of the sequence. `tiled_map` (the blocks' norms, projections and
RoPE) takes integer inputs and gives several outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla.analysis import hlo_text
from zeroxla.models import Llama, LlamaConfig
from zeroxla.models.layers import fresh_zeros
from zeroxla.models.tiled_mlp import effective_chunk, tiled_map, tiled_mlp

TOL = 1e-6


def _swiglu(w_gate, w_up, w_down, h):                 # h [B, T, D] -> [B, T, D]
    gate = jax.nn.silu(jnp.einsum("BTD,DF->BTF", h, w_gate))
    return jnp.einsum("BTF,FD->BTD", gate * jnp.einsum("BTD,DF->BTF", h, w_up), w_down)


def _weights(d, f, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
                 for shape in ((d, f), (d, f), (f, d)))


@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 4, 5,
                                   pytest.param(13, marks=pytest.mark.slow), 100, None])
def test_equals_the_whole_mlp_forward_and_gradients(chunk):
    weights = _weights(8, 24)
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((2, 13, 8)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((2, 13, 8)), jnp.float32)

    def run(mlp):
        out, vjp = jax.vjp(mlp, h, *weights)
        return (out, *vjp(cotangent))

    tiled = jax.jit(lambda: run(lambda h, *w: tiled_mlp(lambda x: _swiglu(*w, x), h, chunk)))()
    whole = jax.jit(lambda: run(lambda h, *w: _swiglu(*w, h)))()
    for got, want in zip(tiled, whole):
        assert got.shape == want.shape
        got, want = np.asarray(got), np.asarray(want)     # on the host: no program per leaf
        scale = max(1.0, float(np.max(np.abs(want))))        # the weights' gradients sum T terms
        assert float(np.max(np.abs(got - want))) / scale < TOL


@pytest.mark.parametrize("chunk,seq_len,want", [(None, 5, None), (4096, 64, None),
                                                 (64, 64, None), (63, 64, 63), (16, 64, 16)])
def test_the_effective_chunk_is_none_once_one_chunk_holds_every_token(chunk, seq_len, want):
    assert effective_chunk(chunk, seq_len) == want


def test_refuses_an_empty_chunk():
    with pytest.raises(ValueError, match="mlp_chunk=0"):
        tiled_mlp(lambda x: x, jnp.zeros((1, 4, 2)), 0)
    with pytest.raises(ValueError, match=r"LlamaConfig.mlp_chunk=0 is invalid"):
        LlamaConfig(mlp_chunk=0)


@pytest.mark.slow   # daily: the token log-probs twin below (the same tiled MLP, the final
                    # norm tiled too)
def test_a_model_with_mlp_chunk_gives_its_plain_logits_and_gradients():
    config = LlamaConfig(init_std=0.2, num_layers=1)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 65, (2, 13)), jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((2, 13, 65)), jnp.float32)

    def logits_and_grads(cfg):
        model = Llama(cfg, rngs=nnx.Rngs(0))
        loss = lambda m: (jnp.sum(m(tokens) * cotangent), m(tokens))
        return nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)

    plain, tiled = logits_and_grads(config), logits_and_grads(config.replace(mlp_chunk=5))
    for got, want in zip(jax.tree.leaves(tiled), jax.tree.leaves(plain)):
        got, want = np.asarray(got), np.asarray(want)     # on the host: no program per leaf
        assert float(np.max(np.abs(got - want))) < 1e-5 * max(1.0, float(np.max(np.abs(want))))


def test_the_compiled_gradient_holds_no_t_by_f_buffer():
    """T = 4096 tokens, F = 1024: the whole MLP's gradient holds [T, F] intermediates; the tiled
    one (chunks of 256) only [256, F] ones."""
    t, d, f = 4096, 64, 1024
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, t, d), (d, f), (d, f), (f, d))]

    def largest(mlp):
        loss = lambda h, *w: mlp(h, *w).sum()
        program = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*shapes).compile()
        module = hlo_text.parse_module(program.as_text())
        return max(array.num_elements for computation in module.computations.values()
                   for instruction in computation.instructions
                   for array in hlo_text.parse_shape(instruction.shape))

    assert largest(lambda h, *w: _swiglu(*w, h)) >= t * f
    assert largest(lambda h, *w: tiled_mlp(lambda x: _swiglu(*w, x), h, 256)) < t * f


def test_tiled_map_takes_integer_inputs_and_gives_several_outputs():
    """`tiled_map` of a per-token function of a float and an integer input with two outputs and
    a closed-over weight: its outputs and the gradients of the input and of the weight equal the
    whole function's, for a chunk that does not divide T."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 13, 8)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 50, (2, 13)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)
    cotangents = (jnp.asarray(rng.standard_normal((2, 13, 6)), jnp.float32),
                  jnp.asarray(rng.standard_normal((2, 13)), jnp.float32))

    def per_token(w, x, p):
        h = jnp.einsum("BTD,DF->BTF", x, w) * jnp.cos(p.astype(jnp.float32))[..., None]
        return h, jnp.square(x).sum(-1)

    def run(chunk):
        out, vjp = jax.vjp(lambda x, w: tiled_map(lambda x, p: per_token(w, x, p),
                                                  (x, positions), chunk), x, w)
        return (*out, *vjp(cotangents))

    for got, want in zip(jax.jit(lambda: run(5))(), jax.jit(lambda: run(None))()):
        got, want = np.asarray(got), np.asarray(want)     # on the host: no program per leaf
        scale = max(1.0, float(np.max(np.abs(want))))
        assert float(np.max(np.abs(got - want))) / scale < TOL


def test_a_16bit_tiled_gradient_holds_no_float32_image_of_the_sequence():
    """bf16 h [1, T, D]: the tiled MLP's compiled gradient reads and writes its chunks through
    their bits, so it holds no float32 buffer of T x D elements (XLA:CPU's float normalization
    of a bf16 dynamic-slice made one of the input and one of the cotangent)."""
    t, d, f = 4096, 64, 256
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, t, d), (d, f), (d, f), (f, d))]
    loss = lambda h, *w: tiled_mlp(lambda x: _swiglu(*w, x), h, 256).astype(jnp.float32).sum()
    program = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*shapes).compile()
    module = hlo_text.parse_module(program.as_text())
    float32_sizes = [array.num_elements for computation in module.computations.values()
                     for instruction in computation.instructions
                     for array in hlo_text.parse_shape(instruction.shape)
                     if array.dtype == "f32"]
    assert max(float32_sizes) < t * d


def test_a_model_with_mlp_chunk_gives_its_plain_token_logprobs_and_gradients():
    """`token_logprobs` (the final norm tiled too, `Llama.hidden`) with `mlp_chunk` set equals
    it without, values and gradients."""
    config = LlamaConfig(init_std=0.2, num_layers=2)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, 65, (2, 13)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, 65, (2, 13)), jnp.int32)

    def logprobs_and_grads(cfg):
        model = Llama(cfg, rngs=nnx.Rngs(0))
        loss = lambda m: (m.token_logprobs(tokens, labels).sum(), m.token_logprobs(tokens, labels))
        return nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)

    plain = logprobs_and_grads(config)
    tiled = logprobs_and_grads(config.replace(mlp_chunk=4))
    for got, want in zip(jax.tree.leaves(tiled), jax.tree.leaves(plain)):
        got, want = np.asarray(got), np.asarray(want)     # on the host: no program per leaf
        assert float(np.max(np.abs(got - want))) < 1e-5 * max(1.0, float(np.max(np.abs(want))))


@pytest.mark.parametrize("after", [1.5, float("inf"), float("nan")])
def test_fresh_zeros_are_zeros_whatever_they_follow(after):
    """`layers.fresh_zeros` (a loop's buffers, made after a value so that XLA does not hoist
    them): exact zeros of the dtype, even after an infinite or NaN value."""
    got = jax.jit(lambda a: fresh_zeros((3, 2), jnp.bfloat16, a))(jnp.full((4,), after))
    assert got.dtype == jnp.bfloat16 and not np.any(np.asarray(got, np.float32))
