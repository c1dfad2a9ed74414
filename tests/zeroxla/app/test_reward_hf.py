"""A reward model in and out of Hugging Face: `zeroxla reward --init-from` a
`*ForSequenceClassification`, `zeroxla export` of a reward-model checkpoint, and that export read
back by `zeroxla reward --init-from` and `zeroxla ppo --reward`.

Reference: transformers itself, computing the scores of the same tokens with the
`GPT2ForSequenceClassification` / `LlamaForSequenceClassification` it wrote (a tiny random reward
model saved as TRL saves one: one label, `pad_token_id` = EOS) and with the one we export.
"""

import json
import stat

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import checkpoint
from zeroxla.app import cli
from zeroxla.app.jobs import loading
from zeroxla.app.jobs import reward as reward_job
from zeroxla.app.tokenizers.pretrained import PAD_TOKEN, PretrainedTokenizer, reward_pad_id
from zeroxla.app.jobs.loading import pretrained_config
from zeroxla.app.tiny_checkpoints import eos_id, gpt2_checkpoint, llama_checkpoint
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.app.tokenizers.records import tokenizes_alike
from zeroxla.rlhf import pairwise_loss_terms, without_lm_head

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4                 # float32 scores, ours vs transformers
SEQ_LEN = 64
BUILDERS = {"gpt2": gpt2_checkpoint, "llama": llama_checkpoint}
VOCAB = 512                 # the fixture tokenizer's ids, EOS (511) the last
SHAPE = (4, 24)             # every batch: one compiled forward per model structure


@nnx.jit
def _values(model, tokens):
    return model(tokens)


def values(model, tokens):
    """Our reward model's values float32[B, T] (jitted: an eager forward takes seconds)."""
    return np.asarray(_values(model, jnp.asarray(tokens, jnp.int32)))


def random_tokens(shape, seed):
    """Random ids of the whole vocabulary; the first row ends with EOS, which transformers must
    still score (it is no pad id in our export)."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=shape).astype(np.int32)
    tokens[0, -1] = eos_id()
    return tokens


def their_scores(directory, tokens):
    """transformers' score [B, T] at every position: `score(base(tokens).last_hidden_state)`."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        hidden = model.base_model(torch.as_tensor(tokens, dtype=torch.long)).last_hidden_state
        return model.score(hidden).numpy()[..., 0]


def initial_reward_model(init_from, mesh_shape=(2, 4)):
    """The gathered reward model `zeroxla reward --init-from init_from` starts from, with the
    ZeRO-3 step and state the job builds."""
    tokenizer = PretrainedTokenizer.from_dir(init_from)
    config = pretrained_config(str(init_from), tokenizer, SEQ_LEN, command="zeroxla reward")
    mesh = zeroxla.make_mesh(*mesh_shape)
    step = zeroxla.make_step(loading.reward_model_factory(config), mesh,
                             optimizer=optax.adamw(1e-3), loss_fn=pairwise_loss_terms,
                             config=zeroxla.ZeroConfig(stage=3), trainable=without_lm_head)
    state = step.init_from(reward_job.initial_values(str(init_from), config, mesh,
                                                     progress=False), 0)
    return step, state, config, tokenizer


@pytest.fixture(scope="module", params=["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def reward_run(request, tmp_path_factory):
    """(family, HF reward model dir, the checkpoint `zeroxla reward` would save of it at step 0,
    our plain model, tokenizer)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    hf_dir = BUILDERS[family](tmp / "hf_rm", reward=True)
    step, state, config, tokenizer = initial_reward_model(hf_dir)
    directory = checkpoint.save(tmp / "rm" / "checkpoint", state, layout=step.layout,
                                model_config=config,
                                metadata={"model_kind": loading.REWARD_KIND,
                                          "tokenizer": tokenizer.record()})
    return family, hf_dir, directory, zeroxla.gathered_model(state), tokenizer


def test_reward_init_from_a_reward_model_starts_from_its_head(reward_run):
    _, hf_dir, _, ours, _ = reward_run
    tokens = random_tokens(SHAPE, seed=1)
    theirs = their_scores(hf_dir, tokens)
    assert np.abs(theirs).max() > 0.05                  # a head that is not zero
    np.testing.assert_allclose(values(ours, tokens), theirs, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def exported(reward_run, tmp_path_factory):
    """The reward checkpoint exported by `zeroxla export`, and what it printed."""
    out = tmp_path_factory.mktemp("export") / "rm_hf"
    return out, cli.export_run(reward_run[2], out)


def test_export_is_a_one_label_sequence_classifier_with_a_pad_token(reward_run, tmp_path,
                                                                    capsys):
    family, _, directory, _, _ = reward_run
    out = tmp_path / "rm_hf"
    assert cli.main(["export", str(directory), str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    config = json.loads((out / "config.json").read_text())
    cls = {"gpt2": "GPT2ForSequenceClassification", "llama": "LlamaForSequenceClassification"}
    assert report["model"] == config["architectures"][0] == cls[family]
    assert len(config["id2label"]) == 1
    # The fixture tokenizer uses all 512 ids, EOS included: the pad id is a new, 513th row.
    assert report["pad_token_id"] == config["pad_token_id"] == VOCAB
    assert config["vocab_size"] == VOCAB + 1
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf_tokenizer.pad_token, hf_tokenizer.pad_token_id) == (PAD_TOKEN, VOCAB)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        name: 0o644 for name in report["files"]}


def test_transformers_scores_our_export_at_each_rows_last_token(reward_run, exported):
    """Pooled by transformers' own rule (the last id that is not pad_token_id), the export's
    score equals ours at each row's last token: rows without padding, EOS at the end included,
    and rows the exported tokenizer pads."""
    _, _, _, ours, _ = reward_run
    out, _ = exported
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokens = random_tokens(SHAPE, seed=2)
    with torch.no_grad():
        pooled = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]
    np.testing.assert_allclose(pooled, values(ours, tokens)[:, -1], atol=ATOL, rtol=0)

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    texts = ["ROMEO:\nBut, soft! what light<|endoftext|>",
             "JULIET:\nAy me!<|endoftext|>", "Peace", "Good morrow, cousin.<|endoftext|>"]
    batch = hf_tokenizer(texts, padding="max_length", max_length=SHAPE[1], return_tensors="pt")
    ids, mask = batch.input_ids.numpy(), batch.attention_mask.numpy()       # [4, 24]
    assert (ids == VOCAB).any() and ((ids == VOCAB) == (mask == 0)).all()   # the new pad id
    ends = mask.sum(1) - 1
    assert ids[0, ends[0]] == ids[1, ends[1]] == eos_id()
    with torch.no_grad():
        pooled = model(**batch).logits.numpy()[:, 0]
    # Our values at each row's end; the pad id is beyond our 512 ids, and causal attention
    # keeps what follows an end from changing it, so padding is given as id 0.
    want = values(ours, np.where(mask > 0, ids, 0))[np.arange(len(texts)), ends]
    np.testing.assert_allclose(pooled, want, atol=ATOL, rtol=0)


def test_reward_init_from_our_export_starts_from_its_head(exported):
    out, _ = exported
    _, state, config, tokenizer = initial_reward_model(out)
    assert config.vocab_size == VOCAB + 1 and tokenizer.pad_id == VOCAB
    tokens = random_tokens(SHAPE, seed=3)
    np.testing.assert_allclose(values(zeroxla.gathered_model(state), tokens),
                               their_scores(out, tokens), atol=ATOL, rtol=0)


def test_ppo_reward_accepts_the_run_and_the_export(reward_run, exported):
    """`--reward` as a run or as the export: the same scores, on the actor's vocabulary (the
    export's pad row, which no rollout token reads, is cut); another vocabulary is refused."""
    _, _, directory, ours, tokenizer = reward_run
    out, _ = exported
    actor = ours.base                                  # a causal LM over the same 512 ids
    tokens = random_tokens(SHAPE, seed=4)
    from_run = loading.load_reward(directory.parent, actor, tokenizer)
    from_export = loading.load_reward(out, actor, tokenizer)
    assert from_export.base.config.vocab_size == VOCAB
    np.testing.assert_allclose(values(from_export, tokens), their_scores(out, tokens),
                               atol=ATOL, rtol=0)
    np.testing.assert_array_equal(values(from_run, tokens), values(ours, tokens))
    assert tokenizes_alike(tokenizer, PretrainedTokenizer.from_dir(out))
    with pytest.raises(ValueError, match="tokenizes text differently from --actor's tokenizer"):
        loading.load_reward(out, actor, CharTokenizer("abc"))


def test_reward_pad_id_is_an_id_no_real_token_has(tmp_path):
    gpt2 = PretrainedTokenizer.from_dir(gpt2_checkpoint(tmp_path / "gpt2"))    # no pad token
    assert reward_pad_id(gpt2, 512) == (512, True)     # a new row
    assert reward_pad_id(gpt2, 600) == (512, True)     # a spare row of the model
    assert reward_pad_id(None, 600) == (600, False)    # no tokenizer: a new row
    own = (tmp_path / "gpt2" / "tokenizer_config.json")
    pad = gpt2.tokenizer.id_to_token(300)                        # a token of its own as pad
    own.write_text(json.dumps({**json.loads(own.read_text()), "pad_token": pad}))
    assert reward_pad_id(PretrainedTokenizer.from_dir(tmp_path / "gpt2"), 512) == (
        300, False)
    with pytest.raises(ValueError, match="tokenizer has 512 ids, its model vocab_size=500"):
        reward_pad_id(gpt2, 500)
