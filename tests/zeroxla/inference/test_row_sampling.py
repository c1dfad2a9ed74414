"""Per-row sampling (`row_sampling`): rows with different knobs in one program draw, bit for bit,
the token `sampling.next_token` draws for each row under its own `Sampling`, with the log-prob
`sampling.sampled_logprobs` gives, at the float32 limits of the temperature too."""

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.inference.row_sampling import RowSampling, row_next_token
from zeroxla.inference.sampling import Sampling, next_token, sampled_logprobs

KNOBS = [Sampling(0.0), Sampling(1.0), Sampling(0.7, top_k=5), Sampling(1.3, top_p=0.8),
         Sampling(0.9, top_k=7, top_p=0.5, vocab_limit=40), Sampling(1e-39),   # greedy limit
         Sampling(1e39, top_k=3), Sampling(2.0 ** 127 * 1.5), Sampling(0.0, vocab_limit=10),
         Sampling(1.0, top_k=64)]


def test_each_row_draws_what_its_own_sampling_draws():
    v = 64
    logits = jax.random.normal(jax.random.key(0), (len(KNOBS), v)) * 3
    logits = logits.at[3, :5].set(logits[3, 0])                      # ties at the top
    keys = jax.random.split(jax.random.key(1), len(KNOBS))
    rows = jax.tree.map(jnp.asarray, RowSampling.of(KNOBS, v))
    tokens, logps = jax.jit(row_next_token)(logits, keys, rows)
    for r, sampling in enumerate(KNOBS):
        want = next_token(logits[r:r + 1], keys[r:r + 1], sampling)
        assert int(tokens[r]) == int(want[0]), (r, sampling)
        want_lp = sampled_logprobs(logits[r:r + 1], want, sampling)
        np.testing.assert_array_equal(np.asarray(logps[r]), np.asarray(want_lp[0]))
        if sampling.vocab_limit is not None:
            assert int(tokens[r]) < sampling.vocab_limit
