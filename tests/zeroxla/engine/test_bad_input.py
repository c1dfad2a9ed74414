"""Bad input raises a ValueError that names the field and the accepted values."""

import jax
import numpy as np
import optax
import pytest

from zeroxla import models
import zeroxla


@pytest.fixture(scope="module")
def step():
    return zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(persistence_threshold=500))


@pytest.fixture(scope="module")
def state(step):
    return step.init()


def _tokens(*shape):
    return np.zeros(shape, np.int32)


def test_wrong_batch_rank(step, state):
    with pytest.raises(ValueError, match=r"batch\['inputs'\] has shape \(16, 8, 2\); expected int32\[B, T\]"):
        step(state, {"inputs": _tokens(16, 8, 2), "targets": _tokens(16, 8, 2)})


def test_mismatched_inputs_and_targets(step, state):
    with pytest.raises(ValueError, match=r"batch\['inputs'\] \(16, 8\) and batch\['targets'\] \(16, 9\)"):
        step(state, {"inputs": _tokens(16, 8), "targets": _tokens(16, 9)})


def test_missing_key(step, state):
    with pytest.raises(ValueError, match=r"keys \['inputs', 'targets'\]"):
        step(state, {"inputs": _tokens(16, 8)})


def test_float_tokens(step, state):
    with pytest.raises(ValueError, match="dtype float32; expected int32"):
        step(state, {"inputs": np.zeros((16, 8), np.float32), "targets": _tokens(16, 8)})


def test_batch_not_divisible_by_data_parallel_size(step, state):
    with pytest.raises(ValueError, match=r"B=12 is not divisible by data-parallel size 8 .* "
                                         r"accepted: multiples of 8"):
        step(state, {"inputs": _tokens(12, 8), "targets": _tokens(12, 8)})


def test_batch_not_divisible_with_accumulation():
    step = zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(1, 8),
                             config=zeroxla.ZeroConfig(gradient_accumulation_steps=4))
    with pytest.raises(ValueError, match="gradient_accumulation_steps 4 = 32; accepted: multiples of 32"):
        step.lower(None, {"inputs": _tokens(16, 8), "targets": _tokens(16, 8)})


def test_sequence_longer_than_model(step, state):
    with pytest.raises(ValueError, match="max_seq_len=128"):
        step(state, {"inputs": _tokens(8, 200), "targets": _tokens(8, 200)})


def test_mesh_with_foreign_axes():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match=r"mesh axes \('data',\) are not supported.*'node', 'local'"):
        zeroxla.make_step(models.build("gpt-tiny"), mesh)


def test_hpz_partition_size_must_divide_local_devices():
    with pytest.raises(ValueError, match=r"hpz_partition_size=3 .* divisor of the 4 devices per "
                                         r"node: 1, 2, 4"):
        zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                          config=zeroxla.ZeroConfig(hpz_partition_size=3))


def test_model_must_be_module_or_factory():
    with pytest.raises(TypeError, match="nnx.Module or a factory"):
        zeroxla.make_step(42, zeroxla.make_mesh(2, 4))


@pytest.mark.parametrize("key, bad, shown", [("inputs", 65, r"\[0, 65\]"),
                                             ("targets", -1, r"\[-1, 0\]")])
def test_token_ids_outside_the_vocabulary(step, state, key, bad, shown):
    """gpt-tiny's vocabulary is 65: an id of 65 or -1 would index out of the embedding (XLA
    clamps it silently) or pick no target; host batches are checked before they are sent."""
    batch = {"inputs": _tokens(16, 8), "targets": _tokens(16, 8)}
    batch[key] = batch[key].copy()
    batch[key][3, 5] = bad
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] has token ids in {shown}; "
                                         r"accepted: \[0, 65\)"):
        step(state, batch)


def _packed(segments):
    """A packed batch of 16 rows of 8 tokens: row 3 holds `segments`, the others one sequence;
    each token's position counts from its sequence's start."""
    segment_ids = np.ones((16, 8), np.int32)
    segment_ids[3] = segments
    positions = np.tile(np.arange(8, dtype=np.int32), (16, 1))
    starts = np.r_[True, segment_ids[3, 1:] != segment_ids[3, :-1]]
    positions[3] = np.arange(8) - np.maximum.accumulate(np.where(starts, np.arange(8), 0))
    return {"inputs": _tokens(16, 8), "targets": _tokens(16, 8), "positions": positions,
            "segment_ids": segment_ids}


def test_a_segment_id_in_two_runs_of_a_row_is_refused_naming_the_row(step, state):
    """Segments match by equality: ids 1, 2, 1 would let the third run attend to the first as
    one sequence. A packed row holds each sequence in one run, so another is refused."""
    with pytest.raises(ValueError, match=r"batch\['segment_ids'\] row 3 has segment id 1 in 2 "
                                         r"separate runs.*accepted: each id > 0 in one "
                                         r"contiguous run"):
        step(state, _packed([1, 1, 2, 2, 1, 1, 0, 0]))


@pytest.mark.parametrize("segments", [[2, 2, 1, 1, 1, 0, 0, 0], [1, 0, 2, 2, 0, 3, 3, 0]])
def test_contiguous_segments_in_any_order_with_padding_between_pass_the_check(segments):
    from zeroxla.engine.batch_checks import check_batch

    batch = _packed(segments)
    assert check_batch(batch, next_token=True, data_size=8, accumulation=1,
                       vocab_size=lambda: 65) == batch
