"""`routing_replay="auto"`, the default of `GRPOConfig` and `PPOConfig`
(`roles.resolve_routing_replay`): the trainer's config holds "on" for an MoE actor and "off" for
a dense one, and its iteration's record and rollout are those of the explicit mode bit for bit
(timings aside); a Qwen3.5-MoE actor replays its continuous rollout with 0 mismatches; a Gemma 4 actor with its MoE block resolves "auto" to "on" (a dense
one to "off", an explicit "on" refused); where "on" cannot run for an MoE actor (packing=False,
partial_rollout) "auto" is "off" with one warning naming why, and an explicit "on" there is
refused by name. The actors and configs are test_grpo_routing_replay's (a tiny
Qwen3-MoE at expert parallelism 2), test_ppo_routing_replay's and test_grpo's."""

import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from zeroxla.rlhf.roles import resolve_routing_replay
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.sharding.model_def import ModelDef
from job_runs import distinct_chars
from test_grpo import tiny_actor
from test_grpo_moe import EOS, TOKENIZER, actor
from test_grpo_routing_replay import CONFIG, numpy_mismatch, trainer
import test_ppo_routing_replay as ppo_case

TIMINGS = ("_s", "_share", "tokens_per_s")     # wall-clock keys: not part of the result


def same_iteration(run, other):
    """Iteration 0 of two trainers: the records equal but for timings, and the rollouts'
    tokens, masks and routing records equal exactly."""
    (record, rollout), (want, wanted) = run.iteration(0), other.iteration(0)
    keep = sorted(k for k in want if not k.endswith(TIMINGS))
    assert sorted(k for k in record if not k.endswith(TIMINGS)) == keep
    for key in keep:
        np.testing.assert_array_equal(np.asarray(record[key]), np.asarray(want[key]), key)
    np.testing.assert_array_equal(rollout.tokens, wanted.tokens)
    np.testing.assert_array_equal(rollout.action_mask, wanted.action_mask)
    assert (rollout.routing is None) == (wanted.routing is None)
    if wanted.routing is not None:
        np.testing.assert_array_equal(rollout.routing, wanted.routing)
    return record


def test_auto_resolves_on_for_an_moe_actor_and_off_for_a_dense_one():
    """The resolution alone, on the built actors' ModelDefs (no trainer): "auto" is "on" for the
    tiny Qwen3-MoE actor and "off" for the dense tiny actor, with no warning; an explicit mode
    is kept as given where it can run."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe, dense = ModelDef.of(actor())[0], ModelDef.of(tiny_actor())[0]
        assert resolve_routing_replay(CONFIG, moe) == CONFIG.replace(routing_replay="on")
        assert resolve_routing_replay(CONFIG, dense) == CONFIG.replace(routing_replay="off")
        for mode in ("on", "measure", "off"):
            explicit = CONFIG.replace(routing_replay=mode)
            assert resolve_routing_replay(explicit, moe) == explicit


@pytest.mark.slow   # daily: the resolution (above, below) and test_grpo_routing_replay's "on" run
def test_auto_is_on_for_an_moe_actor_with_the_records_of_on():
    """GRPO on the tiny Qwen3-MoE actor at EP 2 with the default config: the trainer's config
    is "on", and its iteration is the explicit "on" run's exactly (the replayed batch, the
    `routing/mismatch` count, the loss, the router statistics)."""
    assert CONFIG.routing_replay == "auto" and GRPOConfig().routing_replay == "auto"
    run = trainer(CONFIG)
    assert run.config.routing_replay == "on"
    record = same_iteration(run, trainer(CONFIG.replace(routing_replay="on")))
    assert record["routing/mismatch"] == 0 and np.isfinite(record["loss"])


def dense_trainer(config):
    return GRPOTrainer(config, tiny_actor(), mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                       prompts=task.split_problems(16, 0)[0], reward_funcs=[distinct_chars],
                       eos_id=EOS, seed=0)


@pytest.mark.slow
def test_auto_is_off_for_a_dense_actor_with_the_records_of_off():
    """A dense GPT actor: "auto" is "off" with no warning, nothing recorded, the record the
    explicit "off" run's exactly."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = dense_trainer(CONFIG)
    assert run.config.routing_replay == "off"
    record = same_iteration(run, dense_trainer(CONFIG.replace(routing_replay="off")))
    assert "routing/mismatch" not in record


@pytest.mark.slow
def test_ppo_auto_is_on_for_an_moe_actor_with_the_records_of_on():
    """PPO on test_ppo_routing_replay's MoE actor (aux loss off): "auto" is "on", the batch
    carries the record, the iteration is the explicit "on" run's exactly."""
    assert ppo_case.CONFIG.routing_replay == "auto"
    run = ppo_case.trainer(ppo_case.CONFIG)
    assert run.config.routing_replay == "on"
    record = same_iteration(run, ppo_case.trainer(ppo_case.CONFIG.replace(routing_replay="on")))
    assert record["routing/mismatch"] == 0


def qwen3_5_moe():
    """tests/models/test_qwen3_5_moe.py's EP_CONFIG actor over the task's tokenizer: one
    period (2 Gated DeltaNet layers and the attention layer), an MoE MLP in each."""
    config = models.Qwen3_5MoeConfig(
        vocab_size=TOKENIZER.vocab_size, max_seq_len=32, d_model=32, num_heads=4,
        num_kv_heads=2, explicit_head_dim=16, num_layers=1, attention_interval=3,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=8, experts_per_token=2, expert_mlp_dim=16,
        shared_expert_mlp_dim=24, router_aux_loss_coef=0.01, output_router_logits=True,
        expert_tile=4, init_std=0.2)
    return models.REGISTRY["qwen3_5_moe"].model_class(config, rngs=nnx.Rngs(3))


def gemma4(num_experts):
    """A tiny Gemma 4 (one period of 3 layers: 2 sliding, 1 global), with its MoE block beside
    the dense MLP when `num_experts` > 0."""
    config = models.Gemma4Config(vocab_size=TOKENIZER.vocab_size, max_seq_len=32,
                                 sliding_window_pattern=3,
                                 num_experts=num_experts, experts_per_token=2,
                                 expert_mlp_dim=24 if num_experts else 0)
    return models.REGISTRY["gemma4"].model_class(config, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_auto_is_on_for_a_gemma4_moe_actor_and_off_for_a_dense_one():
    """A Gemma 4 actor with its MoE block records and replays every HF layer's routing
    (`models.gemma4_moe`): "auto" is "on" with no warning and an explicit "on" is accepted
    (`check_routing`: 3 layers, top 2). Without the block "auto" is "off" with no warning and
    an explicit "on" is refused by name: nothing is routed."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe = ModelDef.of(gemma4(4))[0]
        assert resolve_routing_replay(CONFIG, moe) == CONFIG.replace(routing_replay="on")
        on = CONFIG.replace(routing_replay="on")
        assert resolve_routing_replay(on, moe) == on
        dense = ModelDef.of(gemma4(0))[0]
        assert resolve_routing_replay(CONFIG, dense) == CONFIG.replace(routing_replay="off")
    with pytest.raises(ValueError, match=r"return_routing=True with a Gemma4 of no MoE layers "
                                         r"\(num_experts=0\).*num_experts > 0"):
        resolve_routing_replay(on, dense)


@pytest.mark.slow
def test_auto_replays_a_qwen3_5_moe_rollout_with_no_mismatch():
    """A Qwen3.5-MoE actor (every HF layer routed: `moe_layers` 3) at EP 2, the default config:
    "auto" is "on", the continuous rollout's record [B, T, 3, k] covers every fed token, and
    the logged `routing/mismatch` is the numpy count against the starting actor's full
    forward: 0 (float32)."""
    run = trainer(CONFIG, qwen3_5_moe())
    assert run.config.routing_replay == "on" and run.engine.batching == "continuous"
    record, rollout = run.iteration(0)
    assert rollout.routing.shape[2:] == (3, 2)
    differ, compared = numpy_mismatch(qwen3_5_moe(), rollout.tokens, rollout.routing,
                                      rollout.answer_starts() + rollout.action_mask.sum(1) - 1)
    assert compared > 0 and record["routing/mismatch"] == differ == 0
    assert np.isfinite(record["loss"]) and record["router/aux_loss"] > 0


@pytest.mark.slow
def test_auto_replays_a_gemma4_moe_rollout_with_no_mismatch():
    """A Gemma 4 MoE actor (one period: 2 sliding layers of head dim 16 and a global one of
    32 in one paged cache, every layer routed: `moe_layers` 3) at EP 2, the default config:
    "auto" is "on", the continuous rollout's record [B, T, 3, k] covers every fed token, and
    the logged `routing/mismatch` is the numpy count against the starting actor's full
    forward: 0 (float32). Gemma 4 has no auxiliary loss: no router statistics are logged."""
    run = trainer(CONFIG, gemma4(4))
    assert run.config.routing_replay == "on" and run.engine.batching == "continuous"
    record, rollout = run.iteration(0)
    assert rollout.routing.shape[2:] == (3, 2)
    differ, compared = numpy_mismatch(gemma4(4), rollout.tokens, rollout.routing,
                                      rollout.answer_starts() + rollout.action_mask.sum(1) - 1)
    assert compared > 0 and record["routing/mismatch"] == differ == 0
    assert np.isfinite(record["loss"]) and "router/aux_loss" not in record


@pytest.mark.parametrize("case", ["no_packing", "partial_rollout"])
def test_auto_where_on_cannot_run_is_off_with_a_warning_and_on_is_refused(case):
    """The resolution on the built actor's ModelDef: "auto" is "off" with one warning naming
    the reason, an explicit "on" refused by name (the config's check, `check_routing`)."""
    config, model = CONFIG, actor()
    if case == "no_packing":
        config, reason = config.replace(packing=False), "packing=False"
        refusal = r"GRPOConfig.routing_replay='on' .*packing=True"
    else:
        config = config.replace(rollout_devices=4, max_staleness=1, partial_rollout=2)
        reason = "partial_rollout=2"
        refusal = r"GRPOConfig.partial_rollout=2 .*routing_replay='auto' or 'off'"
    with pytest.warns(UserWarning, match=rf"routing_replay='auto' is 'off' for this MoE "
                                         rf"actor: .*{reason}") as caught:
        resolved = resolve_routing_replay(config, ModelDef.of(model)[0])
    assert len(caught) == 1 and resolved == config.replace(routing_replay="off")
    with pytest.raises(ValueError, match=refusal):
        resolve_routing_replay(config.replace(routing_replay="on"), ModelDef.of(model)[0])

