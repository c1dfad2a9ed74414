"""GRPO prompts of different lengths (zeroxla/rlhf/grpo/prompts.py): `zeroxla grpo` keeps every
prompt whole by default (the cap is the longest prompt, not the shortest), an explicit
--max-prompt-seq-len cuts longer prompts to their last tokens and counts them, the reward
functions see the kept text, and the right-padded rows give each answer the log-probs of its
prompt and answer run alone (float64 numpy log-softmax of the unpadded row's logits)."""

import jax
import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.app.jobs import grpo as grpo_job
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from zeroxla.rlhf.grpo.losses import ragged_answer_logprobs
from zeroxla.rlhf.grpo.prompts import prompt_cap, prompt_rows, truncation_report
from zeroxla.rlhf.rollout import pad_answers

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
TEXTS = ["12", "Mia has 47 pens?", "3 - 4", "Sam gets 9 more. How many? ", "7", "Ian, 12 #"]
ROWS = [{"prompt": t, "answer": str(i)} for i, t in enumerate(TEXTS)]


def test_the_default_cap_keeps_every_prompt_whole():
    job = grpo_job.GRPOJobConfig(actor="sft", prompts="rows.jsonl", reward_funcs=("accuracy",))
    length = prompt_cap(ROWS, TOKENIZER, job.prompt_length)     # no --max-prompt-seq-len
    assert length == max(len(t) for t in TEXTS)            # one token per character
    kept = prompt_rows(ROWS, TOKENIZER, length)
    assert (kept.truncated, kept.tokens_lost) == (0, 0)
    for ids, text, row in zip(kept.ids, TEXTS, kept.rows):
        np.testing.assert_array_equal(ids, TOKENIZER.encode(text))
        assert row["prompt"] == text
    assert truncation_report(kept, [], TOKENIZER)[1] is None


def test_an_explicit_cap_counts_the_cut_and_rewards_see_the_kept_text():
    cap = 5
    kept = prompt_rows(ROWS, TOKENIZER, cap)
    long = [t for t in TEXTS if len(t) > cap]
    assert (kept.truncated, kept.tokens_lost) == (len(long), sum(len(t) - cap for t in long))
    assert [r["prompt"] for r in kept.rows] == [t[-cap:] for t in TEXTS]
    summary, line = truncation_report(kept, ROWS[:2], TOKENIZER)
    assert summary["prompts"]["truncated_prompts"] == 3 and summary["held_out"] == {
        "max_prompt_tokens": cap, "prompts": 2, "truncated_prompts": 1, "tokens_lost": 11}
    assert line.startswith(f"--max-prompt-seq-len {cap}: 3 of 6 prompts keep their last {cap} "
                           f"tokens ({kept.tokens_lost} tokens cut)")
    assert "1 of 2 held-out problems" in line

    seen = []

    def record(prompts, completions, answer, **_):
        seen.extend(zip(prompts, answer))
        return [0.0] * len(completions)

    config = GRPOConfig(num_generations=2, prompts_per_iteration=len(ROWS), prompt_length=cap,
                        max_completion_length=3)
    trainer = GRPOTrainer(config, models.build("gpt-tiny", vocab_size=TOKENIZER.vocab_size,
                                               max_seq_len=16, num_layers=1),
                          mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER, prompts=ROWS,
                          reward_funcs=[record], inference_tp_size=1)
    picked = np.arange(len(ROWS))
    rows = 2 * len(ROWS)
    trainer.score(picked, np.zeros((rows, cap + 3), np.int32),
                  np.ones((rows, cap + 3), np.float32), ("",) * rows)
    assert seen == [(t[-cap:], str(i)) for i, t in enumerate(TEXTS) for _ in range(2)]


def test_right_padded_rows_give_each_answer_its_log_probs_alone():
    model = models.build("gpt-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=40,
                         num_layers=1, seed=3)
    rng = np.random.default_rng(0)
    prompts = [np.asarray(TOKENIZER.encode(t), np.int32) for t in TEXTS]
    answers = [rng.integers(0, TOKENIZER.vocab_size, n).astype(np.int32)
               for n in (3, 6, 1, 6, 4, 2)]
    width, answer_length = max(p.size for p in prompts), 6
    tokens, mask = pad_answers([np.concatenate(pa) for pa in zip(prompts, answers)], width,
                               answer_length, [p.size for p in prompts])
    got = np.asarray(ragged_answer_logprobs(model, tokens, np.asarray([p.size for p in prompts]),
                                            answer_length))
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))     # one program, not op by op
    for b, (prompt, answer) in enumerate(zip(prompts, answers)):
        row = np.concatenate([prompt, answer])
        logits = np.asarray(forward(state, row[None, :-1])[0], np.float64)    # alone, unpadded
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        want = logp[np.arange(prompt.size - 1, row.size - 1), answer]
        np.testing.assert_array_equal(mask[b], np.arange(answer_length) < answer.size)
        np.testing.assert_allclose(got[b, :answer.size], want, rtol=0, atol=2e-6,
                                   err_msg=f"row {b}")


@pytest.mark.parametrize("prompt_lengths, message", [
    ([6, 0], "row 1: a prompt of 0"), ([6, 7], "row 1: a prompt of 7")])
def test_pad_answers_refuses_a_prompt_length_outside_the_columns(prompt_lengths, message):
    rows = [np.arange(8, dtype=np.int32)] * 2
    with pytest.raises(ValueError, match=message):
        pad_answers(rows, 6, 4, prompt_lengths)
