"""The Pallas flash attention route (`models.pallas_attention`, jax's Triton kernel behind our
contract), interpreted on this CPU: outputs and q/k/v gradients against a float64
softmax attention (GQA, a non-default scale, packed rows with padding whose output is zeros);
a family trained through it equals its naive route; it lowers for CUDA to Triton kernels
forward and backward; what the kernel does not take is refused by name, and "auto" keeps
blockwise off GPUs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla.compat.lowering import lower_for_cuda
from zeroxla.models import Llama, LlamaConfig
from zeroxla.models.attention import attention, choose
from zeroxla.models.pallas_attention import pallas_attention

pytest.importorskip("jax._src.lib.triton", reason="jaxlib without Triton bindings")


def float64_reference(q, k, v, cot, scale, segment_ids):
    """(out, [d/dq, d/dk, d/dv] of sum(out * cot)) as numpy float64: causal GQA softmax
    attention written out (segment 0 rows output zeros), differentiated by jax with x64 on for
    this computation only."""
    with jax.enable_x64(True):
        qq, kk, vv, cc = (jnp.asarray(np.asarray(a), jnp.float64) for a in (q, k, v, cot))

        def attend(q, k, v):
            h, t = q.shape[2], q.shape[1]
            k, v = (jnp.repeat(a, h // a.shape[2], axis=2) for a in (k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
            mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
            if segment_ids is not None:
                seg = jnp.asarray(np.asarray(segment_ids))
                mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
            out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask, s, -jnp.inf)), v)
            if segment_ids is not None:
                out = jnp.where((seg != 0)[:, :, None, None], out, 0.0)
            return out

        @jax.jit                                                  # one program, not op by op
        def out_and_grads(q, k, v, cot):
            out, pullback = jax.vjp(attend, q, k, v)
            return out, pullback(cot)

        out, grads = out_and_grads(qq, kk, vv, cc)
        return np.asarray(out), [np.asarray(x) for x in grads]


def packed_segments(t):
    """Two rows: three sequences then padding; one sequence filling the row."""
    first = np.concatenate([np.full(20, 1), np.full(9, 2), np.full(t - 40, 3), np.zeros(11)])
    return jnp.asarray(np.stack([first, np.ones(t)]), jnp.int32)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_outputs_and_gradients_equal_float64_softmax_attention(packed):
    b, t, h, g, d, scale = 2, 64, 4, 2, 16, 0.3
    rng = np.random.default_rng(0)
    q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                    for shape in [(b, t, h, d), (b, t, g, d), (b, t, g, d), (b, t, h, d)])
    segments = packed_segments(t) if packed else None

    def loss(q, k, v):
        out = attention(q, k, v, scale=scale, segment_ids=segments, implementation="pallas")
        return jnp.sum(out * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want, want_grads = float64_reference(q, k, v, cot, scale, segments)
    assert np.max(np.abs(np.asarray(out) - want)) < 2e-5 * np.max(np.abs(want))
    for got, want in zip(grads, want_grads):
        assert np.max(np.abs(np.asarray(got) - want)) < 1e-4 * max(1.0, np.max(np.abs(want)))
    if packed:                                   # padding's output is zeros
        assert np.all(np.asarray(out)[0, -11:] == 0)


def test_a_family_through_the_pallas_route_equals_its_naive_route():
    config = LlamaConfig(init_std=0.2, max_seq_len=64, d_model=64, num_heads=4)   # head dim 16
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 65, (1, 64)), jnp.int32)

    def logits_and_grads(implementation):
        model = Llama(config.replace(attention=implementation), rngs=nnx.Rngs(0))

        def loss(m):
            logits = m(tokens)
            return jnp.sum(logits ** 2) / logits.size, logits
        (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        return jax.tree.leaves((logits, grads))

    for got, want in zip(logits_and_grads("pallas"), logits_and_grads("naive")):
        got, want = np.asarray(got), np.asarray(want)     # on the host: no program per leaf
        scale = max(1.0, float(np.max(np.abs(want))))
        assert float(np.max(np.abs(got - want))) / scale < 1e-5


def test_lowers_to_triton_kernels_forward_and_backward_for_cuda():
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)

    def loss(q, k, v, seg):
        out = pallas_attention(q, k, v, segment_ids=seg, interpret=False)
        return out.astype(jnp.float32).sum()

    text = lower_for_cuda(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, k, seg).as_text()
    calls = re.findall(r"custom_call @(\S+)\(", text)
    assert calls == ["__gpu$xla.gpu.triton"] * 3, calls   # forward, backward's preprocess, backward
    assert {"mha_forward", "mha_preprocess_backward", "mha_backward"} <= set(
        re.findall(r"mha_\w+", text))


@pytest.mark.parametrize("shape,options,named", [
    ((1, 100, 2, 16), {}, "sequence length T=100"),
    ((1, 64, 2, 24), {}, "head_dim=24"),
    ((1, 64, 2, 16), {"window": 8}, "window=8"),
    ((1, 64, 2, 16), {"softcap": 30.0}, "softcap=30.0"),
])
def test_what_the_kernel_does_not_take_is_refused_by_name(shape, options, named):
    q = jnp.zeros(shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"implementation='pallas' cannot run this call: .*"
                                         + re.escape(named)):
        attention(q, q, q, implementation="pallas", **options)


def test_auto_stays_blockwise_off_gpus_where_pallas_would_take_the_call():
    assert jax.default_backend() == "cpu"
    q = jnp.zeros((1, 128, 2, 64), jnp.float32)
    assert choose(q, q, q, segment_ids=jnp.ones((1, 128), jnp.int32)) == "blockwise"


def test_a_jax_without_the_kernel_refuses_the_route_by_name(monkeypatch):
    """jax 0.11 and 0.12 deprecate the kernel's module; once a jax drops it, an explicit
    "pallas" names the module and its successor, and "auto" would not pick it."""
    from zeroxla.models import pallas_attention as module

    monkeypatch.setattr(module, "_kernel", lambda: None)
    q = jnp.zeros((1, 64, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"jax.experimental.pallas.ops.gpu.attention is not in "
                                         r"jax .*tokamax"):
        attention(q, q, q, implementation="pallas")
