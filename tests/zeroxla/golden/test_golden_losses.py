"""Golden loss curves (torchtitan keeps 100-step ones): 30 steps of each dense family template
and GPT-2 under ZeRO-3 on 2 x 4, GPT-2 pipelined with ZeRO-3, under Ulysses sequence
parallelism of degree 2, and an MoE family at expert degree 2, stored in `losses.json` per JAX
minor version.

Two checks per run, both here:
- `test_the_run_equals_its_golden_curve`: the sharded run's 30 losses equal the stored curve
  within 1e-6 relative. A wiring change that moves any step (a mask, a reduction, the order of
  an update) moves the curve, where a one-step parity test can miss what compounds over steps.
- `test_the_golden_curve_is_the_single_device_run`: the stored curve is the run of the same
  model, optimizer and batches, unsharded on one device with plain optax (`reference.py`),
  within 2e-5 relative at every step: the golden file is checked against the independent
  reference, not only against the code that wrote it.

A new JAX minor version, or a change that moves the curves on purpose: regenerate with
`ZEROXLA_REGENERATE_GOLDEN=1 python -m pytest tests/zeroxla/golden`, which writes each curve of
the running JAX after checking it against the single-device run, and review the diff.
"""

import json
import os
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from reference import token_batches, train_single_device
from runs import run_steps

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).with_name("losses.json")
STEPS, BATCH, SEQ, VOCAB = 30, 16, 32, 64
GOLDEN_RTOL, REFERENCE_RTOL = 1e-6, 2e-5
REGENERATE = os.environ.get("ZEROXLA_REGENERATE_GOLDEN") == "1"
VERSION = "jax " + ".".join(jax.__version__.split(".")[:2])

_TINY = dict(vocab_size=VOCAB, d_model=32, num_layers=2, init_std=0.2)
_LLAMA_LIKE = dict(_TINY, num_heads=4, num_kv_heads=2, mlp_dim=64)
MODELS = {      # name -> (model class, its config)
    "gpt2": (models.GPT, models.GPTConfig(**_TINY, num_heads=4, mlp_dim=64)),
    "llama": (models.Llama, models.LlamaConfig(**_LLAMA_LIKE)),
    "qwen2": (models.Llama, models.Qwen2Config(**_LLAMA_LIKE)),
    "qwen3": (models.Llama, models.Qwen3Config(**_LLAMA_LIKE)),
    "mistral": (models.Llama, models.MistralConfig(**_LLAMA_LIKE, sliding_window=9)),
    "gemma2": (models.Gemma2, models.Gemma2Config(**_LLAMA_LIKE, sliding_window=9,
                                                  attn_softcap=20.0)),
    "qwen3-moe": (models.PRESETS["qwen3-moe-tiny"][0], models.PRESETS["qwen3-moe-tiny"][1]()
                  .replace(vocab_size=VOCAB, init_std=0.2, output_router_logits=False)),
}
RUNS = {        # run id -> (model, mesh arguments, ZeroConfig fields, pipeline micro-batches)
    **{f"{name}-zero3-2x4": (name, dict(nodes=2, local=4), {}, None)
       for name in ("gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2")},
    "gpt2-pipeline2-zero3": ("gpt2", dict(nodes=1, stages=2), {}, 4),
    "llama-ulysses2-zero3": ("llama", dict(nodes=2, local=2, sequence=2), {}, None),
    "qwen3-moe-expert2-zero3": ("qwen3-moe", dict(nodes=2, local=2, expert=2), {}, None),
}


def _model(name):
    cls, config = MODELS[name]
    return cls(config, rngs=nnx.Rngs(0))


def _optimizer():
    return optax.sgd(0.3, momentum=0.9)


def _batches():
    return token_batches(STEPS, BATCH, SEQ, VOCAB, seed=1)


def _sharded_losses(run):
    name, mesh_args, fields, micro = RUNS[run]
    pipeline = zeroxla.PipelineConfig(micro, schedule="1f1b") if micro else None
    step = zeroxla.make_step(_model(name), zeroxla.make_mesh(**mesh_args),
                             optimizer=_optimizer(), pipeline=pipeline,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0,
                                                       **fields))
    _, losses = run_steps(step, step.init(), _batches())
    return np.asarray(losses)


def _golden():
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def _stored(run):
    curves = _golden().get(run, {})
    if VERSION not in curves:
        pytest.fail(f"{GOLDEN.name} has no curve of {run!r} for {VERSION} (it has "
                    f"{sorted(curves)}): regenerate as the module docstring says")
    return np.asarray(curves[VERSION])


def _write(run, losses):
    golden = _golden()
    golden.setdefault(run, {})[VERSION] = [float(x) for x in losses]
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("run", sorted(RUNS))
def test_the_golden_curve_is_the_single_device_run(run):
    expected, _ = train_single_device(_model(RUNS[run][0]), _optimizer(), _batches())
    curve = _sharded_losses(run) if REGENERATE else _stored(run)
    np.testing.assert_allclose(curve, expected, rtol=REFERENCE_RTOL)
    assert expected[-1] < 0.8 * expected[0], "the run must learn for the curve to mean much"
    if REGENERATE:
        _write(run, curve)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_the_run_equals_its_golden_curve(run):
    if REGENERATE:
        pytest.skip("regenerating: the curve is the one just written")
    np.testing.assert_allclose(_sharded_losses(run), _stored(run), rtol=GOLDEN_RTOL)
