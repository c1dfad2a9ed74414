"""DPO (`zeroxla.rlhf.dpo.losses`) against independent references: the sigmoid and IPO losses and
their gradients in numpy float64 (analytic derivatives), on the log-probs transformers computes
in float64 for a tiny GPT-2; the exact start (policy = reference: log 2, margins 0); the ZeRO-3
step against plain single-device optax on the same loss written out; the answer masks against
the tokens they select."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models, rlhf
from zeroxla.rlhf.dpo import losses as dpo
from reference import flat_params, train_single_device

VOCAB = 65


def np_loss_and_grads(pc, pr, rc, rr, beta, loss_type):
    """float64 loss per pair and its derivatives by (policy_chosen, policy_rejected)."""
    pc, pr, rc, rr = (np.asarray(x, np.float64) for x in (pc, pr, rc, rr))
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        loss = np.logaddexp(0.0, -beta * h)                  # -log sigmoid(beta h)
        dh = -beta / (1.0 + np.exp(beta * h))                # -beta sigmoid(-beta h)
    else:
        loss = (h - 1.0 / (2.0 * beta)) ** 2
        dh = 2.0 * (h - 1.0 / (2.0 * beta))
    return loss, dh, -dh


def mean_loss(pc, pr, rc, rr, beta, loss_type):
    return jnp.mean(dpo.dpo_loss_terms(pc, pr, rc, rr, beta=beta, loss_type=loss_type))


def random_pairs(n, seq_len, seed, vocab=VOCAB):
    """Pair rows of random tokens: prompts of 2..5 tokens, ends anywhere after them; tokens
    after an end are random too (the masks must drop them)."""
    rng = np.random.default_rng(seed)
    arrays = {"chosen": rng.integers(0, vocab, (n, seq_len), dtype=np.int32),
              "rejected": rng.integers(0, vocab, (n, seq_len), dtype=np.int32)}
    prompts = rng.integers(2, 6, n)
    lengths = {"chosen": prompts, "rejected": prompts}
    arrays["chosen_end"] = rng.integers(prompts, seq_len).astype(np.int32)
    arrays["rejected_end"] = rng.integers(prompts, seq_len).astype(np.int32)
    return dpo.pair_batch(arrays, lengths), prompts, arrays


@pytest.mark.parametrize("loss_type", dpo.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_and_gradient_match_float64_numpy(loss_type, beta):
    rng = np.random.default_rng(0)
    pc, pr, rc, rr = (rng.normal(-40, 5, 16).astype(np.float32) for _ in range(4))
    loss, grad_c, grad_r = np_loss_and_grads(pc, pr, rc, rr, beta, loss_type)
    got, (gc, gr) = jax.value_and_grad(mean_loss, argnums=(0, 1))(pc, pr, rc, rr, beta, loss_type)
    np.testing.assert_allclose(got, loss.mean(), rtol=1e-5)
    np.testing.assert_allclose(gc, grad_c / 16, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(gr, grad_r / 16, rtol=1e-5, atol=1e-9)


def test_policy_equal_to_reference_gives_exactly_log2_and_zero_margins():
    sums = jnp.asarray(np.random.default_rng(1).normal(-30, 8, (2, 8)), jnp.float32)
    terms = dpo.dpo_loss_terms(sums[0], sums[1], sums[0], sums[1], beta=0.1)
    assert np.all(np.asarray(terms) == np.float32(np.log(2.0)))
    metrics = dpo.dpo_metrics(sums[0], sums[1], sums[0], sums[1], beta=0.1)
    assert float(metrics["margin"]) == 0.0 and float(metrics["accuracy"]) == 0.0
    # Through the make_step loss_fn: the reference sums are the policy's own.
    model = models.build("gpt-tiny", seed=0)
    batch, _, _ = random_pairs(8, 24, seed=2)
    chosen, rejected = jax.jit(dpo.sequence_logprobs)(model, batch)
    batch = {**batch, "ref_chosen": np.asarray(chosen), "ref_rejected": np.asarray(rejected)}
    total, count = jax.jit(dpo.make_dpo_loss(0.1))(model, batch)
    np.testing.assert_allclose(total / count, np.log(2.0), rtol=1e-6)


def test_masks_select_the_answer_tokens_and_the_sums_match_numpy():
    model = models.build("gpt-tiny", seed=0)
    batch, prompts, arrays = random_pairs(4, 20, seed=3)
    logits = np.asarray(model(jnp.asarray(batch["chosen"][:, :-1])), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                           keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = [sum(logp[b, t - 1, batch["chosen"][b, t]]
                    for t in range(prompts[b], arrays["chosen_end"][b] + 1)) for b in range(4)]
    chosen, _ = dpo.sequence_logprobs(model, batch)
    np.testing.assert_allclose(chosen, expected, rtol=1e-5)


@pytest.mark.slow
def test_on_transformers_logprobs(tmp_path):
    """Loss and gradient by the log-prob sums of our GPT-2 (a tiny random transformers
    checkpoint, loaded by `models.hf`) equal float64 numpy on the log-probs transformers
    computes in float64 for the same pairs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroxla.app.tiny_checkpoints import gpt2_checkpoint
    from models import hf as hf_io

    path = gpt2_checkpoint(tmp_path / "gpt2")
    _, ours = hf_io.load_hf_model(path)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(path).to(torch.float64).eval()
    vocab = ours.config.vocab_size
    batch, _, _ = random_pairs(4, 24, seed=4, vocab=vocab)
    reference, _, _ = random_pairs(4, 24, seed=5, vocab=vocab)   # other pairs' sums stand in

    def hf_sums(tokens, mask):
        with torch.no_grad():
            logits = theirs(torch.tensor(tokens[:, :-1], dtype=torch.long)).logits
        logp = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None])[..., 0].numpy()
        return (logp * mask).sum(-1)

    pc = hf_sums(batch["chosen"], batch["chosen_mask"])
    pr = hf_sums(batch["rejected"], batch["rejected_mask"])
    rc = hf_sums(reference["chosen"], reference["chosen_mask"])
    rr = hf_sums(reference["rejected"], reference["rejected_mask"])
    our_c, our_r = jax.jit(dpo.sequence_logprobs)(ours, batch)
    np.testing.assert_allclose(np.stack([our_c, our_r]), np.stack([pc, pr]), rtol=1e-5)
    for loss_type in dpo.LOSS_TYPES:
        loss, grad_c, grad_r = np_loss_and_grads(pc, pr, rc, rr, 0.1, loss_type)
        got, (gc, gr) = jax.value_and_grad(mean_loss, argnums=(0, 1))(
            our_c, our_r, rc.astype(np.float32), rr.astype(np.float32), 0.1, loss_type)
        np.testing.assert_allclose(got, loss.mean(), rtol=1e-5)
        np.testing.assert_allclose(gc, grad_c / 4, rtol=1e-5)
        np.testing.assert_allclose(gr, grad_r / 4, rtol=1e-5)


@pytest.mark.slow
def test_zero3_steps_match_single_device_optax(devices):
    """Three ZeRO-3 DPO steps on a 2x4 mesh against plain optax on one device with the loss
    written out (per-token log-probs, masked sums, -log sigmoid). SGD, not Adam: Adam would
    blow the rounding noise of gradients that are exactly 0 in exact arithmetic (the key
    bias: softmax ignores it) up to full-size updates."""
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    batches = []
    for seed in range(3):
        batch, _, _ = random_pairs(8, 16, seed=10 + seed)
        ref, _, _ = random_pairs(8, 16, seed=20 + seed)
        batch["ref_chosen"] = -np.abs(ref["chosen"][:, :8].sum(-1)).astype(np.float32) / 10
        batch["ref_rejected"] = -np.abs(ref["rejected"][:, :8].sum(-1)).astype(np.float32) / 10
        batches.append(batch)

    def written_out(model, batch):
        def sums(tokens, mask):
            logp = jax.nn.log_softmax(model(tokens[:, :-1]), -1)
            return jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0] * mask, -1)
        h = ((sums(batch["chosen"], batch["chosen_mask"]) - batch["ref_chosen"])
             - (sums(batch["rejected"], batch["rejected_mask"]) - batch["ref_rejected"]))
        return jnp.mean(jnp.logaddexp(0.0, -0.5 * h))

    expected_losses, expected = train_single_device(models.build("gpt-tiny", seed=0),
                                                    optax.sgd(0.5), batches,
                                                    loss_fn=written_out)
    step = zeroxla.make_step(models.build("gpt-tiny", seed=0), mesh, optimizer=optax.sgd(0.5),
                             config=zeroxla.ZeroConfig(stage=3),
                             loss_fn=dpo.make_dpo_loss(0.5))
    state, losses = step.init(0), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    got = flat_params(nnx.state(zeroxla.gathered_model(state), nnx.Param))
    for path, value in expected.items():
        np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("field, value", [("beta", 0.0), ("beta", -1), ("loss_type", "hinge"),
                                          ("learning_rate", float("inf")), ("batch_size", 1),
                                          ("reference_int8", 1)])
def test_config_refuses_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=rf"DPOConfig\.{field}="):
        dpo.DPOConfig(**{field: value})


@pytest.mark.parametrize("int8", [False, True])
def test_reference_sums_of_the_trainers_reference(int8):
    """The DPO trainer's reference sums (the policy's first partitions on a 4-replica mesh, read
    in its layout; float or int8 codes), against the plain model's sums on one device: equal
    in float; from codes, equal (to float32 summation, as in float) to the sums of the model
    whose weights are each device shard's int8 round trip in float64 numpy
    (test_reference_int8.int8_weights64: each weight moved by at most half its group's step,
    the device's code at a near tie), and not equal to the float model's."""
    from test_reference_int8 import int8_weights64
    from zeroxla.rlhf.answer_forward import reference_partitions
    from zeroxla.rlhf.dpo.trainer import DPOTrainer

    model = models.build("gpt-tiny", seed=0)
    batch, _, _ = random_pairs(6, 16, seed=6)
    config = dpo.DPOConfig(batch_size=4, seq_len=16, reference_int8=int8)
    trainer = DPOTrainer(config, model, mesh=zeroxla.make_mesh(1, 4, devices=jax.devices()[:4]),
                         train=batch, val=batch)
    got = trainer.train
    chosen, rejected = jax.jit(dpo.sequence_logprobs)(model, batch)
    expected = np.stack([chosen, rejected])
    if int8:
        codes = reference_partitions(trainer.step, trainer.state, int8=True, owner="DPOConfig")
        weights, _ = int8_weights64(trainer.state, codes)
        rounded = nnx.clone(model)
        for path, var in nnx.to_flat_state(nnx.state(rounded, nnx.Param)):
            var.set_value(jnp.asarray(weights[path], jnp.float32))
        rounded = np.stack(jax.jit(dpo.sequence_logprobs)(rounded, batch))
        np.testing.assert_allclose(np.stack([got["ref_chosen"], got["ref_rejected"]]), rounded,
                                   rtol=1e-5)
        np.testing.assert_allclose(np.stack([got["ref_chosen"], got["ref_rejected"]]), expected,
                                   rtol=2e-2)
        assert not np.allclose(got["ref_chosen"], chosen, rtol=1e-6)
    else:
        np.testing.assert_allclose(np.stack([got["ref_chosen"], got["ref_rejected"]]), expected,
                                   rtol=1e-5)


def test_a_policy_that_is_not_a_causal_lm_is_refused_by_name():
    from zeroxla.rlhf.dpo.trainer import check_policy

    check_policy(models.build("gpt-tiny", seed=0), 16)               # logits [B, T, V]: fine
    with pytest.raises(TypeError, match=r"policy=RewardModel\(tokens int32\[2, 15\]\) returned "
                                        r"ShapeDtypeStruct \(2, 15\); accepted: logits"):
        check_policy(rlhf.RewardModel(models.build("gpt-tiny", seed=0)), 16)
