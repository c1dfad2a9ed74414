"""`zeroxla.load_params`: a checkpoint's model and trained weights without its optimizer.

The reference is the full restore of the same checkpoint (orbax, onto the 2 x 4 mesh, with the
optimizer the job used) gathered into a plain model: the two models' logits must be equal. The
checkpoint of a `zeroxla train` run is `test_export.py`'s `trained_run`.
"""

import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla

def test_load_params_of_a_user_model_checkpoint(tmp_path):
    """A checkpoint without a model config loads into the model passed as `model=`."""
    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1)))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                             loss_fn=lambda m, b: ((m(b["x"]) - 1.0) ** 2).mean(),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state, _ = step(step.init(), {"x": np.ones((8, 4), np.float32)})
    zeroxla.save(tmp_path, state, layout=step.layout)
    with pytest.raises(ValueError, match="records no model config; pass model="):
        zeroxla.load_params(tmp_path)
    loaded = zeroxla.load_params(tmp_path, model=model)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(np.asarray(loaded(x)),
                                  np.asarray(zeroxla.gathered_model(state)(x)))
