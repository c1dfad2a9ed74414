"""The step's default loss takes the models' chunked log-prob protocol (`model.token_logprobs`)
and equals the whole-logits cross-entropy; a user model without it, or a subclass whose forward
differs, is called for its logits (unchanged results); a batch's `segment_ids` that a model
cannot take are refused by name, never ignored."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import flat_params, token_batches, train_single_device
from zeroxla import models
from zeroxla.engine.loss import (has_chunked_logprobs, model_token_logprobs,
                                 next_token_loss_terms, token_cross_entropy)

VOCAB = 65


def _batch(b=2, t=11, seed=0):
    rng = np.random.default_rng(seed)
    return {"inputs": rng.integers(0, VOCAB, (b, t)).astype(np.int32),
            "targets": rng.integers(0, VOCAB, (b, t)).astype(np.int32),
            "loss_mask": (rng.uniform(size=(b, t)) < 0.6).astype(np.float32)}


def _llama(chunk=4):
    model = models.Llama(models.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    model.head.logits_chunk = chunk
    return model


class Bigram(nnx.Module):
    """A user's model: logits from the current token alone, no protocol."""

    def __init__(self, rngs):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, VOCAB)))

    def __call__(self, tokens):
        return self.table[...][tokens]


class DoubledLlama(models.Llama):
    """A subclass whose forward differs from the chunked head's."""

    def __call__(self, tokens, positions=None):
        return 2.0 * super().__call__(tokens, positions)


def test_default_loss_of_a_family_is_chunked_and_equals_whole_logits():
    model, batch = _llama(), _batch()
    assert has_chunked_logprobs(model)
    got = next_token_loss_terms(model, batch)
    want = token_cross_entropy(model(batch["inputs"]), batch)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)


def test_batch_positions_reach_the_model():
    model, batch = _llama(), _batch(t=9)
    # Not a shift of 0..T-1 (RoPE would not see it): positions restart mid-row.
    batch["positions"] = np.tile(np.r_[0:5, 0:4].astype(np.int32), (2, 1))
    got = next_token_loss_terms(model, batch)
    want = token_cross_entropy(model(batch["inputs"], batch["positions"]), batch)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)
    assert not np.allclose(got[0], token_cross_entropy(model(batch["inputs"]), batch)[0])


def test_a_packed_batch_reaches_the_model_with_its_segment_ids():
    model, batch = _llama(), _batch(t=9)
    batch["positions"] = np.tile(np.r_[0:5, 0:4].astype(np.int32), (2, 1))
    batch["segment_ids"] = np.tile(np.r_[[1] * 5, [2] * 4].astype(np.int32), (2, 1))
    got = next_token_loss_terms(model, batch)
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    np.testing.assert_allclose(got, token_cross_entropy(logits, batch), atol=1e-5, rtol=1e-6)
    unpacked = token_cross_entropy(model(batch["inputs"], batch["positions"]), batch)
    assert not np.allclose(got[0], unpacked[0])        # the segments did cut the attention


def test_a_user_model_is_called_for_its_logits():
    model, batch = Bigram(nnx.Rngs(0)), _batch()
    assert not has_chunked_logprobs(model)
    got = next_token_loss_terms(model, batch)
    np.testing.assert_array_equal(got, token_cross_entropy(model(batch["inputs"]), batch))


def test_a_subclass_with_its_own_forward_is_called_for_its_logits():
    model, batch = DoubledLlama(models.LlamaConfig.tiny(), rngs=nnx.Rngs(0)), _batch()
    assert not has_chunked_logprobs(model)
    got = next_token_loss_terms(model, batch)
    np.testing.assert_array_equal(got, token_cross_entropy(model(batch["inputs"]), batch))


def test_a_stand_in_answering_every_attribute_is_not_taken_for_the_protocol():
    class StandIn:                      # as ZeRO-3's `_GatheredModule`: __getattr__ answers all
        def __getattr__(self, name):
            return lambda *args, **kwargs: None
    assert not has_chunked_logprobs(StandIn())


def test_segment_ids_a_model_cannot_take_are_refused_by_name():
    batch = _batch()
    batch["segment_ids"] = np.zeros((2, 11), np.int32)
    with pytest.raises(ValueError, match=r"batch\['segment_ids'\].*Bigram.__call__"):
        next_token_loss_terms(Bigram(nnx.Rngs(0)), batch)


def test_vocab_limit_of_the_fallback_masks_the_padded_ids():
    model, batch = Bigram(nnx.Rngs(0)), _batch()
    got = model_token_logprobs(model, batch["inputs"], batch["inputs"] % 40, vocab_limit=40)
    logits = model(batch["inputs"])[..., :40]
    want = jnp.take_along_axis(jax.nn.log_softmax(logits), (batch["inputs"] % 40)[..., None],
                               -1)[..., 0]
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("remat", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_zero3_step_with_a_chunked_tied_head_trains_like_whole_logits_on_one_device(remat):
    """ZeRO-3 gathers the tied embedding once around `attend_logprobs` (a method of the module
    owning it), its chunks (T = 11, chunks of 4) read it; the step's losses and parameters equal
    plain optax on the whole-logits loss (`tests/support/reference.py`)."""
    config = models.LlamaConfig.tiny().replace(tie_word_embeddings=True)

    def build():
        model = models.Llama(config, rngs=nnx.Rngs(1))
        model.embed.logits_chunk = 4
        return model

    batches = token_batches(2, 8, 11, vocab=VOCAB, seed=3)
    want_losses, want = train_single_device(build(), optax.sgd(0.5), batches)
    step = zeroxla.make_step(build(), zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.5),
                             config=zeroxla.ZeroConfig(stage=3, remat=remat))
    state, losses = step.init(), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    got = flat_params(zeroxla.gather_params(state))
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-6, err_msg=path)
