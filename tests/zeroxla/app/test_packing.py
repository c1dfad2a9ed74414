"""Packed batches (`zeroxla.app.packing`) train exactly as padded ones.

The reference is the padded batch the test writes out itself: one example per row, positions
0..L-2, no segment ids, the model's plain (unpacked) forward. A packed batch holds the same
examples in fewer rows; its per-example losses, its loss and its gradients must equal the
padded batch's (the loss is a token mean, so grouping examples into rows changes nothing).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import flat_params
from zeroxla import models
from zeroxla.app import packing
from zeroxla.engine.loss import next_token_loss_terms

SEQ_LEN = 32
VOCAB = 65


def _examples(seed: int, lengths) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens int32[L], learned bool[L]) per example: a prompt, then the learned response."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        tokens = rng.integers(0, VOCAB, n + 1).astype(np.int32)
        learned = np.arange(n + 1) >= (rng.integers(1, n + 1) if n else 1)
        out.append((tokens, learned))
    return out


def _pairs_filling_8_rows(seed: int):
    """16 examples whose lengths pair up to exactly 32 tokens: first-fit decreasing packs
    them into 8 full rows (a multiple of the 8-device mesh's data size)."""
    long = list(range(17, 25))
    return _examples(seed, long + [SEQ_LEN - n for n in long])


def _padded(examples) -> dict[str, np.ndarray]:
    """The reference: one example per row, written out here."""
    n = len(examples)
    batch = {"inputs": np.zeros((n, SEQ_LEN), np.int32),
             "targets": np.zeros((n, SEQ_LEN), np.int32),
             "loss_mask": np.zeros((n, SEQ_LEN), np.float32)}
    for i, (tokens, learned) in enumerate(examples):
        k = len(tokens) - 1
        batch["inputs"][i, :k] = tokens[:-1]
        batch["targets"][i, :k] = tokens[1:]
        batch["loss_mask"][i, :k] = learned[1:]
    return batch


def test_first_fit_decreasing_places_every_sequence_once_within_capacity():
    lengths = list(np.random.default_rng(0).integers(0, 33, 200))
    bins = packing.first_fit_decreasing(lengths, 32)
    placed = sorted(i for b in bins for i in b)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[i] for i in b) <= 32 for b in bins)
    lower = -(-sum(lengths) // 32)
    assert lower <= len(bins) <= 11 * lower // 9 + 1       # first-fit decreasing's bound
    with pytest.raises(ValueError, match="sequence 1 has 40 tokens but a packed row holds 32"):
        packing.first_fit_decreasing([3, 40, 5], 32)


def test_pack_puts_each_example_whole_in_its_own_segment():
    examples = _examples(1, [5, 31, 12, 1, 20, 7, 0])
    packed = packing.pack(examples, SEQ_LEN, pad_id=3)
    padded = _padded(examples)
    found = 0
    for row in range(len(packed["inputs"])):
        segments = packed["segment_ids"][row]
        for s in set(segments[segments > 0].tolist()):
            at = np.flatnonzero(segments == s)
            assert at.tolist() == list(range(at[0], at[0] + len(at)))    # contiguous
            i = [k for k, (t, _) in enumerate(examples)
                 if len(t) - 1 == len(at) and np.array_equal(t[:-1], packed["inputs"][row, at])]
            assert len(i) == 1
            i = i[0]
            np.testing.assert_array_equal(packed["targets"][row, at],
                                          padded["targets"][i, :len(at)])
            np.testing.assert_array_equal(packed["loss_mask"][row, at],
                                          padded["loss_mask"][i, :len(at)])
            np.testing.assert_array_equal(packed["positions"][row, at], np.arange(len(at)))
            found += 1
        pad = segments == packing.PAD_SEGMENT
        assert np.all(packed["inputs"][row, pad] == 3)
        assert np.all(packed["loss_mask"][row, pad] == 0)
    assert found == 6                        # the example of 0 tokens to predict takes no slot


def _model(name: str):
    if name == "mistral":                    # sliding window shorter than the rows
        return models.build("llama-tiny", seed=2, sliding_window=6)
    if name == "gemma2":
        return models.Gemma2(models.Gemma2Config(sliding_window=6), rngs=nnx.Rngs(2))
    return models.build(name, seed=2)


def _per_example_nll(model, batch) -> np.ndarray:
    """Σ mask · nll of every segment (packed) or row (padded), in the order of the examples
    the rows were built from, float64 on the host."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, *args, **kwargs: nnx.merge(graphdef, s)(*args, **kwargs))
    logits = forward(state, jnp.asarray(batch["inputs"]), jnp.asarray(batch["positions"]),
                     segment_ids=jnp.asarray(batch["segment_ids"])) if "segment_ids" in batch \
        else forward(state, jnp.asarray(batch["inputs"]))
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), batch["targets"][..., None], -1)[..., 0]
    weighted = nll * batch["loss_mask"]
    if "segment_ids" not in batch:
        return weighted.sum(-1)
    out = {}
    for row in range(len(weighted)):
        for s in set(batch["segment_ids"][row].tolist()) - {0}:
            at = batch["segment_ids"][row] == s
            out[tuple(batch["inputs"][row, at])] = weighted[row, at].sum()
    return out


@pytest.mark.parametrize("name", [pytest.param("llama-tiny", marks=pytest.mark.slow),
                                  pytest.param("mistral", marks=pytest.mark.slow), "gpt-tiny",
                                  pytest.param("gemma2", marks=pytest.mark.slow)])
def test_packed_losses_and_gradients_equal_the_padded_batch(name):
    examples = _pairs_filling_8_rows(seed=3)
    padded, packed = _padded(examples), packing.pack(examples, SEQ_LEN, pad_id=0)
    assert len(packed["inputs"]) == 8
    model = _model(name)
    by_example = _per_example_nll(model, packed)
    padded_nll = _per_example_nll(model, padded)
    for i, (tokens, _) in enumerate(examples):
        np.testing.assert_allclose(by_example[tuple(tokens[:-1])], padded_nll[i], rtol=1e-6,
                                   atol=1e-6, err_msg=f"example {i}")
    graphdef, params = nnx.split(model, nnx.Param)

    def mean_loss(p, batch):
        total, count = next_token_loss_terms(nnx.merge(graphdef, p),
                                             jax.tree.map(jnp.asarray, batch))
        return total / count

    loss_and_grads = jax.jit(jax.value_and_grad(mean_loss))      # one program, not op by op
    (want, want_g), (got, got_g) = (loss_and_grads(params, b) for b in (padded, packed))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for path, g in flat_params(got_g).items():
        np.testing.assert_allclose(g, flat_params(want_g)[path], rtol=1e-5, atol=1e-6,
                                   err_msg=path)


def test_zero3_step_on_a_packed_batch_equals_the_padded_batch():
    """The step's batch sharding carries `positions` and `segment_ids` to every device."""
    examples = _pairs_filling_8_rows(seed=4)
    padded, packed = _padded(examples), packing.pack(examples, SEQ_LEN, pad_id=0)
    results = []
    for batch in (padded, packed):
        step = zeroxla.make_step(models.build("llama-tiny", seed=5), zeroxla.make_mesh(2, 4),
                                 optimizer=optax.sgd(1.0), config=zeroxla.ZeroConfig(stage=3))
        state, metrics = step(step.init(), batch)
        results.append((float(metrics["loss"]), flat_params(zeroxla.gather_params(state))))
    (want_loss, want), (got_loss, got) = results
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for path in want:                        # sgd(1.0): the parameters moved by the gradients
        np.testing.assert_allclose(got[path], want[path], rtol=0, atol=1e-6, err_msg=path)
