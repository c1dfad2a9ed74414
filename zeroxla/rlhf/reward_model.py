"""The reward model of DeepSpeed-Chat's step 2 (`dschat/utils/model/reward_model.py`,
`RewardModel(base_model)`): a transformer's final hidden states through a scalar head, one value
per position, and the pairwise ranking loss that trains it on (chosen, rejected) answers.

    tokens int32[B, T] --base.hidden--> [B, T, D] --v_head [D]--> values float32[B, T]
    values, ends int32[B]  --end_scores--> [B]       (the value at each row's last real token)

DeepSpeed-Chat uses the same class for the critic of step 3 (`create_critic_model` builds a
`RewardModel` and loads the step-2 weights into it), so `zeroxla.rlhf.Critic` is this class.

The head is zero-initialised, so every score starts at exactly 0: a fresh critic predicts
values of 0, and a fresh reward model is indifferent between the answers of a pair (loss log 2).
DeepSpeed-Chat's `v_head` is a bias-free `Linear(D, 1)` with the default random init; a zero
start changes nothing the pairwise loss can see (it depends on score differences only) and
makes a fresh critic's first values exact.

The base is held whole, language-model head included, so `hidden` is the base's own method and
its parameter paths stay those of the LM it came from (an SFT actor goes in unchanged). GPT's
head is tied to the token embedding, so it has no parameter of its own; Llama's untied output
projection is never read: it gets a zero gradient, which `make_step` accepts like any other
(under Adam it stays bit-for-bit where it was; AdamW's decoupled weight decay shrinks it, which
no output sees). To spend no optimizer state on it, pass `trainable=without_lm_head` to
`make_step`: the projection is then frozen (partitioned, but no gradient and no Adam moments).

In Hugging Face terms a RewardModel is a `*ForSequenceClassification` with `num_labels=1`
(`GPT2ForSequenceClassification`, `LlamaForSequenceClassification`), which TRL, OpenRLHF and
verl load as a reward model: its `score` is a bias-free `Linear(D, 1)`, so `score.weight` [1, D]
is `v_head`, and the base's tensors keep their names (`models.hf` maps the layout; `zeroxla
export` writes it, `load_hf_reward_model` reads it). transformers' own forward reads the score at
each row's last token that is not `pad_token_id`; ours is read at an index (`end_scores`), the
mask's last real token, as OpenRLHF and verl do: the same position whenever no real token of a
row equals the pad id.

The loss (`pairwise_loss_terms`) is InstructGPT's (Ouyang et al. 2022, eq. 1) on the end
scores: `-log sigmoid(r_chosen - r_rejected)` per pair. DeepSpeed-Chat's own `forward` averages
that over every position from the pairs' first differing token to the later end instead; its
evaluation (`evaluation_reward` in step 2's `main.py`) compares the end scores, as
`pair_metrics` does.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zeroxla.models import axes
from zeroxla.models import hf as hf_io
from zeroxla.rlhf.packed_pairs import pair_sums, refuse_padded_pairs

PairBatch = dict[str, jax.Array]   # chosen, rejected int32[B, T]; chosen_end, rejected_end int32[B]
PAIR_KEYS = ("chosen", "rejected", "chosen_end", "rejected_end")


def _missing(base: Any) -> list[str]:
    missing = [] if callable(getattr(base, "hidden", None)) else ["hidden(tokens)"]
    if not isinstance(getattr(getattr(base, "config", None), "d_model", None), int):
        missing.append("config.d_model")
    return missing


def without_lm_head(path: tuple, variable: Any) -> bool:
    """An nnx filter for `make_step(trainable=...)`: every parameter but the base's LM output
    projection (`base/head/weight`, Llama's untied head), which a reward model never reads."""
    del variable
    return tuple(path[-3:]) != ("base", "head", "weight")


def reward_trainable(only_optimize_lora: bool = False) -> Any:
    """`make_step`'s trainable filter of a reward model (`zeroxla reward`): `without_lm_head`;
    with `only_optimize_lora`, the LoRA adapters and the score head `v_head` alone (a fresh zero
    head has to learn: with it frozen, no gradient would reach the adapters)."""
    if only_optimize_lora:
        return nnx.Any(nnx.LoRAParam, nnx.PathContains(hf_io.REWARD_SCORE))
    return without_lm_head


def end_scores(values: jax.Array, ends: jax.Array) -> jax.Array:
    """`values[b, ends[b]]`: float[B] from values [B, T] and ends int32[B], the index of each
    row's last real (non-pad) token (DeepSpeed-Chat's `chosen_end_scores`, `value[c_ind - 1]`).
    Under a causal base, whatever follows `ends[b]` cannot change it."""
    ends = jnp.asarray(ends, jnp.int32)
    return jnp.take_along_axis(values, ends[:, None], axis=1)[:, 0]


class RewardModel(nnx.Module):
    """`reward_model(tokens int32[B, T]) -> values float32[B, T]`: `base.hidden(tokens)` [B, T, D]
    dotted with the zero-initialised head `v_head` [D] (see the module docstring).

    `base` is any module with `hidden(tokens) -> [B, T, D]` and `config.d_model` (D):
    `models.GPT` or `models.Llama`."""

    def __init__(self, base: nnx.Module):
        missing = _missing(base)
        if missing:
            raise TypeError(f"RewardModel(base): base={type(base).__name__} lacks "
                            f"{' and '.join(missing)}; accepted: a module with hidden(tokens) "
                            "-> [B, T, D] and config.d_model, such as models.GPT or models.Llama")
        self.base = base
        d = base.config.d_model
        self.v_head = nnx.Param(jnp.zeros((d,), jnp.float32), logical_axes=(axes.EMBED,))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, sequence: Any = None,
                 experts: Any = None) -> jax.Array:
        """Values [B, T]; a packed batch gives each token's `positions` and `segment_ids`
        (int [B, T]), passed to `base.hidden` (refused by name if it takes none). `sequence`
        (a `SequenceParallel`): the tokens are this device's slice of each sequence, and
        `base.hidden` computes attention over the whole sequences. `experts` (an
        `ExpertParallel`): an MoE base's experts split over that axis, passed to `base.hidden`."""
        options = {k: v for k, v in (("positions", positions), ("segment_ids", segment_ids),
                                     ("sequence", sequence), ("experts", experts))
                   if v is not None}
        x = self.base.hidden(tokens, **options)                           # [B, T, D]
        # float32 whatever the base computes in: a score is a sum over D products.
        return jnp.einsum("BTD,D->BT", x.astype(jnp.float32),
                          self.v_head[...].astype(jnp.float32))           # [B, T]

    end_scores = staticmethod(end_scores)


def load_hf_reward_model(path: str | os.PathLike) -> RewardModel:
    """The plain RewardModel of a HF `*ForSequenceClassification` checkpoint with one label
    (`config.json` + safetensors, single or sharded): its base model, and `score.weight` [1, D]
    as `v_head`. Llama's LM projection, which such a checkpoint does not hold and a reward model
    never reads, is zeros. Any other architecture is refused by name, before any tensor is
    read."""
    hf = hf_io.read_hf_config(path)
    try:
        hf_io.check_head(hf, (hf_io.SEQUENCE_CLASSIFICATION,), user="a reward model",
                         instead="a causal LM has no score head: train one with `zeroxla reward "
                                 "--init-from`")
        config = hf_io.from_hf_config(hf)
    except ValueError as err:
        raise ValueError(f"{Path(path)}: {err}") from None
    with hf_io.open_safetensors(path) as get_tensor:
        params = hf_io.from_hf_tensors(config, hf_io.NameFallbacks(get_tensor, hf),
                                       head=hf_io.SEQUENCE_CLASSIFICATION)
    prefix = f"{hf_io.REWARD_BASE}/"
    base = hf_io.model_from_params(config, {p.removeprefix(prefix): v for p, v in params.items()
                                            if p.startswith(prefix)})
    model = RewardModel(base)
    model.v_head[...] = jnp.asarray(params[hf_io.REWARD_SCORE], jnp.float32)
    return model


def with_vocab_size(model: RewardModel, vocab_size: int) -> RewardModel:
    """A copy of `model` for token ids below `vocab_size` (<= its own): its base's rows beyond
    them (e.g. the pad token `zeroxla export` adds) dropped along every dim named
    `axes.VOCAB`. Every value of a sequence of such ids is unchanged."""
    config = model.base.config
    if not 0 < vocab_size <= config.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is invalid for a reward model of "
                         f"{config.vocab_size} ids; accepted: 1..{config.vocab_size}")
    params = {}
    for path, var in nnx.to_flat_state(nnx.state(model.base, nnx.Param)):
        names = var.get_metadata().get("logical_axes") or ()
        params["/".join(map(str, path))] = var.get_value()[tuple(
            slice(0, vocab_size) if name == axes.VOCAB else slice(None) for name in names)]
    cut = RewardModel(hf_io.model_from_params(config.replace(vocab_size=vocab_size), params))
    cut.v_head[...] = model.v_head[...]
    return cut


def pair_scores(model: RewardModel, batch: PairBatch,
                experts: Any = None) -> tuple[jax.Array, jax.Array]:
    """The end scores (chosen float32[B], rejected float32[B]) of a pair batch, from one forward
    over both halves stacked ([2B, T]); chosen and rejected must have the same T. `experts`:
    the step's `ExpertParallel`, for an MoE base."""
    chosen, rejected = batch["chosen"], batch["rejected"]                 # [B, T] each
    if chosen.shape != rejected.shape:
        raise ValueError(f"pair batch: chosen{tuple(chosen.shape)} and rejected"
                         f"{tuple(rejected.shape)} differ; accepted: both [B, T] (pad to one T)")
    b = chosen.shape[0]
    values = model(jnp.concatenate([chosen, rejected]), experts=experts)  # [2B, T]
    ends = jnp.concatenate([batch["chosen_end"], batch["rejected_end"]])  # [2B]
    scores = end_scores(values, ends)
    return scores[:b], scores[b:]


def pairwise_loss_terms(model: RewardModel, batch: PairBatch, *, sequence: Any = None,
                        experts: Any = None) -> tuple[jax.Array, jax.Array]:
    """The `make_step` loss_fn of step 2: `(sum over pairs of -log sigmoid(r_chosen -
    r_rejected), number of pairs)`, so the step's loss is the exact mean over the global batch.

    `batch`: {"chosen", "rejected": int32[B, T], "chosen_end", "rejected_end": int32[B]} (the
    index of each answer's last real token). `log_sigmoid` keeps it finite for any margin.
    Packed pairs run under sequence parallelism too (the step passes `sequence`); an MoE
    base's experts split over an expert axis get `experts` (the step passes it)."""
    if "segment_ids" in batch:
        return packed_pairwise_loss_terms(model, batch, sequence, experts)
    refuse_padded_pairs(sequence, "--packing (RewardJobConfig.packing=True)")
    r_chosen, r_rejected = pair_scores(model, batch, experts)
    losses = -jax.nn.log_sigmoid(r_chosen - r_rejected)                  # [B]
    return jnp.sum(losses), jnp.float32(losses.shape[0])


def packed_pairwise_loss_terms(model: RewardModel, batch: PairBatch, sequence: Any = None,
                               experts: Any = None) -> tuple[jax.Array, jax.Array]:
    """`pairwise_loss_terms` of packed pairs (`zeroxla.rlhf.packed_pairs.pack_scored_pairs`):
    each sequence's end score is its value on the slot its "chosen_end" / "rejected_end" marks,
    summed per pair number ("pair") of this replica's rows (`packed_pairs.pair_sums`, over the
    sequence devices too under `sequence`); pair numbers past its pairs have no end marked and
    count for nothing."""
    values = model(batch["inputs"], positions=batch["positions"],
                   segment_ids=batch["segment_ids"], sequence=sequence,
                   experts=experts)                                       # [R, S]
    present, chosen, rejected = pair_sums(
        batch["pair"], batch["chosen_end"], values * batch["chosen_end"],
        values * batch["rejected_end"], sequence=sequence)                # [N] each
    return jnp.sum(-jax.nn.log_sigmoid(chosen - rejected) * present), jnp.sum(present)


@functools.partial(jax.jit, static_argnums=0)
def _pair_metrics(graphdef: Any, params: Any, batch: PairBatch) -> dict[str, jax.Array]:
    r_chosen, r_rejected = pair_scores(nnx.merge(graphdef, params), batch)
    return dict(accuracy=jnp.mean((r_chosen > r_rejected).astype(jnp.float32)),
                margin=jnp.mean(r_chosen - r_rejected),
                chosen_score=jnp.mean(r_chosen), rejected_score=jnp.mean(r_rejected))


def pair_metrics(model: RewardModel, batch: PairBatch) -> dict[str, float]:
    """Validation of a plain (gathered) reward model on a pair batch, as step 2's
    `evaluation_reward`: `accuracy` (share of pairs with r_chosen > r_rejected), `margin` (mean
    r_chosen - r_rejected), `chosen_score` and `rejected_score` (their means). One jitted
    program per model structure and batch shape."""
    missing = [k for k in PAIR_KEYS if k not in batch]
    if missing:
        raise KeyError(f"pair batch lacks {missing}; accepted keys: {list(PAIR_KEYS)}")
    graphdef, params = nnx.split(model)
    metrics = _pair_metrics(graphdef, params, {k: jnp.asarray(batch[k]) for k in PAIR_KEYS})
    return {k: float(v) for k, v in metrics.items()}


def check_scoring_model(field: str, model: Any, actor: nnx.Module, seq_len: int) -> None:
    """A reward model or critic start must be a `RewardModel` reading the actor's tokens (same
    vocabulary) over a whole rollout row (`seq_len` = P + G positions)."""
    if not isinstance(model, RewardModel):
        raise TypeError(f"{field}={type(model).__name__}; accepted: a zeroxla.rlhf.RewardModel "
                        "(plain, e.g. zeroxla.gathered_model of its training state)")
    config, actor_config = model.base.config, getattr(actor, "config", None)
    vocab, actor_vocab = (getattr(c, "vocab_size", None) for c in (config, actor_config))
    if None not in (vocab, actor_vocab) and vocab != actor_vocab:
        raise ValueError(f"{field} has vocab_size={vocab} but the actor {actor_vocab}; accepted: "
                         "a reward model over the actor's tokenizer")
    max_len = getattr(config, "max_seq_len", None)
    if max_len is not None and max_len < seq_len:
        raise ValueError(f"{field} has max_seq_len={max_len} < prompt_length + answer_length = "
                         f"{seq_len}; accepted: a base that reads whole rollout rows")
