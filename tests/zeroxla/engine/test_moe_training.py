"""An MoE model (Qwen3-MoE's family, auxiliary loss weighed) trains under ZeRO exactly as the
same model trained on one device with plain optax, its loss written out here: next-token
cross-entropy plus router_aux_loss_coef x transformers' load-balancing loss over the batch's
tokens (per micro-batch, averaged, with gradient accumulation: the router/aux_loss logged at the
first step is the mean of transformers' per-forward aux losses over the same micro-batches)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import lora, models
from reference import flat_params, token_batches, train_single_device

COEF = 0.05
CONFIG = models.Qwen3MoeConfig(vocab_size=64, max_seq_len=32, d_model=32, num_heads=4,
                               num_kv_heads=2, explicit_head_dim=8, num_layers=2, mlp_dim=48,
                               num_experts=8, experts_per_token=2, expert_mlp_dim=16,
                               router_aux_loss_coef=COEF, output_router_logits=True,
                               expert_tile=4)
BATCHES = token_batches(3, 16, 16, 64, seed=3)
TOL = 1e-6


def model():
    return models.REGISTRY["qwen3_moe"].model_class(CONFIG, rngs=nnx.Rngs(0))


def zero_router_model():
    """`model()` with a zero router: every expert equally probable, so top-2 picks experts 0
    and 1 (ties to the lower index) for every token and the other six get none."""
    m = model()
    m.blocks.layers.moe.router.set_value(jnp.zeros_like(m.blocks.layers.moe.router[...]))
    return m


# LoRA adapters on the attention's wq and on every expert's gate and down projections (one per
# expert), the base frozen.
LORA = lora.LoRAConfig(dim=4, module_name=r"wq|w_gate|w_down", only_optimize_lora=True)


def lora_model():
    """`model()` with `LORA`'s adapters."""
    m = model()
    lora.convert_linear_layer_to_lora(m, LORA, rngs=nnx.Rngs(1))
    return m


def micro_batch(batch, i, k, devices=8):
    """Micro-batch i of k as data parallelism forms it (DeepSpeed's: each of the `devices` data
    ranks' i-th piece of its own rows)."""
    def rows(a):
        per_device = a.reshape(devices, k, -1, *a.shape[1:])            # [N, k, B/(N k), ...]
        return per_device[:, i].reshape(-1, *a.shape[1:])
    return jax.tree.map(rows, batch)


def written_out_loss(micro_batches, devices=8):
    """Cross-entropy over the batch plus COEF x the mean over its `micro_batches` pieces
    (`micro_batch`) of E x sum_e (assignments_e / rows) x (mean probability_e)
    (transformers' load_balancing_loss_func), from the model's router statistics."""
    def loss(m, batch):
        ce, aux = [], []
        for piece in (micro_batch(batch, i, micro_batches, devices)
                      for i in range(micro_batches)):
            logp, stats = m.routed_token_logprobs(piece["inputs"], piece["targets"])
            ce.append(-logp)
            rows = stats.rows
            aux.append(CONFIG.num_experts * jnp.sum(stats.counts / rows * stats.prob_sum / rows))
        return jnp.mean(jnp.concatenate(ce)) + COEF * jnp.mean(jnp.stack(aux))
    return loss


def assert_trains_like(step, batches, want_losses, want, paths=None, check=None):
    """Runs `step` over `batches` from its init: its losses within rtol TOL of the single-device
    run's `want_losses`, its parameters (`paths`, default all of `want`) within atol TOL;
    `check(i, metrics)` sees each step's metrics."""
    state, losses = step.init(), []
    for i, batch in enumerate(batches):
        state, metrics = step(state, batch)
        if check is not None:
            check(i, metrics)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=TOL)
    got = flat_params(nnx.state(step.gathered_model(state), nnx.Param))
    for path in want if paths is None else paths:
        np.testing.assert_allclose(got[path], want[path], rtol=0, atol=TOL, err_msg=path)


# Adam's eps 1e-5, not 1e-8: an entry whose gradient is near zero (a sum of terms that cancel,
# ~1e-9, known only to a few percent in float32 whatever the summation order) moves by
# lr x g / (|g| + eps), which amplifies that round-off up to a lr-sized step (with 1e-8) in one
# run and not the other. The gradients themselves agree to 1e-8
# (`test_moe_gradients_equal_one_device`).
OPTIMIZERS = {"sgd": optax.sgd(0.1), "adamw": optax.adamw(3e-3, eps=1e-5),
              "sgd-lr1": optax.sgd(1.0)}     # lr 1: the update of one step is the gradient


def one_device_run(optimizer, micro_batches, replicas, steps):
    """`train_single_device` of `model()` with `OPTIMIZERS[optimizer]` over the first `steps`
    of BATCHES, the loss `written_out_loss(micro_batches, replicas)`: (losses, parameters).
    (Arguments positional: `one_device` caches by them.)"""
    return train_single_device(model(), OPTIMIZERS[optimizer], BATCHES[:steps],
                               loss_fn=written_out_loss(micro_batches, replicas))


def cached_one_device_runs():
    """`one_device_run`, each distinct reference trained once: the engine paths that share a
    reference (the same optimizer, micro-batches and replicas) compare with one run of it. One
    micro-batch is the whole batch at any replica count (`micro_batch` of 1 reshapes the rows
    back in order), so every `replicas` at `micro_batches` 1 is the same loss and one run."""
    cached = functools.cache(one_device_run)

    def run(optimizer, micro_batches, replicas, steps):
        return cached(optimizer, micro_batches, replicas if micro_batches > 1 else 8, steps)
    return run


@pytest.fixture(scope="module")
def one_device():
    """`cached_one_device_runs`, once per test file."""
    return cached_one_device_runs()


CASES = {"zero3": dict(stage=3), "zero2": dict(stage=2),
         "zero3-hpz": dict(stage=3, hpz_partition_size=4),
         "zero3-accumulation": dict(stage=3, gradient_accumulation_steps=2),
         "zero3-sp2": dict(stage=3, sequence=2), "zero3-remat": dict(stage=3, remat="full"),
         "zero3-offload": dict(stage=3, offload_optimizer="cpu")}
DAILY = {("zero3-accumulation", "sgd")}          # the rest run in the full suite (slow)


@pytest.fixture(scope="module")
def transformers_aux(tmp_path_factory):
    """`aux(batch, k, replicas)`: the mean over the k micro-batches (`micro_batch`) of
    transformers' auxiliary loss of one forward of `model()` (exported) over each, as
    transformers computes it per forward; None without torch and transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from zeroxla.models import hf

    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_hf_model(CONFIG, model(), path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()

    def aux(batch, k, replicas):
        with torch.no_grad():
            return np.mean([float(reference(torch.as_tensor(np.asarray(
                micro_batch(batch, i, k, replicas)["inputs"]), dtype=torch.long),
                output_router_logits=True).aux_loss) for i in range(k)])
    return aux


@pytest.mark.parametrize("name,optimizer", [
    pytest.param(name, opt, id=f"{name}-{opt}",
                 marks=() if (name, opt) in DAILY else pytest.mark.slow)
    for name in CASES for opt in ("sgd", "adamw")])
def test_moe_trains_like_one_device(name, optimizer, transformers_aux, one_device):
    case = dict(CASES[name])
    sequence = case.pop("sequence", 1)
    k = case.get("gradient_accumulation_steps", 1)
    opt = OPTIMIZERS[optimizer]      # adamw's eps: see OPTIMIZERS
    mesh = zeroxla.make_mesh(2, 4 // sequence, sequence=sequence)
    replicas = 8 // sequence
    want_losses, want = one_device(optimizer, k, replicas, len(BATCHES))
    step = zeroxla.make_step(model(), mesh, optimizer=opt, config=zeroxla.ZeroConfig(**case))

    def load_shares(i, metrics):
        assert metrics["router/load"].shape == (CONFIG.num_experts,)
        np.testing.assert_allclose(float(jnp.sum(metrics["router/load"])), 1.0, rtol=1e-6)
        if i == 0 and transformers_aux is not None:   # the rule `ZeroStep.__call__` states
            np.testing.assert_allclose(float(metrics["router/aux_loss"]),
                                       transformers_aux(BATCHES[0], k, replicas), rtol=1e-5)

    assert_trains_like(step, BATCHES, want_losses, want, check=load_shares)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_moe_gradients_equal_one_device(accumulation, one_device):
    """One SGD step of learning rate 1: the update is the gradient."""
    initial = flat_params(nnx.state(model(), nnx.Param))
    sgd = OPTIMIZERS["sgd-lr1"]
    _, want = one_device("sgd-lr1", accumulation, 8, 1)
    step = zeroxla.make_step(model(), zeroxla.make_mesh(2, 4), optimizer=sgd,
                             config=zeroxla.ZeroConfig(
                                 stage=3, gradient_accumulation_steps=accumulation))
    state, _ = step(step.init(), BATCHES[0])
    got = flat_params(nnx.state(step.gathered_model(state), nnx.Param))
    for path in want:
        np.testing.assert_allclose(initial[path] - got[path], initial[path] - want[path],
                                   rtol=0, atol=1e-7, err_msg=path)


@pytest.mark.slow
def test_lora_on_the_experts_trains_like_one_device():
    """Adapters on the attention's wq and on every expert's gate and down projections (one per
    expert), the base frozen: ZeRO-3 equals plain optax on the same adapted model."""
    from reference import masked_optimizer

    trained = {p for p in flat_params(nnx.state(lora_model(), nnx.LoRAParam))}
    assert "blocks/layers/moe/w_gate/lora_a" in trained
    opt = optax.sgd(0.5)
    want_losses, want = train_single_device(lora_model(), masked_optimizer(opt, trained),
                                            BATCHES, loss_fn=written_out_loss(1))
    step = zeroxla.make_step(lora_model(), zeroxla.make_mesh(2, 4), optimizer=opt,
                             trainable=lora.lora_trainable(LORA),
                             config=zeroxla.ZeroConfig(stage=3))
    assert_trains_like(step, BATCHES, want_losses, want, paths=trained)


@pytest.mark.slow
def test_every_token_routed_to_the_same_experts_trains_like_one_device():
    """Adversarial routing: a zero router ties every expert, so every token goes to experts 0
    and 1 (ties to the lower index) and six experts get no token; the same ZeRO-3 program
    runs and equals one device."""
    opt = optax.sgd(0.1)
    want_losses, want = train_single_device(zero_router_model(), opt, BATCHES,
                                            loss_fn=written_out_loss(1))
    step = zeroxla.make_step(zero_router_model(), zeroxla.make_mesh(2, 4), optimizer=opt,
                             config=zeroxla.ZeroConfig(stage=3))

    def two_experts_first(i, metrics):
        if i == 0:
            np.testing.assert_array_equal(np.asarray(metrics["router/load"]),
                                          [0.5, 0.5, 0, 0, 0, 0, 0, 0])

    assert_trains_like(step, BATCHES, want_losses, want, check=two_experts_first)


def test_a_custom_loss_fn_that_would_drop_the_aux_loss_is_refused():
    step = zeroxla.make_step(model(), zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                             loss_fn=lambda m, b: jnp.mean(m(b["inputs"])))
    with pytest.raises(ValueError, match="auxiliary load-balancing loss.*returned no router"):
        step(step.init(), BATCHES[0])


@pytest.mark.slow
def test_routed_token_logprobs_are_the_logits_log_probs_beside_the_router_statistics():
    """`router_aux.routed_token_logprobs(model, tokens, labels)` -> (log-probs, stats), a name
    of its own beside `loss.token_logprobs(logits, labels)`: the log-probs are the whole
    logits' `log_softmax` at the labels, with the MoE model's router statistics, and with None
    for a dense model."""
    from zeroxla.engine import router_aux

    tokens = BATCHES[0]["inputs"][:2]
    labels = BATCHES[0]["targets"][:2]
    for m, routed in ((model(), True), (models.build("gpt-tiny", num_layers=1), False)):
        logp, stats = router_aux.routed_token_logprobs(m, tokens, labels)
        want = np.take_along_axis(np.asarray(jax.nn.log_softmax(
            m(tokens).astype(jnp.float32))), labels[..., None], axis=-1)[..., 0]
        np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-5)
        assert (stats is not None) == routed


@pytest.mark.slow
def test_a_custom_loss_fn_returning_the_statistics_trains_like_one_device():
    """A loss_fn of its own (cross-entropy of the answer half of each row) returning
    `(sum, count, stats)` through `router_aux.routed_token_logprobs`: the step adds the
    auxiliary loss over the tokens the forward saw."""
    from zeroxla.engine import router_aux

    def half_loss(m, batch):
        logp, stats = router_aux.routed_token_logprobs(m, batch["inputs"], batch["targets"])
        return -jnp.sum(logp[:, 8:]), jnp.float32(logp[:, 8:].size), stats

    def reference_loss(m, batch):
        logp, stats = m.routed_token_logprobs(batch["inputs"], batch["targets"])
        aux = CONFIG.num_experts * jnp.sum(stats.counts / stats.rows * stats.prob_sum / stats.rows)
        return -jnp.mean(logp[:, 8:]) + COEF * aux

    opt = optax.sgd(0.1)
    want_losses, want = train_single_device(model(), opt, BATCHES, loss_fn=reference_loss)
    step = zeroxla.make_step(model(), zeroxla.make_mesh(2, 4), optimizer=opt,
                             loss_fn=half_loss, config=zeroxla.ZeroConfig(stage=3))
    assert_trains_like(step, BATCHES, want_losses, want)


def test_without_output_router_logits_no_aux_loss_is_added():
    """transformers' rule: output_router_logits=False adds no auxiliary loss; the router's
    statistics are still logged."""
    config = CONFIG.replace(output_router_logits=False)
    m = models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(0))
    step = zeroxla.make_step(m, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1))
    _, metrics = step(step.init(), BATCHES[0])
    assert metrics["router/load"].shape == (CONFIG.num_experts,)
    logits = m(jnp.asarray(BATCHES[0]["inputs"]))
    logp = jax.nn.log_softmax(logits)
    ce = -jnp.mean(jnp.take_along_axis(logp, BATCHES[0]["targets"][..., None], -1))
    np.testing.assert_allclose(float(metrics["loss"]), float(ce), rtol=1e-6)


def test_the_bf16_moe_step_lowers_for_cuda_with_its_tiles():
    """What a GPU would run (lowered for CUDA on this host, nothing runs): the bf16 ZeRO-3 step
    of the MoE model, its experts through the tiled grouped matmul ("auto" picks it off TPU):
    a while loop over tiles whose body holds the conditional that skips empty tiles, and no
    ragged dot."""
    from zeroxla.compat.lowering import lower_for_cuda

    step = zeroxla.make_step(model(), zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=3, compute_dtype="bfloat16"))
    text = lower_for_cuda(step, step.init(), BATCHES[0]).as_text()
    assert "stablehlo.while" in text and "stablehlo.case" in text
    assert "ragged" not in text


@pytest.mark.slow
def test_a_loss_without_router_statistics_on_an_moe_policy():
    """DPO's loss returns no router statistics: with the auxiliary loss weighed it is refused
    by name; with `output_router_logits=False` (released Qwen3-MoE configs' setting) the
    policy trains, three ZeRO-3 steps equal to plain optax on one device."""
    from zeroxla.rlhf.dpo import losses as dpo

    rng = np.random.default_rng(4)
    batches = []
    for _ in range(3):
        chosen, rejected = (rng.integers(0, 64, (8, 12)).astype(np.int32) for _ in range(2))
        mask = np.zeros((8, 11), np.float32)
        mask[:, 5:] = 1
        batches.append({"chosen": chosen, "rejected": rejected, "chosen_mask": mask,
                        "rejected_mask": mask, "ref_chosen": -np.ones(8, np.float32),
                        "ref_rejected": -np.ones(8, np.float32),
                        "weight": np.ones(8, np.float32)})
    mesh = zeroxla.make_mesh(2, 4)
    step = zeroxla.make_step(model(), mesh, optimizer=optax.sgd(0.5),
                             loss_fn=dpo.make_dpo_loss(0.5))
    with pytest.raises(ValueError, match="returned no router statistics"):
        step(step.init(), batches[0])

    def quiet():
        return models.REGISTRY["qwen3_moe"].model_class(
            CONFIG.replace(output_router_logits=False), rngs=nnx.Rngs(0))

    def written_out(m, batch):
        def sums(tokens, mask):
            logp = jax.nn.log_softmax(m(tokens[:, :-1]), -1)
            return jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0] * mask, -1)
        h = ((sums(batch["chosen"], batch["chosen_mask"]) - batch["ref_chosen"])
             - (sums(batch["rejected"], batch["rejected_mask"]) - batch["ref_rejected"]))
        return jnp.mean(jnp.logaddexp(0.0, -0.5 * h))

    want_losses, want = train_single_device(quiet(), optax.sgd(0.5), batches,
                                            loss_fn=written_out)
    step = zeroxla.make_step(quiet(), mesh, optimizer=optax.sgd(0.5),
                             config=zeroxla.ZeroConfig(stage=3), loss_fn=dpo.make_dpo_loss(0.5))
    assert_trains_like(step, batches, want_losses, want)


@pytest.mark.slow
def test_the_pipeline_refuses_a_weighed_aux_loss_and_trains_an_moe_without_it():
    """Pipeline stages would drop the auxiliary loss: refused by name when it is weighed; with
    `output_router_logits=False` the MoE model trains in a 2-stage 1F1B pipeline, ZeRO-3
    inside, as plain optax on one device does."""
    mesh = zeroxla.make_mesh(2, 2, stages=2)
    with pytest.raises(ValueError, match="pipeline parallelism with .*auxiliary"):
        zeroxla.make_step(model(), mesh, optimizer=optax.sgd(0.1),
                          pipeline=zeroxla.PipelineConfig(4))

    def quiet():
        return models.REGISTRY["qwen3_moe"].model_class(
            CONFIG.replace(output_router_logits=False), rngs=nnx.Rngs(0))

    def cross_entropy(m, batch):
        logp = jax.nn.log_softmax(m(batch["inputs"]), -1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))

    want_losses, want = train_single_device(quiet(), optax.sgd(0.1), BATCHES,
                                            loss_fn=cross_entropy)
    step = zeroxla.make_step(quiet(), mesh, optimizer=optax.sgd(0.1),
                             pipeline=zeroxla.PipelineConfig(4),
                             config=zeroxla.ZeroConfig(stage=3))
    assert_trains_like(step, BATCHES, want_losses, want)


def sequences_as_rows(sequences, per_row, length=16):
    """A batch holding `per_row` of `sequences` in each row of `length` (1: padded, one per
    row; 2: packed in pairs): segment ids 1, 2, .. (0 the padding), positions from 0 in each
    sequence, targets the next tokens, the loss mask 1 where a sequence has a next token."""
    rows = len(sequences) // per_row
    batch = {k: np.zeros((rows, length), np.int32) for k in
             ("inputs", "targets", "positions", "segment_ids")}
    batch["loss_mask"] = np.zeros((rows, length), np.float32)
    for i, tokens in enumerate(sequences):
        row, start = i // per_row, sum(len(s) for s in sequences[i - i % per_row:i])
        at, n = slice(start, start + len(tokens)), len(tokens)
        batch["inputs"][row, at], batch["positions"][row, at] = tokens, np.arange(n)
        batch["segment_ids"][row, at] = i % per_row + 1
        batch["targets"][row, start:start + n - 1] = tokens[1:]
        batch["loss_mask"][row, start:start + n - 1] = 1
    return batch


@pytest.mark.slow
def test_a_packed_moe_step_equals_the_padded_one():
    """16 sequences of 3 to 8 tokens, one per padded row (16 x 16, over half of it padding) or
    packed two per row (8 x 16): the same tokens, so the same loss, auxiliary loss, per-expert
    load and SGD update (learning rate 1: the gradient), whatever the padding; the router
    statistics count only the tokens (segment id > 0), each token's k assignments its own."""
    rng = np.random.default_rng(5)
    sequences = [rng.integers(0, 64, int(n)).astype(np.int32) for n in rng.integers(3, 9, 16)]
    sgd, runs = optax.sgd(1.0), {}
    for name, per_row in (("padded", 1), ("packed", 2)):
        step = zeroxla.make_step(model(), zeroxla.make_mesh(2, 4), optimizer=sgd,
                                 config=zeroxla.ZeroConfig(stage=3))
        state, metrics = step(step.init(), sequences_as_rows(sequences, per_row))
        runs[name] = (metrics, flat_params(nnx.state(step.gathered_model(state), nnx.Param)))
    (padded, want), (packed, got) = runs["padded"], runs["packed"]
    for key in ("loss", "router/aux_loss", "router/load"):
        np.testing.assert_allclose(np.asarray(packed[key]), np.asarray(padded[key]),
                                   rtol=1e-6, atol=1e-7, err_msg=key)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=0, atol=1e-7, err_msg=path)

