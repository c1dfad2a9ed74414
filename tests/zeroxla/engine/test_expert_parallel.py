"""Expert parallelism (`make_mesh(expert=EP)`): an MoE model's experts split over the expert
axis and ZeRO-partitioned over the rest trains exactly as the same model trained on one device
with plain optax (its loss written out in test_moe_training: cross-entropy plus the weighed
load-balancing loss), at EP = 2, 4, 8, every ZeRO stage, with sequence parallelism, gradient
accumulation and LoRA on the experts; routing that sends every token to one expert or one
device's experts gives the float64 dense reference; the compiled program runs no collective
under a routing-dependent branch; checkpoints move between expert degrees bit for bit; what is
not built is refused by name."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zeroxla
from zeroxla import checkpoint, models
from zeroxla.analysis.hlo import branch_collectives, collectives, parse_module
from zeroxla.models.expert_parallel import ExpertParallel, expert_parallel_ffn
from reference import flat_params, train_single_device
from test_moe_training import (BATCHES, CONFIG, LORA, OPTIMIZERS, TOL, assert_trains_like,
                               cached_one_device_runs, lora_model, model, written_out_loss,
                               zero_router_model)

SGD, ADAMW = OPTIMIZERS["sgd"], OPTIMIZERS["adamw"]   # adamw's eps: see test_moe_training


@pytest.fixture(scope="module")
def one_device():
    """test_moe_training's `cached_one_device_runs`, once per test file: the expert degrees and
    ZeRO paths that share a reference compare with one run of it."""
    return cached_one_device_runs()


def ep_mesh(ep, sequence=1, nodes=None):
    """8 devices with an expert axis of `ep`: 2 nodes where the rest allows, else 1."""
    rest = 8 // (ep * sequence)
    nodes = nodes if nodes is not None else (2 if rest % 2 == 0 else 1)
    return zeroxla.make_mesh(nodes, rest // nodes, expert=ep, sequence=sequence)


def ep_step(mesh, opt, **config):
    return zeroxla.make_step(model(), mesh, optimizer=opt, config=zeroxla.ZeroConfig(
        **{"stage": 3, "persistence_threshold": 0, **config}))


def built_ep_step(ep, sequence, optimizer, **config):
    """`ep_step` on `ep_mesh(ep, sequence)` with `OPTIMIZERS[optimizer]` (arguments hashable:
    `ep_steps` caches by them)."""
    return ep_step(ep_mesh(ep, sequence), OPTIMIZERS[optimizer], **config)


@pytest.fixture(scope="module")
def ep_steps():
    """`built_ep_step`, each program built (and so compiled) once per test file: the cases that
    train, inspect, compile or restore into the same step share it; each runs from its own
    `init`."""
    return functools.cache(built_ep_step)


CASES = {  # name: (EP, sequence, ZeroConfig fields)
    "ep2-zero3": (2, 1, {}), "ep4-zero3": (4, 1, {}), "ep8-zero3": (8, 1, {}),
    "ep2-zero2": (2, 1, {"stage": 2}), "ep2-zero1": (2, 1, {"stage": 1}),
    "ep2-zero0": (2, 1, {"stage": 0}), "ep2-sp2": (2, 2, {}),
    "ep2-accumulation": (2, 1, {"gradient_accumulation_steps": 2}),
    "ep4-remat": (4, 1, {"remat": "full"}),
    "ep2-hpz": (2, 1, {"hpz_partition_size": 2}),      # hpZ on the dense leaves: exact
    "ep2-offload-optimizer": (2, 1, {"offload_optimizer": "cpu"}),
    "ep4-offload-param": (4, 1, {"offload_param": "cpu"}),
}
DAILY = {("ep2-zero3", "sgd")}   # the rest: slow


@pytest.mark.parametrize("name,optimizer", [
    pytest.param(name, opt, id=f"{name}-{opt}",
                 marks=() if (name, opt) in DAILY else pytest.mark.slow)
    for name in CASES for opt in ("sgd", "adamw")])
def test_expert_parallel_trains_like_one_device(name, optimizer, one_device, ep_steps):
    ep, sequence, config = CASES[name]
    k = config.get("gradient_accumulation_steps", 1)
    want_losses, want = one_device(optimizer, k, 8 // sequence, len(BATCHES))
    step = ep_steps(ep, sequence, optimizer, **config)
    assert_trains_like(step, BATCHES, want_losses, want)


def test_expert_leaves_are_split_over_the_expert_axis_and_partitioned_over_the_rest(ep_steps):
    step = ep_steps(4, 1, "sgd")
    plan = step.layout.plan
    w_gate = plan["blocks/layers/moe/w_gate"]                # [L, E, D, F] = [2, 8, 32, 16]
    assert w_gate.expert_dim == 1 and w_gate.expert_size == 4
    assert w_gate.data_axes == ("node", "local") and w_gate.data_size == 2
    assert w_gate.param_spec == P(None, "expert", ("node", "local"), None)
    assert w_gate.shard_shape == (2, 16, 16)               # E/EP experts, D over 2 devices
    router = plan["blocks/layers/moe/router"]               # every device routes over all E
    assert router.expert_dim is None and router.data_size == 8
    assert plan["blocks/layers/wq"].data_axes == ("node", "local", "expert")
    rows = dict((path, reduce) for path, _, _, reduce in step.describe_collectives())
    assert rows["blocks/layers/moe/w_gate"] == "reduce-scatter float32 over node+local"
    assert rows["blocks/layers/wq"] == "reduce-scatter float32 over node+local+expert"


@pytest.mark.slow
def test_expert_gradients_are_reduced_over_the_expert_data_group_only(ep_steps):
    """In the compiled step at EP = 4 (2 x 1 x 4), the expert weights' gradients ([E/EP, D, F]
    = [2, 32, 16] float32 per layer, 4,096 bytes) are reduce-scattered over groups of 2 devices
    (node x local: those holding the same experts), the dense leaves' over all 8, and the MoE
    layers' token exchange runs over the 4 devices of the expert axis."""
    step = ep_steps(4, 1, "sgd")
    found = collectives(step.compile(step.init(), BATCHES[0]))
    grads = [c for c in found if c.kind == "reduce-scatter" and "zero_grad_reduce" in c.op_name]
    by_group = {size: {c.operand_bytes for c in grads if c.group_size == size}
                for size in {c.group_size for c in grads}}
    assert set(by_group) == {2, 8} and by_group[2] == {2 * 32 * 16 * 4}
    exchange = [c for c in found if "zero_" not in c.op_name and c.kind != "all-reduce"]
    assert exchange and {c.group_size for c in exchange} == {4}


@pytest.mark.slow   # daily: the ZeRO-3 expert-parallel steps above
def test_stage1_expert_parallel_gradients_equal_one_device(one_device):
    """ZeRO-1 at EP = 2 (2 x 2 x 2): the gradients (one SGD step of learning rate 1: the update
    is the gradient) of every leaf, expert leaves all-reduced over their expert-data group and
    dense ones over all 8 devices, equal the single-device gradient of the written-out loss.
    (Every other daily expert-parallel case is stage 3, whose expert gradients are
    reduce-scattered in backward instead.)"""
    sgd = OPTIMIZERS["sgd-lr1"]
    initial = flat_params(nnx.state(model(), nnx.Param))
    _, want = one_device("sgd-lr1", 1, 8, 1)
    step = ep_step(ep_mesh(2), sgd, stage=1)
    state, _ = step(step.init(), BATCHES[0])
    got = flat_params(nnx.state(step.gathered_model(state), nnx.Param))
    for path in want:
        np.testing.assert_allclose(initial[path] - got[path], initial[path] - want[path],
                                   rtol=0, atol=1e-7, err_msg=path)


@pytest.mark.slow
def test_hpz_and_qgz_with_expert_parallelism(one_device):
    """hpZ + qgZ at EP = 2: the expert leaves take the plain collectives over their
    expert-data group, so after one SGD step of learning rate 1 they equal one device's (their
    gradients need no other leaf's, and qgZ quantizes only the dense leaves' reduction); the
    dense leaves land as near the float32 reference as the same hpZ + qgZ run without an
    expert axis does (int4 gradients are not exact: within that run's own noise)."""
    sgd = OPTIMIZERS["sgd-lr1"]
    initial = flat_params(nnx.state(model(), nnx.Param))
    _, want = one_device("sgd-lr1", 1, 8, 1)
    config = dict(hpz_partition_size=2, quantized_gradients=True,
                  gradient_quantization_group_size=64)
    runs = {}
    for name, mesh in (("ep", ep_mesh(2)), ("no ep", zeroxla.make_mesh(2, 4))):
        step = ep_step(mesh, sgd, **config)
        state, _ = step(step.init(), BATCHES[0])
        runs[name] = flat_params(nnx.state(step.gathered_model(state), nnx.Param))
        if name == "ep":
            rows = {path: row for path, *row in step.describe_collectives()}
            assert rows["blocks/layers/moe/w_up"][2] == "reduce-scatter float32 over node+local"
            assert rows["blocks/layers/wq"][2] == "qgZ int4 two-hop all-to-all"
    experts = [p for p in want if "/moe/w_" in p]
    for path in experts:
        np.testing.assert_allclose(runs["ep"][path], want[path], rtol=0, atol=TOL, err_msg=path)
    dense = [p for p in want if p not in experts]

    def error(got):
        travelled = np.sqrt(sum(np.sum((want[p] - initial[p]) ** 2) for p in dense))
        return np.sqrt(sum(np.sum((got[p] - want[p]) ** 2) for p in dense)) / travelled
    assert 0 < error(runs["ep"]) < 1.25 * error(runs["no ep"])


def _dense_reference(x, experts, weights, wg, wu, wd):
    """float64 numpy: out[n] = sum_j weights[n, j] x SwiGLU expert experts[n, j] of x[n]."""
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[n, j]
            gate = x[n] @ wg[e]
            out[n] += weights[n, j] * ((gate / (1 + np.exp(-gate)) * (x[n] @ wu[e])) @ wd[e])
    return out


ROUTINGS = {
    "one expert": lambda n, k, e: np.zeros((n, k), np.int32),
    "one device's experts": lambda n, k, e: np.tile(np.arange(k, dtype=np.int32), (n, 1)),
    "last expert only": lambda n, k, e: np.full((n, k), e - 1, np.int32),
    "random": lambda n, k, e: np.stack([np.random.default_rng(n).permutation(e)[:k]
                                        for _ in range(n)]).astype(np.int32),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_adversarial_routing_equals_dense_reference_with_routing_free_collectives(routing):
    """EP = 4 over 8 devices (2 x 4), 8 experts: every token to expert 0 (all other experts and
    three devices get no token), to one device's two experts, to the last expert, at random.
    The output equals the float64 dense sum; the compiled program is one SPMD program whose
    collectives sit under no data-dependent branch, and it is the same program for every
    routing (the routing is data), so no device can wait on a collective another skips."""
    n, k, e, d, f = 16, 2, 8, 8, 4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * n, d)).astype(np.float32)
    experts = ROUTINGS[routing](8 * n, k, e)
    weights = rng.random((8 * n, k)).astype(np.float32)
    wg, wu = (0.3 * rng.standard_normal((e, d, f)).astype(np.float32) for _ in range(2))
    wd = 0.3 * rng.standard_normal((e, f, d)).astype(np.float32)
    mesh = zeroxla.make_mesh(2, 1, expert=4)
    ep = ExpertParallel("expert", 4)
    tokens, experts_spec = P(("node", "local", "expert")), P("expert")

    def layer(x, experts, weights, wg, wu, wd):
        return expert_parallel_ffn(x, experts, weights, wg, wu, wd, ep, tile=4,
                                   implementation="tiled")
    run = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(tokens, tokens, tokens,
                                                             experts_spec, experts_spec,
                                                             experts_spec),
                                out_specs=tokens, check_vma=False))
    args = (x, experts, weights, wg, wu, wd)
    np.testing.assert_allclose(run(*args), _dense_reference(*args), rtol=1e-6, atol=1e-6)
    text = run.lower(*args).compile().as_text()
    module = parse_module(text)
    assert any(i.opcode == "conditional" for c in module.computations.values()
               for i in c.instructions)                     # the skipped tiles' branches
    assert branch_collectives(module) == ()
    assert {c.kind for c in collectives(text)} == {"all-gather", "reduce-scatter"}


@pytest.mark.slow
def test_zero_router_sends_every_token_to_one_devices_experts_and_trains_like_one_device():
    """A zero router gives every expert the same probability, so top-2 picks experts 0 and 1
    (the lower index) for every token: at EP = 4, device 0's experts, the other devices' six
    experts idle. One SGD step of learning rate 1 (the update is the gradient) equals one
    device's."""
    sgd = optax.sgd(1.0)
    _, want = train_single_device(zero_router_model(), sgd, BATCHES[:1],
                                  loss_fn=written_out_loss(1, 8))
    step = zeroxla.make_step(zero_router_model(), ep_mesh(4), optimizer=sgd,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state, metrics = step(step.init(), BATCHES[0])
    np.testing.assert_allclose(np.asarray(metrics["router/load"])[:2], [0.5, 0.5], rtol=1e-6)
    assert np.all(np.asarray(metrics["router/load"])[2:] == 0)
    got = flat_params(nnx.state(step.gathered_model(state), nnx.Param))
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=0, atol=TOL, err_msg=path)


@pytest.mark.slow
def test_lora_on_experts_under_expert_parallelism_trains_like_one_device():
    """Adapters on wq and on every expert's gate and down projections (one per expert, split
    over the expert axis with its expert), the base frozen, at EP = 2: as plain optax."""
    from reference import masked_optimizer
    from zeroxla import lora

    trained = {p for p in flat_params(nnx.state(lora_model(), nnx.LoRAParam))}
    opt = optax.sgd(0.5)
    want_losses, want = train_single_device(lora_model(), masked_optimizer(opt, trained),
                                            BATCHES, loss_fn=written_out_loss(1))
    step = zeroxla.make_step(lora_model(), ep_mesh(2), optimizer=opt,
                             trainable=lora.lora_trainable(LORA),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    assert step.layout.plan["blocks/layers/moe/w_gate/lora_a"].expert_split
    assert_trains_like(step, BATCHES, want_losses, want, paths=trained)


@pytest.mark.slow
def test_checkpoint_saved_at_ep2_restores_at_ep4_and_ep1_bit_exactly(tmp_path, ep_steps):
    step = ep_steps(2, 1, "adamw")
    state = step.init()
    for batch in BATCHES[:2]:
        state, _ = step(state, batch)
    checkpoint.save(tmp_path, state, layout=step.layout)
    saved = jax.tree.map(np.asarray, step.layout.logical.to_logical(state))
    _, metrics = step(state, BATCHES[2])
    for ep in (4, 1):
        target = ep_steps(ep, 1, "adamw") if ep > 1 else ep_step(zeroxla.make_mesh(2, 4), ADAMW)
        restored = checkpoint.restore(tmp_path, target).state
        logical = jax.tree.map(np.asarray, target.layout.logical.to_logical(restored))
        same = jax.tree.map(np.array_equal, logical, saved)
        assert all(jax.tree.leaves(same)), ep
        _, again = target(restored, BATCHES[2])
        np.testing.assert_allclose(float(again["loss"]), float(metrics["loss"]), rtol=TOL)


def test_expert_degree_that_does_not_divide_the_experts_is_refused():
    """6 experts on an expert axis of 4 (8 devices, 2 nodes): the degrees offered divide the
    experts and are ones `make_mesh` builds with the same nodes (3 and 6 divide the experts
    but not the devices: offering them sends the user to a second refusal)."""
    six = models.Qwen3MoeConfig(**{**CONFIG.__dict__, "num_experts": 6})
    with pytest.raises(ValueError, match=r"6 experts.*'expert' axis of 4.*\[1, 2\]") as refused:
        zeroxla.make_step(models.REGISTRY["qwen3_moe"].model_class(six, rngs=nnx.Rngs(0)),
                          ep_mesh(4), optimizer=SGD, config=zeroxla.ZeroConfig(stage=3))
    offered = eval(str(refused.value).rsplit("one of ", 1)[1].split("]")[0] + "]")
    for degree in (1, 2, 3, 6):                          # the divisors of the 6 experts
        if degree in offered:
            zeroxla.make_mesh(2, expert=degree)
        else:
            with pytest.raises(ValueError, match="make_mesh"):
                zeroxla.make_mesh(2, expert=degree)


@pytest.mark.parametrize("field,value", [("quantized_nontrainable_weights", True)])
def test_features_not_built_with_expert_parallelism_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"ZeroConfig.{field}=.*'expert' axis of 2"):
        ep_step(ep_mesh(2), SGD, **{field: value})
    with pytest.raises(ValueError, match=r"the mesh's 'stage' axis=2 with the mesh's 'expert' "
                                         r"axis of 2: not built"):
        zeroxla.make_step(model(), zeroxla.make_mesh(1, 2, stages=2, expert=2), optimizer=SGD,
                          pipeline=zeroxla.PipelineConfig(micro_batches=2))


class UserMoe(nnx.Module):
    """A user's own MoE layer: a Param whose dim is named 'experts', no `expert_parallel`."""

    def __init__(self):
        self.embed = nnx.Embed(64, 8, rngs=nnx.Rngs(0))
        self.experts = nnx.Param(jnp.ones((4, 8, 8)), logical_axes=("experts", None, None))

    def __call__(self, tokens):
        h = self.embed(tokens)
        return self.embed.attend(jnp.einsum("btd,edf->btf", h, self.experts[...]) / 4)


def test_a_user_expert_layer_without_expert_parallel_is_refused_by_path():
    with pytest.raises(ValueError, match=r"'experts'.*no module above it declares "
                                         r"`expert_parallel`"):
        zeroxla.make_step(UserMoe(), ep_mesh(2), optimizer=SGD)
    zeroxla.make_step(UserMoe(), zeroxla.make_mesh(2, 4), optimizer=SGD)   # no expert axis: fine


def test_an_moe_layer_holding_a_slice_of_its_experts_is_refused_a_call_without_experts():
    """Expert parallelism reaches the MoE layer as its call's `experts=` argument, nothing set
    on the module: a layer holding E / EP experts of its router's E (a device's share under
    an expert axis) called without it, or with a degree that does not match, is refused by
    name (traced only: nothing compiles) instead of computing with a slice of its experts as
    if it were all of them."""
    from zeroxla.models.moe import MoeMLP

    def call(h, experts=None):
        layer = MoeMLP(CONFIG, rngs=nnx.Rngs(0))
        for name in ("w_gate", "w_up", "w_down"):         # [E, ., .] -> this device's E / 2
            getattr(layer, name).set_value(getattr(layer, name)[...][:4])
        return layer(h, experts=experts)
    h = jax.ShapeDtypeStruct((2, 3, CONFIG.d_model), jnp.float32)
    with pytest.raises(ValueError, match=r"MoeMLP holds 4 of the 8 experts .* "
                                         r"experts=None: 4 x 1 != 8\. Accepted: .*"
                                         r"experts=ExpertParallel\(axis, EP\)"):
        jax.eval_shape(call, h)
    with pytest.raises(ValueError, match=r"4 x 4 != 8"):
        jax.eval_shape(lambda x: call(x, ExpertParallel("expert", 4)), h)


def test_a_loss_fn_or_token_forward_that_cannot_pass_experts_on_is_refused_by_name():
    """Under a mesh that splits the model's experts, the step passes `experts=` to a loss_fn
    and to a `TokenForward` fn, as it passes `sequence=`: one that does not declare it is
    refused by name when built; a dense model on the same mesh (nothing split) is not."""
    from zeroxla.engine.token_forward import TokenForward

    def values(m, batch):
        return m(batch["inputs"])

    def mean_loss(m, batch):
        return jnp.mean(values(m, batch))
    with pytest.raises(ValueError, match=r"splits the experts of 'blocks/layers/moe/w_\w+'.*"
                                         r"loss_fn mean_loss takes no `experts` argument"):
        zeroxla.make_step(model, ep_mesh(2), optimizer=SGD, loss_fn=mean_loss)
    step = zeroxla.make_step(model, ep_mesh(2), optimizer=SGD)      # a factory: nothing runs
    with pytest.raises(ValueError, match=r"TokenForward: .* experts over 2 devices, but fn "
                                         r"values takes no `experts` argument"):
        TokenForward(step, values)
    def dense():
        return models.build("gpt-tiny", seed=0)
    assert zeroxla.make_step(dense, ep_mesh(2), optimizer=SGD,
                             loss_fn=mean_loss).layout.experts is None


def _gather_groups(text):
    """{(group, operand type, result type)} of the StableHLO text's all-gathers, each group as
    the mesh axes it spans: jax 0.12 names them; jax 0.10 prints device ids, read here for the
    2 x 1 x 4 mesh (devices 0-3 and 4-7: "expert"; {i, i + 4}: "node", "local")."""
    import re

    by_ids = {"[[0, 1, 2, 3], [4, 5, 6, 7]]": ("expert",),
              "[[0, 4], [1, 5], [2, 6], [3, 7]]": ("node", "local"),
              "[[0, 1, 2, 3, 4, 5, 6, 7]]": ("node", "local", "expert")}
    found = set()
    for groups, operand, result in re.findall(
            r'"stablehlo.all_gather".*?replica_groups = (.*?), use_global_device_ids\}> : '
            r'\(tensor<(.*?)>\) -> tensor<(.*?)>', text):
        names = tuple(re.findall(r'name = "(\w+)"', groups))
        found.add((names or by_ids[groups.removeprefix("dense<").split(">")[0]], operand,
                   result))
    return found


@pytest.mark.slow
def test_the_bf16_expert_parallel_step_lowers_for_cuda():
    """What a GPU would run (lowered for CUDA on this host): at EP = 4 on 2 x 1 x 4 the tokens
    [N, D] travel in bf16 over the expert groups (devices 0-3, 4-7: consecutive, as
    DeepSpeed's expert-parallel ranks) and each layer's expert weights are gathered in bf16
    over the expert-data groups (devices {i, i + 4})."""
    from zeroxla.compat.lowering import lower_for_cuda

    step = ep_step(ep_mesh(4), SGD, compute_dtype="bfloat16")
    gathers = _gather_groups(lower_for_cuda(step, step.init(), BATCHES[0]).as_text())
    assert (("expert",), "1x32x32xbf16", "4x32x32xbf16") in gathers       # the tokens
    experts = {(g[1], g[2]) for g in gathers if g[0] == ("node", "local")}
    assert experts == {("2x16x16xbf16", "2x32x16xbf16"), ("2x8x32xbf16", "2x16x32xbf16")}
    _, metrics = step(step.init(), BATCHES[0])
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
def test_a_reward_model_on_an_moe_base_under_expert_parallelism_trains_like_one_device():
    """DeepSpeed-Chat's step 2 on an MoE base (auxiliary loss off: the pairwise loss returns
    no router statistics): three SGD steps at EP = 2 equal the same pairwise loss applied with
    plain optax on one device."""
    from zeroxla import rlhf
    from zeroxla.rlhf.reward_model import pairwise_loss_terms

    config = CONFIG.replace(output_router_logits=False)

    def scorer():
        base = models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(0))
        return rlhf.RewardModel(base)

    rng = np.random.default_rng(5)
    batches = [{"chosen": rng.integers(0, 64, (8, 12)).astype(np.int32),
                "rejected": rng.integers(0, 64, (8, 12)).astype(np.int32),
                "chosen_end": rng.integers(4, 12, 8).astype(np.int32),
                "rejected_end": rng.integers(4, 12, 8).astype(np.int32)} for _ in range(3)]

    def mean_loss(m, batch):
        total, count = pairwise_loss_terms(m, batch)
        return total / count
    want_losses, want = train_single_device(scorer(), SGD, batches, loss_fn=mean_loss)
    step = zeroxla.make_step(scorer(), ep_mesh(2), optimizer=SGD, loss_fn=pairwise_loss_terms,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    assert step.layout.plan["base/blocks/layers/moe/w_up"].expert_split
    assert_trains_like(step, batches, want_losses, want)
