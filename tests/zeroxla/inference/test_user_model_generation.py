"""The Hybrid Engine on models written by a user, not by zeroxla: greedy generation from a trained
ZeRO-3 state equals the unsharded model decoding without a cache through its own `__call__`.

The models are written the way the Flax examples and nanoGPT write them: plain `nnx.Embed`,
`nnx.Linear`, `nnx.LayerNorm` / `nnx.RMSNorm`, no logical axis names, the blocks in a
`models.layers.LayerStack`. Each implements the engine's KV-cache protocol by hand
(`zeroxla.inference.checks`: `init_cache(batch, max_len) -> {"k", "v"} [L, batch, S, G, K]` and
`decode(tokens [B, T], positions [B, T], cache) -> (logits [B, T, V], cache)`), with its own
cache write and masked attention, none of `models.layers`' decode helpers:

* NanoKV: nanoGPT (learned positions from a second `nnx.Embed`, LayerNorm, biases, fused
  `c_attn`, the head tied to `wte` through `wte.attend`), 4 heads.
* GemmaKV: Gemma / Llama (RMSNorm, rotary positions, no biases, the embedding scaled by
  sqrt(D), grouped-query attention with 4 query heads over 2 KV heads, so the cache's G is 2,
  an untied `nnx.Linear` head).

First each model's `decode` (prefill, then one token at a time) is checked against its own
`__call__` on one device, so a failure of the engine comparison is the engine's. Then a few
ZeRO-3 steps on the 2 x 4 mesh (every leaf partitioned, so the reshard moves each), and the
engine's greedy tokens for tensor-parallel sizes 1, 2 and 4, on four prompts of lengths 1, 3, 5
and 7 in one batch, must equal `inference_helpers.greedy_reference` (the gathered model, a full
forward per token) exactly.

With no logical axis names, every parameter's dims are unnamed, so the tensor-parallel layout
replicates each parameter on every device (the rules' default for unnamed dims) and splits only
the KV cache's G dim over `tensor` where tp divides it (asserted below): the parity checked here
is that of this layout, the reshard gathering every leaf (route "gather", padded vocabulary
rows included) and GSPMD writing a G-split cache from replicated weights.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from inference_helpers import greedy_reference
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.models.layers import LayerStack

V, D, LAYERS, SEQ = 30, 32, 2, 16          # SEQ: nanoGPT's block size (its learned positions)
NEW, MAX_OUT = 8, 16
PROMPT_LENGTHS = (1, 3, 5, 7)


# ------------------------------------------------------------------------------------------------
# Attention with and without a cache, as a user writes it.
def attend(q, k, v, visible):
    """q [B, T, H, K]; k, v [B, S, G, K] (H a multiple of G: query head h reads KV head
    h // (H / G), each KV head repeated as Llama's `repeat_kv` does); visible bool [B, T, S]."""
    repeat = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    scores = jnp.einsum("BTHK,BSHK->BHTS", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    scores = jnp.where(visible[:, None], scores, -1e9)
    return jnp.einsum("BHTS,BSHK->BTHK", jax.nn.softmax(scores, axis=-1), v)


def causal(q, k, v):
    """The training path: every token sees itself and the tokens before it."""
    b, t = q.shape[:2]
    return attend(q, k, v, jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)))


def cached(q, k, v, positions, cache):
    """The decode path: this layer's cache {"k", "v"} [B, S, G, K]; token (b, t) writes its key
    and value to slot positions[b, t] and sees the slots at or below it (a right-padded prompt's
    pad slots lie above the row's position until a real token overwrites them)."""
    rows = jnp.arange(q.shape[0])[:, None]
    cache = {"k": cache["k"].at[rows, positions].set(k),
             "v": cache["v"].at[rows, positions].set(v)}
    visible = jnp.arange(cache["k"].shape[1])[None, None, :] <= positions[:, :, None]
    return attend(q, cache["k"], cache["v"], visible), cache


def empty_cache(batch, max_len, heads, head_dim):
    shape = (LAYERS, batch, max_len, heads, head_dim)
    return {"k": jnp.zeros(shape, jnp.float32), "v": jnp.zeros(shape, jnp.float32)}


# ------------------------------------------------------------------------------------------------
# nanoGPT with a KV cache.
NANO_HEADS = 4


class NanoBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln_1 = nnx.LayerNorm(D, rngs=rngs)
        self.c_attn = nnx.Linear(D, 3 * D, rngs=rngs)
        self.c_proj = nnx.Linear(D, D, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(D, rngs=rngs)
        self.c_fc = nnx.Linear(D, 4 * D, rngs=rngs)
        self.mlp_proj = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x, positions, cache=None):
        b, t, _ = x.shape
        q, k, v = (a.reshape(b, t, NANO_HEADS, D // NANO_HEADS)
                   for a in jnp.split(self.c_attn(self.ln_1(x)), 3, -1))
        if cache is None:
            a = causal(q, k, v)
        else:
            a, cache = cached(q, k, v, positions, cache)
        x = x + self.c_proj(a.reshape(b, t, D))
        x = x + self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x))))
        return x if cache is None else (x, cache)


class NanoKV(nnx.Module):
    def __init__(self, rngs):
        self.wte = nnx.Embed(V, D, rngs=rngs)
        self.wpe = nnx.Embed(SEQ, D, rngs=rngs)
        self.blocks = LayerStack(NanoBlock, LAYERS, rngs)
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)

    def forward(self, tokens, positions, cache=None):
        x = self.wte(tokens) + self.wpe(positions)
        x, cache = self.blocks(x, positions, cache=cache)
        return self.wte.attend(self.ln_f(x)), cache

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self.forward(tokens, positions)[0]

    def init_cache(self, batch, max_len):
        if max_len > SEQ:
            raise ValueError(f"NanoKV has {SEQ} learned positions; accepted: 1..{SEQ}")
        return empty_cache(batch, max_len, NANO_HEADS, D // NANO_HEADS)

    def decode(self, tokens, positions, cache):
        return self.forward(tokens, positions, cache)


# ------------------------------------------------------------------------------------------------
# Gemma / Llama with grouped-query attention and a KV cache.
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def rope(x, positions):                               # x [B, T, H, K], positions [B, T]
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    angle = positions[..., None, None].astype(jnp.float32) * freq               # [B, T, 1, K/2]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                            x1 * jnp.sin(angle) + x2 * jnp.cos(angle)], -1)


class GemmaBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm_1 = nnx.RMSNorm(D, rngs=rngs)
        self.q = nnx.Linear(D, HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(D, 2 * KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(HEADS * HEAD_DIM, D, use_bias=False, rngs=rngs)
        self.norm_2 = nnx.RMSNorm(D, rngs=rngs)
        self.gate = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)

    def __call__(self, x, positions, cache=None):
        b, t, _ = x.shape
        h = self.norm_1(x)
        q = rope(self.q(h).reshape(b, t, HEADS, HEAD_DIM), positions)
        k, v = (a.reshape(b, t, KV_HEADS, HEAD_DIM) for a in jnp.split(self.kv(h), 2, -1))
        k = rope(k, positions)
        if cache is None:
            a = causal(q, k, v)
        else:
            a, cache = cached(q, k, v, positions, cache)
        x = x + self.out(a.reshape(b, t, HEADS * HEAD_DIM))
        h = self.norm_2(x)
        x = x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))
        return x if cache is None else (x, cache)


class GemmaKV(nnx.Module):
    def __init__(self, rngs):
        self.embedder = nnx.Embed(V, D, rngs=rngs)
        self.blocks = LayerStack(GemmaBlock, LAYERS, rngs)
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def forward(self, tokens, positions, cache=None):
        x = self.embedder(tokens) * jnp.sqrt(jnp.float32(D))
        x, cache = self.blocks(x, positions, cache=cache)
        return self.lm_head(self.final_norm(x)), cache

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self.forward(tokens, positions)[0]

    def init_cache(self, batch, max_len):
        return empty_cache(batch, max_len, KV_HEADS, HEAD_DIM)

    def decode(self, tokens, positions, cache):
        return self.forward(tokens, positions, cache)


MODELS = {"nanogpt": lambda: NanoKV(nnx.Rngs(0)), "gemma-gqa": lambda: GemmaKV(nnx.Rngs(1))}


# ------------------------------------------------------------------------------------------------
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, V, n).astype(np.int32) for n in PROMPT_LENGTHS]


def cached_greedy(model, prompts, new_tokens):
    """Greedy decoding through the model's own `init_cache` / `decode`, on one device, the
    way the engine's loop feeds it: the right-padded prompts prefilled at positions 0..P-1,
    then each row's newest token at its own position."""
    b, p = len(prompts), max(x.size for x in prompts)
    tokens = np.zeros((b, p), np.int32)
    for i, x in enumerate(prompts):
        tokens[i, :x.size] = x
    lengths = np.array([x.size for x in prompts])
    decode = nnx.jit(lambda m, t, pos, c: m.decode(t, pos, c))
    cache = model.init_cache(b, p + new_tokens)
    logits, cache = decode(model, jnp.asarray(tokens),
                           jnp.asarray(np.broadcast_to(np.arange(p, dtype=np.int32), (b, p))),
                           cache)
    last = np.asarray(logits)[np.arange(b), lengths - 1]
    outs = [list(x) for x in prompts]
    for n in range(new_tokens):
        token = last.argmax(-1).astype(np.int32)
        for row, t in zip(outs, token):
            row.append(int(t))
        if n + 1 == new_tokens:
            break
        logits, cache = decode(model, jnp.asarray(token[:, None]),
                               jnp.asarray((lengths + n)[:, None].astype(np.int32)), cache)
        last = np.asarray(logits)[:, 0]
    return [np.asarray(row, np.int32) for row in outs]


@pytest.mark.parametrize("name", list(MODELS))
def test_user_decode_matches_its_own_call(name):
    """The model code itself: prefill logits equal `__call__`'s where the prompt is real, and
    cached greedy decoding equals greedy by full forwards."""
    model = MODELS[name]()
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, V, (3, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (3, 9))
    logits, cache = model.decode(tokens, positions, model.init_cache(3, MAX_OUT))
    np.testing.assert_allclose(logits, model(tokens), rtol=1e-5, atol=1e-5)
    assert jax.tree.map(jnp.shape, cache) == jax.tree.map(jnp.shape, model.init_cache(3, MAX_OUT))
    ps = prompts()
    outs = cached_greedy(model, ps, NEW)
    for out, ref in zip(outs, greedy_reference(model, ps, NEW)):
        np.testing.assert_array_equal(out, ref)
    assert len({tuple(o[p.size:]) for o, p in zip(outs, ps)}) > 1, "degenerate model"


def batches(seed, count):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        t = jnp.asarray(rng.integers(0, V, (8, SEQ + 1)), jnp.int32)
        yield {"inputs": t[:, :-1], "targets": t[:, 1:]}


@functools.cache
def trained(name):
    """The ZeRO-3 step of `name` on the 2 x 4 mesh (every leaf partitioned) and its state after
    2 Adam steps."""
    step = zeroxla.make_step(MODELS[name](), zeroxla.make_mesh(2, 4), optimizer=optax.adam(1e-2),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state = step.init()
    for batch in batches(11, 2):
        state, _ = step(state, batch)
    return step, state


def _one_degree_per_model():
    """Daily: nanoGPT at tp 2 (its 4 KV heads split) and the GQA model at tp 4 (its 2 KV heads
    not divisible: the cache replicated); the rest slow."""
    daily = {("nanogpt", 2)}
    return [pytest.param(name, tp, id=f"{name}-{tp}",
                         marks=() if (name, tp) in daily else pytest.mark.slow)
            for name in MODELS for tp in (1, 2, 4)]


@pytest.mark.parametrize("name,tp", _one_degree_per_model())
def test_engine_greedy_matches_unsharded_user_model(name, tp):
    step, state = trained(name)
    model = step.gathered_model(state)
    initial = nnx.state(MODELS[name](), nnx.Param)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                                                     jax.tree.leaves(initial))), "not trained"
    engine = HybridEngine(step.layout,
                          HybridEngineConfig(inference_tp_size=tp, max_out_tokens=MAX_OUT))
    ps = prompts()
    outs = engine.generate(state, ps, max_new_tokens=NEW)
    expected = greedy_reference(model, ps, NEW)
    for prompt, out, ref in zip(ps, outs, expected):
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out, ref)
    assert len({tuple(o[p.size:]) for o, p in zip(outs, ps)}) > 1, "degenerate model"
    g = model.init_cache(1, MAX_OUT)["k"].shape[3]
    layout = engine.layout
    assert layout.kv_repeat == 1 and all(spec == jax.sharding.PartitionSpec(*[None] * len(spec))
                                         for _, spec in layout.specs)
    assert layout.cache_spec(g)[3] == (layout.axes.tensor if tp > 1 and g % tp == 0 else None)


def test_learned_positions_bound_max_out_tokens():
    """nanoGPT's own refusal in `init_cache` (past its learned positions) reaches the user by
    name, before anything compiles."""
    step = zeroxla.make_step(MODELS["nanogpt"](), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=3))
    with pytest.raises(ValueError, match=rf"max_out_tokens={SEQ + 1} does not fit the model: "
                                         rf"NanoKV has {SEQ} learned positions"):
        HybridEngine(step.layout, HybridEngineConfig(max_out_tokens=SEQ + 1))
