"""Text from a trained language model: the train job's end-of-run sample and `zeroxla generate`
(`zeroxla.app.jobs.generate`).

Both run the Hybrid Engine (`zeroxla.HybridEngine`): the ZeRO-3 partitions are resharded once,
then a compiled decode loop extends the prompt with a KV cache, one forward of one token per new
token. The sample is at most `max_len` tokens long, prompt included: models with learned
positions (GPT-2) have no embedding past `max_seq_len`, and positions past the training sequence
length were never trained, so the job caps prompt + sample at `--seq-len` and says so
(`sample_with_engine` returns how many tokens it generated).

`sample_tokens` / `sample_text` are the plain no-cache sampler for any nnx model outside a
step (a full forward over a sliding window of `context` tokens per new token); the quickstart
notebook uses it on a gathered model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zeroxla.app.tokenizers.basic import Tokenizer
from zeroxla.inference.sampling import Sampling, check_sampling, next_token


def sample_tokens(model: nnx.Module, prompt: np.ndarray, *, num_tokens: int, context: int,
                  temperature: float = 0.8, seed: int = 0,
                  vocab_limit: int | None = None) -> np.ndarray:
    """Extends `prompt` (int[P], P >= 1) by `num_tokens` sampled ids -> int32[P + num_tokens].

    `model(tokens int32[1, context]) -> logits [1, context, V]`; `temperature` 0 is greedy,
    checked and drawn as the Hybrid Engine does (`zeroxla.inference.sampling`: below 2**-126
    greedy, above 3.4e38 uniform); no id >= `vocab_limit` (the tokenizer's size) is drawn.
    """
    prompt = np.asarray(prompt, dtype=np.int32).reshape(-1)
    if prompt.size < 1:
        raise ValueError("sample_tokens: the prompt must hold at least one token")
    if num_tokens < 0 or context < 1:
        raise ValueError(f"sample_tokens: num_tokens={num_tokens} must be >= 0 and "
                         f"context={context} >= 1")
    try:
        sampling = Sampling(temperature, vocab_limit=vocab_limit)   # the engine's knobs
    except ValueError as err:
        raise ValueError(f"sample_tokens: {err}") from None
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
            token = next_token(logits[None], sub, sampling)[0]
            return buffer.at[pos].set(token), key

        buffer, _ = jax.lax.fori_loop(prompt.size, length, body, (buffer, key))
        return buffer

    out = generate(state, jnp.asarray(buffer), jax.random.key(seed))
    return np.asarray(out)[:length]


def sample_text(model: nnx.Module, tokenizer: Tokenizer, prompt: str | np.ndarray, *,
                num_tokens: int, context: int, temperature: float = 0.8, seed: int = 0) -> str:
    """`prompt` (text, or token ids) followed by `num_tokens` sampled tokens, decoded."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else np.asarray(prompt)
    return tokenizer.decode(sample_tokens(model, ids, num_tokens=num_tokens, context=context,
                                          temperature=temperature, seed=seed,
                                          vocab_limit=tokenizer.vocab_size))


def local_zero3_step(model: nnx.Module) -> Any:
    """A ZeRO-3 step over this process's devices holding `model`'s weights (`step.init()`),
    with an optimizer that never runs: what the Hybrid Engine generates from when the weights
    did not come from a one-process training state (a checkpoint; a multi-process run)."""
    import optax

    import zeroxla

    return zeroxla.make_step(model, zeroxla.make_mesh(1, devices=jax.local_devices()),
                             optimizer=optax.set_to_zero(), config=zeroxla.ZeroConfig(stage=3))


def sample_with_engine(step: Any, state: Any, tokenizer: Tokenizer, prompt: np.ndarray, *,
                       num_tokens: int, max_len: int, temperature: float = 0.8,
                       top_k: int | None = None, seed: int = 0,
                       tp: int = 1) -> tuple[str, int]:
    """`prompt` (token ids, at least one) continued by the Hybrid Engine from `state` of
    `step`, decoded -> (text, new tokens generated).

    Generates min(`num_tokens`, `max_len` - prompt length) tokens: prompt + sample never exceed
    `max_len` (the caller's cap; see the module docstring). `temperature` 0 is greedy, equal to
    greedy decoding by the unsharded model (`tests/zeroxla/app/test_train_sampler.py`). Only
    ids the tokenizer decodes are drawn (`vocab_limit`: a model vocabulary padded past the
    tokenizer's keeps its rows, never sampled); a tokenizer larger than the model's vocabulary
    is refused naming both sizes. The engine's inference copy and KV cache are released before
    returning.
    """
    from zeroxla.inference import HybridEngine, HybridEngineConfig

    check_sampling(temperature, top_k, None)     # refused even when no token is generated
    ids = np.asarray(prompt, np.int32).reshape(-1)
    if ids.size < 1:
        raise ValueError("sample_with_engine: the prompt must hold at least one token")
    if ids.size > max_len:
        raise ValueError(f"sample_with_engine: the prompt ({ids.size} tokens) exceeds "
                         f"max_len={max_len}; accepted: a prompt of at most {max_len} tokens")
    vocab = step.layout.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's "
                         f"vocab_size is {vocab}: it has no logits for ids {vocab}.."
                         f"{tokenizer.vocab_size - 1}; accepted: a model vocabulary at least "
                         "the tokenizer's (padded is fine)")
    new = min(num_tokens, max_len - ids.size)
    if new <= 0:
        return tokenizer.decode(ids), 0
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=tp,
                                                   max_out_tokens=ids.size + new))
    try:
        out = engine.generate(state, [ids], max_new_tokens=new, temperature=temperature,
                              top_k=top_k, seed=seed, vocab_limit=tokenizer.vocab_size)[0]
    finally:
        engine.release()
    return tokenizer.decode(out), new


def check_tp(tp: int, model_fields: Mapping[str, Any], devices: int | None) -> None:
    """ValueError naming --tp, with the accepted sizes, unless `tp` divides the attention heads
    of the model whose config fields are `model_fields` (`num_heads`, and `num_kv_heads` when
    it has them) and `devices` (None: `zeroxla generate` simulates `tp` devices). The Hybrid
    Engine checks again on the devices it gets (GPUs, TPUs)."""
    from zeroxla.inference.layout import accepted_tp_sizes, tp_fits

    heads = model_fields.get("num_heads")
    if not isinstance(heads, int):
        return                           # not a models/ config: the engine checks its heads
    kv = [model_fields["num_kv_heads"]] if "num_kv_heads" in model_fields else []
    if not tp_fits(tp, devices, [heads], kv):
        shape = f"{heads} attention heads" + (f", {kv[0]} KV heads" if kv else "")
        where = f" on {devices} devices" if devices is not None else ""
        accepted = ", ".join(map(str, accepted_tp_sizes(devices, [heads], kv)))
        raise ValueError(f"--tp {tp} does not divide the checkpoint's model ({shape}){where}; "
                         f"accepted: {accepted}")


def check_generate_lengths(prompt: str, prompt_tokens: int, max_new_tokens: int,
                           config: Any) -> None:
    """ValueError naming the option at fault unless `zeroxla generate`'s --prompt (of
    `prompt_tokens` tokens) and --max-new-tokens fit the model `config`'s max_seq_len: an
    empty prompt and one longer than the model's positions blame --prompt, whatever the new
    tokens; a prompt that fits leaves room for max_seq_len - prompt_tokens new tokens."""
    if prompt_tokens == 0:
        what = "is empty" if not prompt else f"{prompt!r} encodes to no tokens"
        raise ValueError(f"--prompt {what}: there is nothing to continue; accepted: a --prompt "
                         "of at least one token")
    config.check_seq_len(prompt_tokens, "--prompt's token count",
                         accepted=f"a --prompt of at most {config.max_seq_len} tokens")
    config.check_seq_len(prompt_tokens + max_new_tokens, f"--prompt ({prompt_tokens} tokens) + "
                         f"--max-new-tokens {max_new_tokens} =", accepted=f"--max-new-tokens "
                         f"<= {config.max_seq_len - prompt_tokens} for this prompt")


