"""Qwen3.5 (`models.qwen3_5`, `models.qwen3_5_moe`) trained under ZeRO-3 with sequence
parallelism, expert parallelism and LoRA, against the unsharded model on one device, from tiny
random checkpoints transformers writes here (3 layers: one period of two Gated DeltaNet layers
and one gated attention layer; the MoE variant with 8 experts, top-2, a gated shared expert):

- SP = 2 (Ulysses) on 2 x 4 on packed rows: the DeltaNet layers' all-to-alls give each device
  whole rows of half the heads, the attention layer takes Ulysses as every family does; 3 steps
  equal the float64 single-device run (slow, dense and the MoE variant with EP = 2 too; the
  daily check of the DeltaNet layer under Ulysses is one layer against the unsplit layer,
  tests/models/test_gated_delta.py);
- LoRA adapters on every projection (the attention's wq, wk, wv, wg, wo, the DeltaNet layers'
  wq, wk, wv, wz, wb, wa, wo, the MLPs, the experts and the shared expert) on 2 x 4: 3 steps
  equal the float64 single-device run with the same adapters (slow, dense and MoE);
- ring, all-gather and USP are refused by name for the DeltaNet layers, and so is a sequence
  size that does not divide their key and value heads (slow).

Tolerances as the other families hold them (tests/models/test_gpt_oss.py): losses rtol 1e-5,
every leaf rtol 1e-4 + atol 1e-6, in float64 at lr 0.002 (tests/models/test_qwen3_5.py says
why: this tiny random model amplifies a perturbation about 50-fold per step at lr 0.01).
"""

import functools

import jax
import numpy as np
import optax
import pytest

import zeroxla
import family_checkpoints
from family_checkpoints import packed_row, save_random
from zeroxla.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 67
# A period of 3 (transformers' default is 4): shorter to compile, still several DeltaNet layers.
DENSE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
             layer_types=["linear_attention", "linear_attention", "full_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=64, rms_norm_eps=1e-5, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=4, bos_token_id=None, eos_token_id=None, pad_token_id=None,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                              "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                              "mrope_interleaved": True})
MOE = {**{k: v for k, v in DENSE.items() if k != "intermediate_size"},
       "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
       "shared_expert_intermediate_size": 40}


def _checkpoint(variant, directory):
    """A `Qwen3_5ForCausalLM` ("dense") or `Qwen3_5MoeForCausalLM` ("moe") checkpoint in
    `directory`, every tensor perturbed."""
    torch.manual_seed(0)
    config = (transformers.Qwen3_5TextConfig(**DENSE) if variant == "dense"
              else transformers.Qwen3_5MoeTextConfig(**MOE))
    return save_random(transformers.AutoModelForCausalLM.from_config(config), directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The checkpoint of each variant, written once when a test first asks for it."""
    return functools.cache(lambda variant: _checkpoint(
        variant, tmp_path_factory.mktemp(f"qwen3_5_{variant}")))


def _packed_batch():
    """8 packed rows [8, 16] with their positions, segment ids and a float64 loss mask."""
    rows = [packed_row(VOCAB, 4, seed) for seed in range(0, 16, 2)]
    seq = np.concatenate([r[0] for r in rows])
    seg = np.concatenate([r[2] for r in rows])
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:],
            "positions": np.concatenate([r[1] for r in rows])[:, :-1],
            "segment_ids": seg[:, :-1],
            # a token's target is the next token of its own sequence
            "loss_mask": ((seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0)).astype(np.float64)}


TRAINING_OPTIMIZER = optax.sgd(0.002, momentum=0.9)
# every projection of every layer kind; the router and the shared expert's [D] gate are not
# projections to adapt (the router's adapter would move the routing PEFT leaves alone)
LORA = dict(dim=4, alpha=8.0, module_name=r"blocks/.*/(wq|wk|wv|wg|wz|wb|wa|wo|w_gate|w_up|"
                                          r"w_down|shared_gate|shared_up|shared_down)$")
# name -> (variant, mesh (nodes, local, expert, sequence), LoRA adapters)
TRAINING = {"dense-zero3-sp2-ulysses-packed": ("dense", (2, 2, 1, 2), False),
            "dense-zero3-2x4-lora": ("dense", (2, 4, 1, 1), True),
            "moe-zero3-sp2-ep2-packed": ("moe", (2, 1, 2, 2), False),
            "moe-zero3-2x4-lora": ("moe", (2, 4, 1, 1), True)}


def _one_device_run(checkpoint, lora):
    """`family_checkpoints.one_device_run` over 3 x `_packed_batch()`."""
    return family_checkpoints.one_device_run(checkpoint, LORA if lora else None,
                                             TRAINING_OPTIMIZER, [_packed_batch()] * 3)


@pytest.mark.slow           # daily: tests/models/test_gated_delta.py's Ulysses layer test
@pytest.mark.parametrize("name", sorted(TRAINING))
def test_zero3_trains_packed_rows_like_the_unsharded_model(checkpoints, name):
    """3 steps of SGD with momentum on packed rows, every leaf partitioned (with SP = 2 each
    row's 16 tokens split over the sequence axis, 8 per device, the DeltaNet layers' 2 key and
    4 value heads and the attention's 4 heads split by Ulysses; with EP = 2 the experts split
    over the expert axis; with LoRA the adapters of `LORA` trained, the base frozen), against
    single-device optax on the same float64 model (`reference.train_single_device`; with LoRA
    the base masked out of its optimizer): losses rtol 1e-5, every leaf rtol 1e-4 + atol 1e-6.
    The checkpoint's output_router_logits is false: no auxiliary loss, as transformers trains
    it."""
    from reference import flat_params
    from runs import run_steps
    from zeroxla.lora import LoRAConfig, lora_trainable

    variant, (nodes, local, expert, sequence), lora = TRAINING[name]
    checkpoint = checkpoints(variant)
    want, expected, trained = _one_device_run(checkpoint, lora)
    with jax.enable_x64(True):
        step = zeroxla.make_step(
            family_checkpoints.float64_model(checkpoint, LORA if lora else None),
            zeroxla.make_mesh(nodes, local, expert=expert, sequence=sequence),
            optimizer=TRAINING_OPTIMIZER,
            config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0, compute_dtype="float64",
                                      sequence_parallel_strategy="ulysses"),
            trainable=lora_trainable(LoRAConfig(**LORA, only_optimize_lora=True))
            if lora else None)
        state, losses = run_steps(step, step.init(), [_packed_batch()] * 3)
        got = flat_params(zeroxla.gather_params(state))
    assert want[2] < want[1] < want[0]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    if lora:
        assert trained == {leaf.path for leaf in step.layout.plan.trainable_leaves}
        for weight in ("linear/0/mixer/wz", "linear/0/mixer/wb", "linear/0/mixer/wo",
                       "full/mixer/wg", "moe/w_up" if variant == "moe" else "w_up"):
            assert any(f"/{weight}/lora_a" in path for path in trained), weight
    for path in expected:
        assert got[path].dtype == np.float64, path
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "allgather", "usp"])
def test_sequence_strategies_other_than_ulysses_are_refused_by_name(checkpoints, strategy):
    """The DeltaNet recurrence scans whole sequences and no chunk state passes between sequence
    devices: the step is refused at its first trace, naming the strategy and Ulysses."""
    step = zeroxla.make_step(hf.load_hf_model(checkpoints("dense"))[1],
                             zeroxla.make_mesh(2, 2, sequence=2), optimizer=TRAINING_OPTIMIZER,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0,
                                                       sequence_parallel_strategy=strategy))
    batch = {k: v.astype(np.float32) if k == "loss_mask" else v
             for k, v in _packed_batch().items()}
    with pytest.raises(ValueError, match=f"sequence_parallel_strategy='{strategy}' is not "
                                         "built for Gated DeltaNet.*accepted: 'ulysses'"):
        step(step.init(), batch)


@pytest.mark.slow
def test_a_sequence_size_not_dividing_the_deltanet_heads_is_refused_by_name():
    """Ulysses splits the DeltaNet layers' key and value heads over the sequence devices: a
    size dividing neither (2 key heads, 4 value heads, SP 4 and 3) is refused naming the head
    count and the accepted sizes."""
    from zeroxla.models.gated_deltanet import check_sequence_parallel
    from zeroxla.models.sequence_parallel import SequenceParallel

    check_sequence_parallel(SequenceParallel("sequence", 2), 2, 4)
    with pytest.raises(ValueError, match=r"size 4 .*linear_num_key_heads=2.*accepted sizes: "
                                         r"\[1, 2\]"):
        check_sequence_parallel(SequenceParallel("sequence", 4), 2, 4)
    with pytest.raises(ValueError, match=r"size 3 .*linear_num_key_heads=2"):
        check_sequence_parallel(SequenceParallel("sequence", 3), 2, 4)
