"""Ring attention (`models.ring_attention`) against the naive attention of the whole sequence,
forward and q / k / v gradients, on a 2-device sequence axis: chunks longer than a block and
not a multiple of it (each padded inside, the padding hidden by segment id 0), GQA, a sliding
window, soft-capping and packed rows. The trained-step comparisons against one device, and the
hop bytes, are in tests/zeroxla/engine/test_sequence_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from zeroxla.models.layers import causal_attention
from zeroxla.models.ring_attention import ring_attention
from zeroxla.models.sequence_parallel import SequenceParallel, zigzag_order

DEGREE, CHUNK = 2, 520            # chunks of 520 tokens: a 512 block and a padded second one
T = 2 * DEGREE * CHUNK


def _zigzag(x):
    """[B, T, ...] in sequence order -> the devices' zigzag layout (device r: chunks r,
    2P - 1 - r)."""
    b = x.shape[0]
    chunks = x.reshape(b, 2 * DEGREE, CHUNK, *x.shape[2:])
    return chunks[:, zigzag_order(DEGREE)].reshape(x.shape)


def _unzigzag(x):
    b = x.shape[0]
    chunks = x.reshape(b, 2 * DEGREE, CHUNK, *x.shape[2:])
    return chunks[:, np.argsort(zigzag_order(DEGREE))].reshape(x.shape)


@pytest.mark.parametrize("options", [
    pytest.param({}, id="causal"),
    pytest.param({"window": 300, "softcap": 5.0}, id="window-softcap", marks=pytest.mark.slow),
    pytest.param({"packed": True}, id="packed")])
def test_ring_equals_the_whole_sequences_attention(options):
    options = dict(options)
    packed = options.pop("packed", False)
    rng = np.random.default_rng(0)
    b, h, g, d = 1, 4, 2, 8
    q, k, v, cot = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
                    [(b, T, h, d), (b, T, g, d), (b, T, g, d), (b, T, h, d)])
    segments = None
    if packed:   # a sequence across the chunk boundaries, a short one, then padding (id 0)
        ids = np.concatenate([np.full(1300, 1), np.full(600, 2), np.zeros(T - 1900)])
        segments = jnp.asarray(ids[None], jnp.int32)
    mesh = Mesh(np.asarray(jax.devices()[:DEGREE]), ("sequence",))
    spec = P(None, "sequence")

    def ring(q, k, v, seg):
        return ring_attention(q, k, v, SequenceParallel("sequence", DEGREE, "ring"), seg,
                              **options)

    sharded = jax.shard_map(ring, mesh=mesh, in_specs=(spec, spec, spec,
                                                        None if segments is None else spec),
                            out_specs=spec, check_vma=False)

    def ring_loss(q, k, v):
        zz = [_zigzag(x) for x in (q, k, v)]
        seg = None if segments is None else _zigzag(segments)
        out = _unzigzag(sharded(*zz, seg))
        return jnp.sum(out * cot), out

    def naive_loss(q, k, v):
        out = causal_attention(q, k, v, segment_ids=segments, **options)
        return jnp.sum(out * cot), out

    (_, got), got_grads = jax.jit(jax.value_and_grad(ring_loss, (0, 1, 2), has_aux=True))(q, k, v)
    (_, want), want_grads = jax.jit(jax.value_and_grad(naive_loss, (0, 1, 2), has_aux=True))(
        q, k, v)
    for a, w in zip((got, *got_grads), (want, *want_grads)):
        scale = max(1.0, float(jnp.max(jnp.abs(w))))
        assert float(jnp.max(jnp.abs(a - w))) <= 2e-6 * scale
