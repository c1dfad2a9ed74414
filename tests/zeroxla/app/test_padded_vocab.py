"""A padded vocabulary through every job: a GPT-2 of 1024 embedding rows whose tokenizer has 300
ids (Qwen2.5's case: 151,936 rows for 151,665 tokens) runs SFT on `messages` data with its
end-of-run sample, `zeroxla generate` greedy and at temperature 1, a reward model on
conversational pairs, and two PPO iterations. Every id the Hybrid Engine emits is recorded (a
wrapper around `HybridEngine.generate`) and must be below 300; the padded rows, drawn as the
others, would be picked often were they not masked (checked: the trained model sampled without
the limit draws them).
The exported actor keeps its 1024 rows, exactly as they were trained.
"""

import json

import jax
import numpy as np
import pytest

import zeroxla
from chat_checkpoints import TOKENIZER_SIZE, padded_gpt2_checkpoint
from flax import nnx
from zeroxla.app import chat_data
from zeroxla.app.jobs import ppo as ppo_job
from zeroxla.app.jobs import reward as reward_job
from zeroxla.app.run import runner
from zeroxla.app.run.job import RunSettings
from zeroxla.app.jobs.generate import generate_from_checkpoint
from zeroxla.app.sampling import local_zero3_step
from zeroxla.app.jobs.train import job as train_job
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.inference import HybridEngineConfig
from zeroxla.inference.engine import HybridEngine
from zeroxla.rlhf import PPOConfig
from job_runs import quiet

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
VOCAB = 1024


def conversations(n, seed):
    return [{"messages": [{"role": "user", "content": e.prompt},
                          {"role": "assistant", "content": e.response}]}
            for e in chat_data.shakespeare_sft(n, seed=seed)]


def chat_pairs(n, seed):
    return [{"prompt": [{"role": "user", "content": p.prompt}],
             "chosen": [{"role": "assistant", "content": p.chosen}],
             "rejected": [{"role": "assistant", "content": p.rejected}]}
            for p in chat_data.shakespeare_pairs(n, seed=seed)]


def write_rows(rows, path):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def emitted(monkeypatch):
    """Every row `HybridEngine.generate` returns, with its prompt length: [(ids, prompt)]."""
    rows = []
    generate = HybridEngine.generate

    def recording(self, state, prompts, *args, **kwargs):
        out = generate(self, state, prompts, *args, **kwargs)
        rows_out = out[0] if kwargs.get("return_logprobs") else out   # (outputs, logprobs)
        rows.extend((row, len(prompt)) for row, prompt in zip(rows_out, prompts))
        return out

    monkeypatch.setattr(HybridEngine, "generate", recording)
    return rows


def new_ids(rows):
    return np.concatenate([row[prompt:] for row, prompt in rows])


def test_padded_vocabulary_sft_generate_and_ppo_emit_only_tokenizer_ids(tmp_path, emitted):
    hf = padded_gpt2_checkpoint(tmp_path / "hf", vocab_size=VOCAB)
    sft = write_rows(conversations(64, seed=0), tmp_path / "sft.jsonl")
    pairs = write_rows(chat_pairs(64, seed=1), tmp_path / "pairs.jsonl")
    chat_data.write_jsonl(chat_data.shakespeare_prompts(32, seed=2), tmp_path / "prompts.jsonl")

    summary = train_job.run(resolve_job(dict(
        init_from=str(hf), data=str(sft), steps=4, batch_size=8, seq_len=112, lr=1e-3,
        warmup_steps=1, eval_every=4, eval_batches=1, sample_tokens=24, temperature=1.0,
        out_dir=str(tmp_path / "sft"), progress=False)), write=quiet)
    assert len(emitted) == 1 and emitted[0][0].size - emitted[0][1] > 0
    checkpoint = str(tmp_path / "sft" / "checkpoint")
    for temperature in (0.0, 1.0):
        generate_from_checkpoint(checkpoint, "Who goes there?", max_new_tokens=24,
                                 temperature=temperature, top_k=None, tp=2)
    assert len(emitted) == 3
    runner.run(reward_job.RewardJob(reward_job.RewardJobConfig(
        init_from=str(hf), data=str(pairs), steps=2, batch_size=8, seq_len=112,
        run=RunSettings(eval_every=2, out_dir=str(tmp_path / "rm"), progress=False))),
        write=quiet)
    ppo = PPOConfig(ppo_epochs=1, prompts_per_iteration=8, prompt_length=8, answer_length=12)
    runner.run(ppo_job.PPOJob(ppo_job.PPOJobConfig(
        actor=str(tmp_path / "sft"), reward=str(tmp_path / "rm"),
        prompts=str(tmp_path / "prompts.jsonl"), ppo=ppo, iterations=2,
        run=RunSettings(out_dir=str(tmp_path / "ppo"), progress=False))), write=quiet)
    assert len(emitted) == 3 + 2 * ppo.prompts_per_iteration

    ids = new_ids(emitted)
    assert ids.min() >= 0 and ids.max() < TOKENIZER_SIZE
    # the same trained model sampled without the limit does draw padded ids
    step = local_zero3_step(zeroxla.load_params(checkpoint))
    prompt = emitted[1][0][:emitted[1][1]]
    unmasked = HybridEngine(step.layout, HybridEngineConfig(max_out_tokens=64)).generate(
        step.init(), [prompt], max_new_tokens=24, temperature=1.0)[0][prompt.size:]
    print(f"{ids.size} ids emitted, max {ids.max()}; without the limit "
          f"{np.sum(unmasked >= TOKENIZER_SIZE)} of {unmasked.size} padded; sample: "
          f"{summary.samples[:60]!r}")
    assert np.any(unmasked >= TOKENIZER_SIZE), unmasked
    from safetensors.numpy import load_file
    exported = load_file(str(tmp_path / "ppo" / "actor_hf" / "model.safetensors"))
    trained = zeroxla.load_params(tmp_path / "ppo" / "checkpoint" / "actor")
    embedding, = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trained))
                  if x.shape == (VOCAB, 64)]                   # tied: the one [V, D] leaf
    np.testing.assert_array_equal(exported["transformer.wte.weight"], embedding)
