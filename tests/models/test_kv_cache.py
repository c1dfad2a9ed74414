"""KV-cached decoding equals the full forward: prefill of right-padded prompts of mixed lengths,
then one token per call at each row's own position (teacher-forced), logits compared at every
real position against `model(tokens)` (no cache), float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla.models import GPT, GPTConfig, Llama, LlamaConfig
from zeroxla.models.layers import KV_CACHE_AXES

FAMILIES = {
    "gpt": lambda: GPT(GPTConfig.tiny().replace(init_std=0.2), rngs=nnx.Rngs(1)),
    "llama": lambda: Llama(LlamaConfig.tiny().replace(init_std=0.2), rngs=nnx.Rngs(2)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_then_decode_equals_full_forward(family):
    model = FAMILIES[family]()
    lengths = np.array([1, 3, 5, 7])                 # prompt length per row
    total, max_len = 11, 16                          # tokens per row; cache slots
    rng = np.random.default_rng(0)
    seqs = jnp.asarray(rng.integers(0, 65, (4, total)), jnp.int32)          # [B, N]
    full = np.asarray(nnx.jit(lambda m, t: m(t))(model, seqs))   # [B, N, V], one program

    prompt_bucket = int(lengths.max())
    pad = np.arange(prompt_bucket)[None, :] >= lengths[:, None]
    # Right padding: pad slots hold a junk token, which a correct mask never lets through.
    prompts = jnp.where(jnp.asarray(pad), 64, seqs[:, :prompt_bucket])
    positions = jnp.broadcast_to(jnp.arange(prompt_bucket, dtype=jnp.int32), prompts.shape)
    cache = model.init_cache(4, max_len)
    assert cache["k"].shape == (model.config.num_layers, 4, max_len,
                                getattr(model.config, "num_kv_heads", model.config.num_heads),
                                model.config.head_dim)
    assert len(KV_CACHE_AXES) == cache["k"].ndim
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    logits, cache = step(model, prompts, positions, cache)
    logits = np.asarray(logits)                      # compared on the host, row by row
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], full[b, :n], atol=1e-5, rtol=0)

    pos = jnp.asarray(lengths, jnp.int32)
    for _ in range(total - prompt_bucket):
        token = jnp.take_along_axis(seqs, pos[:, None], axis=1)              # [B, 1]
        logits, cache = step(model, token, pos[:, None], cache)
        expected = np.take_along_axis(full, np.asarray(pos)[:, None, None], axis=1)  # [B,1,V]
        np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
        pos = pos + 1


def test_training_forward_unchanged_without_cache():
    """The cache-free path is the training path: blocks return no cache."""
    model = FAMILIES["llama"]()
    tokens = jnp.zeros((2, 5), jnp.int32)
    x = model.embed(tokens, None)
    _, cache = model.blocks(x, jnp.zeros((2, 5), jnp.int32))
    assert cache is None
