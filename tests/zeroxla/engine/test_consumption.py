"""A user's own model under sequence parallelism or a packed batch trains only when its traced
loss provably uses what the step gave it (`zeroxla.engine.consumption`): the sequence-parallel
attention's exchange over the 'sequence' axis, the batch's `segment_ids` and `positions`.

The models are written the way users write them (nanoGPT-style, nnx): one that takes everything
through `**kwargs` and drops it, one that declares `sequence=None` and ignores it, and one that
passes `sequence` / `segment_ids` / `positions` to the library's attention and embedding.
Reference for the last: the same model called on one device on the whole, unsplit batch
(`_masked_loss`), the loss written out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla.engine.loss import model_token_logprobs
from zeroxla.engine.token_forward import TokenForward
from zeroxla.models.attention import attention

T, B, VOCAB, D, HEADS = 16, 8, 31, 16, 4


class TinyGPT(nnx.Module):
    """nanoGPT in one block: token and position embeddings, causal attention, a head."""

    def __init__(self, rngs):
        self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
        self.wpe = nnx.Embed(T, D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def forward(self, tokens, positions=None, segment_ids=None, sequence=None):
        b, t = tokens.shape
        if positions is None:
            positions = (jnp.broadcast_to(jnp.arange(t), (b, t)) if sequence is None
                         else sequence.positions(tokens))
        x = self.wte(tokens) + self.wpe(positions)                           # [B, T, D]
        q, k, v = (y.reshape(b, t, HEADS, D // HEADS)
                   for y in jnp.split(self.qkv(x), 3, axis=-1))             # [B, T, H, K]
        y = attention(q, k, v, segment_ids=segment_ids, sequence=sequence)
        return self.head(x + self.proj(y.reshape(b, t, D)))                  # [B, T, V]


class KwargsGPT(TinyGPT):
    """Takes whatever it is given through **kwargs and drops it."""

    def __call__(self, tokens, **kwargs):
        return self.forward(tokens)


class IgnoresSequenceGPT(TinyGPT):
    """Declares every argument; drops `sequence` (its attention sees the device's slice)."""

    def __call__(self, tokens, positions=None, segment_ids=None, sequence=None):
        return self.forward(tokens, positions, segment_ids)


class IgnoresSegmentsGPT(TinyGPT):
    """Declares every argument; drops `segment_ids` (a packed row attends as one sequence)."""

    def __call__(self, tokens, positions=None, segment_ids=None, sequence=None):
        return self.forward(tokens, positions, None, sequence)


class SegmentAwareGPT(TinyGPT):
    """Passes all it is given to the library's attention and its position table."""

    def __call__(self, tokens, positions=None, segment_ids=None, sequence=None):
        return self.forward(tokens, positions, segment_ids, sequence)


def _batch(packed=False, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (B, T + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if packed:          # two sequences per row, cut at a different place in each row
        cuts = rng.integers(3, T - 3, B)
        slots = np.arange(T)[None]
        batch["segment_ids"] = np.where(slots < cuts[:, None], 1, 2).astype(np.int32)
        batch["positions"] = np.where(slots < cuts[:, None], slots,
                                      slots - cuts[:, None]).astype(np.int32)
    return batch


def _step(cls, sequence=1, strategy="ulysses"):
    mesh = zeroxla.make_mesh(1, 8 // sequence, sequence=sequence)
    config = zeroxla.ZeroConfig(stage=3, sequence_parallel_strategy=strategy)
    return zeroxla.make_step(lambda: cls(nnx.Rngs(0)), mesh, config=config)


def _masked_loss(model, batch):
    """Mean next-token cross-entropy of the whole, unsplit batch on one device."""
    options = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
    logits = model(batch["inputs"], **options)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


SLOW = pytest.mark.slow      # the daily subset keeps one case of each kind


@pytest.mark.parametrize("cls, strategy", [pytest.param(KwargsGPT, "ulysses", marks=SLOW),
                                           pytest.param(KwargsGPT, "ring", marks=SLOW),
                                           (IgnoresSequenceGPT, "ulysses")])
def test_a_model_that_drops_the_sequence_layout_is_refused(cls, strategy):
    step = _step(cls, sequence=2, strategy=strategy)
    with pytest.raises(ValueError, match=rf"{cls.__name__} runs no sequence-parallel "
                                         "attention: the model was given sequence="):
        step(step.init(), _batch())


@pytest.mark.parametrize("cls, key", [pytest.param(KwargsGPT, "segment_ids", marks=SLOW),
                                      (IgnoresSegmentsGPT, "segment_ids")])
def test_a_model_that_drops_the_packed_batch_keys_is_refused(cls, key):
    step = _step(cls)
    with pytest.raises(ValueError, match=rf"batch\['{key}'\].*{cls.__name__}.*does not depend"):
        step(step.init(), _batch(packed=True))


@pytest.mark.parametrize("sequence", [pytest.param(1, marks=SLOW), 2])
def test_a_user_model_that_passes_them_to_the_attention_trains_as_on_one_device(sequence):
    batch = _batch(packed=True)
    want = float(_masked_loss(SegmentAwareGPT(nnx.Rngs(0)), batch))
    step = _step(SegmentAwareGPT, sequence=sequence)
    _, metrics = step(step.init(), batch)
    assert abs(float(metrics["loss"]) - want) <= 1e-5 * abs(want), (metrics["loss"], want)


def logprobs(model, batch, *, sequence=None):
    """A per-token forward for `TokenForward` (an RL policy's log-probs)."""
    return model_token_logprobs(model, batch["inputs"], batch["targets"],
                                positions=batch["positions"], segment_ids=batch["segment_ids"],
                                sequence=sequence)


def test_per_token_values_of_a_model_that_drops_the_packed_keys_are_refused():
    step = _step(KwargsGPT, sequence=2)
    with pytest.raises(ValueError, match=r"batch\['segment_ids'\].*KwargsGPT \(called by "
                                         r"logprobs\) does not depend"):
        TokenForward(step, logprobs)(step.init(), _batch(packed=True))
