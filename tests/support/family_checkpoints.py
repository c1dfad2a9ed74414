"""Tiny random transformers checkpoints for the family tests, written by transformers itself (no
network).

    torch.manual_seed(0); model = AutoModelForCausalLM.from_config(config)
    save_random(model, directory)    # every tensor drawn at random, then save_pretrained
    edit_config(directory, **keys)   # rewrite config.json keys after the save (None deletes)

and the checks every new family makes against transformers (logits and loss under ZeRO-3,
packed rows, export): `assert_*` below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_random(model: Any, directory: str | Path) -> Path:
    """Draws every tensor of the transformers `model` from torch's generator, as the caller
    seeded it (norm weights ~1, every other tensor std 0.1, biases nonzero, so no mapping
    hides), saves it to `directory` and returns the path."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = p.ndim == 1 and "norm" in name
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if norm else 0.0))
    model.save_pretrained(directory)
    return Path(directory)


def edit_config(directory: str | Path, **keys: Any) -> dict[str, Any]:
    """Sets `keys` in `directory`'s config.json (a None value deletes the key), as a hand-edited
    or older config.json would hold them; returns the new contents."""
    path = Path(directory) / "config.json"
    hf = json.loads(path.read_text())
    for key, value in keys.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    path.write_text(json.dumps(hf))
    return hf


# ------------------------------------------------------------------------------------------------
# The checks every new family's test file makes against transformers (tests/models/test_*.py).

def token_ids(vocab: int, shape: tuple[int, ...], seed: int = 0):
    """int32 token ids below `vocab`, drawn from `seed`."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


def torch_causal_lm(directory: str | Path) -> Any:
    """transformers' own model of the checkpoint in `directory`, in evaluation mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


GREEDY_NEW_TOKENS = 12


def greedy_case(checkpoint: Path, vocab: int,
                lengths: tuple[int, ...] = (7, 7)) -> tuple[Any, Any, list, list]:
    """What an engine's greedy check starts from: the checkpoint loaded into ZeRO-3 partitions
    on 2 x 4 (every leaf partitioned; an engine only reads the state), prompts of `lengths`
    tokens (two of 7 unless given) and transformers' greedy `generate` of GREEDY_NEW_TOKENS
    for each: (step, state, prompts, want)."""
    import torch
    import zeroxla

    step, state = zeroxla.load_pretrained(
        checkpoint, zeroxla.make_mesh(nodes=2, local=4), progress=False,
        config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    prompts = [token_ids(vocab, (n,), seed=3 + i) for i, n in enumerate(lengths)]
    reference, want = torch_causal_lm(checkpoint), []
    for prompt in prompts:
        with torch.no_grad():
            want.append(reference.generate(torch.tensor(prompt[None], dtype=torch.long),
                                           max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False,
                                           attention_mask=torch.ones((1, prompt.size)),
                                           pad_token_id=0)[0].numpy())
    return step, state, prompts, want


def assert_engine_greedy_equals_transformers(case: tuple[Any, Any, list, list], batching: str,
                                             tp: int = 1) -> None:
    """The Hybrid Engine (pages of 4 slots, `batching`, inference tp `tp`) built from a
    `greedy_case` decodes exactly transformers' greedy tokens."""
    import numpy as np
    from zeroxla.inference import HybridEngine, HybridEngineConfig

    step, state, prompts, want = case
    engine = HybridEngine(step.layout, HybridEngineConfig(
        inference_tp_size=tp, batching=batching, kv_block_size=4, max_out_tokens=32))
    assert engine.batching == batching
    for out, expected in zip(engine.generate(state, prompts, max_new_tokens=GREEDY_NEW_TOKENS),
                             want):
        np.testing.assert_array_equal(np.asarray(out), expected)


def assert_zero3_logits_and_loss_equal_transformers(checkpoint: Path, family: str,
                                                    num_layers: int, vocab: int, atol: float):
    """The checkpoint loaded into ZeRO-3 partitions on 2 x 4 (every leaf partitioned): its
    gathered model's logits within `atol` of transformers' and its mean next-token loss equal
    to transformers' `labels=` loss (rtol 1e-5), on two rows of 17 tokens."""
    import numpy as np
    import torch

    import zeroxla

    _, state = zeroxla.load_pretrained(checkpoint, zeroxla.make_mesh(nodes=2, local=4),
                                       progress=False,
                                       config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    model = zeroxla.gathered_model(state)
    assert model.config.family == family and model.config.num_layers == num_layers
    x = token_ids(vocab, (2, 17))
    with torch.no_grad():
        out = torch_causal_lm(checkpoint)(torch.tensor(x, dtype=torch.long),
                                          labels=torch.tensor(x, dtype=torch.long))
    theirs = out.logits.numpy()
    assert theirs.std() > 0.3                # not a degenerate near-zero model
    np.testing.assert_allclose(np.asarray(model(x)), theirs, atol=atol, rtol=0)
    ours = -np.mean(np.asarray(model.token_logprobs(x[:, :-1], x[:, 1:])))
    np.testing.assert_allclose(ours, out.loss.item(), rtol=1e-5)


def packed_row(vocab: int, padding: int, seed: int):
    """One row [1, 13 + padding] packing sequences of 7 and 6 tokens, then `padding` slots:
    (tokens, positions, segment_ids, the two sequences)."""
    import numpy as np

    a, b = token_ids(vocab, (7,), seed), token_ids(vocab, (6,), seed + 1)
    row = np.concatenate([a, b, np.zeros(padding, np.int32)])[None]
    positions = np.concatenate([np.arange(7), np.arange(6),
                                np.zeros(padding)]).astype(np.int32)[None]
    segments = np.array([1] * 7 + [2] * 6 + [0] * padding, np.int32)[None]
    return row, positions, segments, (a, b)


def assert_packed_row_equals_its_sequences_alone(model: Any, vocab: int, padding: int,
                                                 seed: int = 3):
    """`model`'s logits of a packed row (`packed_row`) equal each sequence run alone (1e-5);
    returns (the jitted forward, the row, its positions, the second sequence's logits alone)."""
    import jax
    import numpy as np

    row, positions, segments, (a, b) = packed_row(vocab, padding, seed)
    forward = jax.jit(lambda m, *args: m(*args))
    packed = np.asarray(forward(model, row, positions, segments))
    alone_a, alone_b = (np.asarray(forward(model, s[None])) for s in (a, b))
    np.testing.assert_allclose(packed[:, :7], alone_a, atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[:, 7:13], alone_b, atol=1e-5, rtol=0)
    return forward, row, positions, alone_b


def assert_export_reloads_in_transformers(checkpoint: Path, directory: Path, model_type: str,
                                          architecture: str, vocab: int, atol: float):
    """The checkpoint loaded and saved back to `directory`: config.json names `model_type` and
    `architecture`, transformers' model of it gives our logits within `atol`, and the config
    reads back equal."""
    import numpy as np
    import torch

    from zeroxla.models import hf

    config, model = hf.load_hf_model(checkpoint)
    hf.save_hf_model(config, model, directory)
    written = json.loads((Path(directory) / "config.json").read_text())
    assert written["model_type"] == model_type
    assert written["architectures"] == [architecture]
    x = token_ids(vocab, (2, 16), seed=4)
    with torch.no_grad():
        theirs = torch_causal_lm(directory)(torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(model(x)), atol=atol, rtol=0)
    assert hf.from_hf_config(written) == config


def packed_loss(model: Any, batch: dict[str, Any]) -> Any:
    """Mean next-token cross-entropy over the real tokens of packed rows, written out."""
    import jax
    import jax.numpy as jnp

    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])


def float64_model(checkpoint: Path, lora: dict[str, Any] | None = None) -> Any:
    """The checkpoint's model loaded in float64 (the single-device reference of the family
    training tests), with LoRA adapters of `lora` (`LoRAConfig`'s fields, adapters drawn from
    `nnx.Rngs(7)`, only the adapters trained) cast to float64 too: the conversion makes them
    float32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from zeroxla.lora import LoRAConfig, convert_linear_layer_to_lora
    from zeroxla.models import hf

    model = hf.load_hf_model(checkpoint, dtype=jnp.float64)[1]
    if lora:
        convert_linear_layer_to_lora(model, LoRAConfig(**lora, only_optimize_lora=True),
                                     rngs=nnx.Rngs(7))
        adapters = nnx.state(model, nnx.LoRAParam)
        nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.float64), adapters))
    return model


def one_device_run(checkpoint: Path, lora: dict[str, Any] | None, optimizer: Any,
                   batches: list[dict[str, Any]]) -> tuple[Any, Any, set | None]:
    """The family training tests' reference: `float64_model` trained by single-device optax
    (`reference.train_single_device`, `packed_loss`) over `batches`, with LoRA (`lora`) the
    base masked out of `optimizer`: (losses, parameters, the adapters' paths or None)."""
    import jax
    from flax import nnx
    from reference import flat_params, masked_optimizer, train_single_device

    with jax.enable_x64(True):
        model = float64_model(checkpoint, lora)
        trained = set(flat_params(nnx.state(model, nnx.LoRAParam))) if lora else None
        want, expected = train_single_device(
            model, masked_optimizer(optimizer, trained) if lora else optimizer, batches,
            loss_fn=packed_loss)
    return want, expected, trained


def assert_sequence_classifier_scores_as_transformers(config: Any, directory: Path,
                                                      tokens: Any, atol: float) -> None:
    """`*ForSequenceClassification` of `config` (one label), its weights drawn from torch's
    generator (norm weights about 1), saved to `directory` and loaded as our RewardModel: its
    score at every position equals transformers' `score(base(tokens).last_hidden_state)`."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from zeroxla import rlhf

    torch.manual_seed(0)
    theirs = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 and "norm" in name else 0.0))
    theirs.save_pretrained(directory)
    ours = rlhf.load_hf_reward_model(directory)
    with torch.no_grad():
        t = torch.tensor(tokens, dtype=torch.long)
        want = theirs.score(theirs.base_model(t).last_hidden_state).numpy()[..., 0]
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=atol, rtol=0)


def assert_a_changed_record_is_counted_and_replayed(replayed: Any, record: Any, logprobs: Any,
                                                    pairs: list[tuple[int, int, int]],
                                                    experts: int) -> None:
    """A routing record [B, T, L, k] changed at (row, token, layer) `pairs` (every expert
    shifted by 1 mod `experts`, which moves a set of k < experts experts to another set):
    only compared (`replayed(record, False)`, the model's `replayed_token_logprobs` with
    `follow_record`), each changed pair is counted once per token; replayed
    (`replayed(record, True)`), it moves the log-probs away from the live routing's
    `logprobs`."""
    import jax.numpy as jnp
    import numpy as np

    changed = np.zeros(record.shape[:3], bool)                               # [B, T, L]
    for pair in pairs:
        changed[pair] = True
    other = np.where(changed[..., None], (record + 1) % experts, record)
    assert np.all(np.any(np.sort(other, -1) != np.sort(record, -1), -1) == changed)
    _, _, counted = replayed(jnp.asarray(other), False)
    np.testing.assert_array_equal(counted, changed.sum(-1))
    moved, _, _ = replayed(jnp.asarray(other), True)
    assert not np.array_equal(moved, logprobs)


def expert_parallel_partitions(checkpoint: Path) -> tuple[Any, Any]:
    """The checkpoint loaded into ZeRO-3 partitions at EP 2 (2 x 2, expert 2): (step, state),
    what `assert_engine_records_the_routing` builds its engines from. An engine only reads the
    state, so one load serves every engine of a module."""
    import zeroxla

    return zeroxla.load_pretrained(
        checkpoint, zeroxla.make_mesh(2, 2, expert=2), progress=False,
        config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))


def live_router_choices(partitions: tuple[Any, Any]) -> Any:
    """The training forward's `router_choices` of `expert_parallel_partitions`' gathered model,
    jitted once (each output length compiles once per module, not once per engine): tokens
    [B, T] -> ([L, B, T, k], ...)."""
    import jax

    step, state = partitions
    return jax.jit(step.gathered_model(state).router_choices)


def assert_engine_records_the_routing(partitions: tuple[Any, Any], vocab: int, batching: str,
                                      tp: int, layers: int, k: int, choices_of: Any,
                                      live_choices: Any = None) -> None:
    """From ZeRO-3 partitions at EP 2 (`expert_parallel_partitions`) to a Hybrid Engine at `tp`
    with `batching` (pages of 4 slots): sampled answers (temperature 1) of prompts of 3, 7 and
    11 tokens, asking for the routing record changing no token. Each output's record [len,
    `layers`, k] is -1 on the last token (never fed) and holds at every fed token the experts
    `choices_of(tokens [1, T])` -> [T, layers, k] (transformers' router) picks; given
    `live_choices` (`live_router_choices`), the training forward's `router_choices` picks them
    too."""
    import jax.numpy as jnp
    import numpy as np

    import zeroxla
    step, state = partitions
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=tp, batching=batching, kv_block_size=4, max_out_tokens=32))
    assert engine.batching == batching
    prompts = [token_ids(vocab, (n,), seed=n) for n in (3, 7, 11)]
    kw = dict(max_new_tokens=9, temperature=1.0, seed=4)
    outputs, routing = engine.generate(state, prompts, return_routing=True, **kw)
    for got, want in zip(outputs, engine.generate(state, prompts, **kw)):
        np.testing.assert_array_equal(got, want)
    for out, record in zip(outputs, routing):
        assert record.shape == (out.size, layers, k)
        assert np.all(record[-1] == -1)
        want = choices_of(np.asarray(out)[None])[0]                              # [T, L, k]
        np.testing.assert_array_equal(np.sort(record[:-1], -1), want[:-1])
        if live_choices is not None:
            live, _ = live_choices(jnp.asarray(np.asarray(out)[None]))
            np.testing.assert_array_equal(
                np.sort(np.moveaxis(np.asarray(live)[:, 0], 0, 1), -1), want)
