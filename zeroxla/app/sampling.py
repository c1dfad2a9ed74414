"""Temperature sampling from a trained language model, for a look at what it learned.

No KV cache: each new token re-runs the model on a fixed window of the last `context` tokens, so
the whole generation is one compiled `lax.fori_loop` with static shapes. Models with learned
positions (GPT-2) see positions 0..context-1 exactly as in training. While the text is shorter than
the window, the window is the start of the buffer and the causal mask hides the zero padding after
the last real token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zeroxla.app.tokenizer import Tokenizer


def sample_tokens(model: nnx.Module, prompt: np.ndarray, *, num_tokens: int, context: int,
                  temperature: float = 0.8, seed: int = 0) -> np.ndarray:
    """Extends `prompt` (int[P], P >= 1) by `num_tokens` sampled ids -> int32[P + num_tokens].

    `model(tokens int32[1, context]) -> logits [1, context, V]`; `temperature` 0 is greedy.
    """
    prompt = np.asarray(prompt, dtype=np.int32).reshape(-1)
    if prompt.size < 1:
        raise ValueError("sample_tokens: the prompt must hold at least one token")
    if num_tokens < 0 or context < 1:
        raise ValueError(f"sample_tokens: num_tokens={num_tokens} must be >= 0 and "
                         f"context={context} >= 1")
    if temperature < 0:
        raise ValueError(f"sample_tokens: temperature={temperature} is invalid; accepted: 0 "
                         "(greedy) or a positive number")
    length = prompt.size + num_tokens
    buffer = np.zeros(max(length, context), np.int32)
    buffer[:prompt.size] = prompt
    graphdef, state = nnx.split(model)

    @jax.jit
    def generate(state, buffer, key):
        def body(pos, carry):               # writes token `pos` from tokens [0, pos)
            buffer, key = carry
            start = jnp.maximum(0, pos - context)
            window = jax.lax.dynamic_slice(buffer, (start,), (context,))[None]    # [1, C]
            logits = nnx.merge(graphdef, state)(window)[0, pos - 1 - start]      # [V]
            key, sub = jax.random.split(key)
            if temperature == 0:
                token = jnp.argmax(logits)
            else:
                token = jax.random.categorical(sub, logits.astype(jnp.float32) / temperature)
            return buffer.at[pos].set(token.astype(jnp.int32)), key

        buffer, _ = jax.lax.fori_loop(prompt.size, length, body, (buffer, key))
        return buffer

    out = generate(state, jnp.asarray(buffer), jax.random.key(seed))
    return np.asarray(out)[:length]


def sample_text(model: nnx.Module, tokenizer: Tokenizer, prompt: str | np.ndarray, *,
                num_tokens: int, context: int, temperature: float = 0.8, seed: int = 0) -> str:
    """`prompt` (text, or token ids) followed by `num_tokens` sampled tokens, decoded."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else np.asarray(prompt)
    return tokenizer.decode(sample_tokens(model, ids, num_tokens=num_tokens, context=context,
                                          temperature=temperature, seed=seed))


def generate_from_checkpoint(checkpoint: str, prompt: str, *, max_new_tokens: int,
                             temperature: float, top_k: int | None, tp: int,
                             seed: int = 0, step: int | None = None) -> str:
    """`zeroxla generate`: the checkpoint's weights on this process's devices (ZeRO-3,
    one node), continued from `prompt` by the Hybrid Engine with `tp`-way tensor parallelism
    and a KV cache; returns prompt + continuation as text. The tokenizer is the one the
    checkpoint records (`zeroxla train` records it)."""
    import zeroxla
    from zeroxla.app.tokenizer import tokenizer_from_record
    from zeroxla.checkpoint.export import checkpoint_metadata
    from zeroxla.inference import HybridEngine, HybridEngineConfig

    meta = checkpoint_metadata(checkpoint, step=step)
    record = meta["metadata"].get("tokenizer")
    if record is None:
        raise ValueError(f"checkpoint {checkpoint!r} records no tokenizer; accepted: a "
                         "checkpoint written by `zeroxla train`")
    tokenizer = tokenizer_from_record(record)
    ids = np.asarray(tokenizer.encode(prompt), np.int32)
    # weights only (no optimizer state): the model under a ZeRO-3 step with a stateless
    # optimizer, which never runs
    import optax

    model = zeroxla.load_params(checkpoint, step=meta["step"])
    # load_params commits the weights to device 0; make_step needs them uncommitted (host)
    graphdef, values = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(np.asarray, values))
    step_fn = zeroxla.make_step(model, zeroxla.make_mesh(1), optimizer=optax.set_to_zero(),
                                config=zeroxla.ZeroConfig(stage=3))
    max_seq_len = meta["model_config"]["fields"]["max_seq_len"]
    if ids.size + max_new_tokens > max_seq_len:
        raise ValueError(f"--prompt ({ids.size} tokens) + --max-new-tokens={max_new_tokens} "
                         f"exceeds the model's max_seq_len={max_seq_len}; accepted: at most "
                         f"{max(0, max_seq_len - ids.size)} new tokens")
    engine = HybridEngine(step_fn, HybridEngineConfig(
        inference_tp_size=tp, max_out_tokens=ids.size + max_new_tokens))
    out = engine.generate(step_fn.init(), [ids], max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, seed=seed)[0]
    engine.release()
    return tokenizer.decode(out)
