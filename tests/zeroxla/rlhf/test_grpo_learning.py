"""GRPO learns (zeroxla/rlhf/grpo.py on the bundled arithmetic task, 1-digit operands): a tiny GPT
is SFT'd on part of the task, where half the answers are written without the `####` marker, so
it states its answer in the checked form only part of the time and gets some sums wrong; twelve
GRPO iterations with the exact-answer reward then raise its greedy exact-answer accuracy on
held-out problems (disjoint from both the SFT and the GRPO prompts) by at least MARGIN.
Measured with these seeds under the suite's XLA flags on CPU: 0.133 -> 0.250 (17 -> 32 of 128;
docs/rl.md); the rollouts' exact-answer reward goes 0.16 -> 0.19 over the twelve iterations."""

import pytest

import zeroxla
from zeroxla import models
from zeroxla.app.tokenizer import CharTokenizer
from zeroxla.rlhf import GRPOConfig, arithmetic_task as task
from zeroxla.rlhf.grpo import exact_accuracy, run_grpo
from zeroxla.rlhf.reward_funcs import accuracy_reward
from zeroxla.rlhf.task_sft import supervised_finetune_rows

MARGIN = 0.08        # 128 held-out problems: at least 11 more answered right


@pytest.mark.slow
def test_grpo_raises_held_out_accuracy():
    tokenizer = CharTokenizer.from_text(task.ALPHABET)
    eos = int(tokenizer.encode(task.END)[0])
    train, held_out = task.split_problems(1000, 128, seed=0, digits=1)
    width = task.prompt_width(1)
    sft_rows = [dict(p, completion=p["completion"] if i % 2 else p["answer"] + task.END)
                for i, p in enumerate(train[:600])]
    config = GRPOConfig(num_generations=8, prompts_per_iteration=8, prompt_length=width,
                        max_completion_length=8, num_iterations=2, learning_rate=1e-3)
    mesh = zeroxla.make_mesh(2, 4)
    actor = models.build("gpt-tiny", vocab_size=tokenizer.vocab_size, max_seq_len=64)
    sft, _ = supervised_finetune_rows(actor, sft_rows, tokenizer, mesh=mesh, prompt_length=width,
                                      completion_length=8, steps=200, batch_size=32, lr=3e-3)
    before = exact_accuracy(sft, held_out, tokenizer, config, mesh=mesh, eos_id=eos)
    run = run_grpo(config, 12, sft, mesh=mesh, tokenizer=tokenizer, prompts=train[600:],
                   reward_funcs=[accuracy_reward], eos_id=eos)
    after = exact_accuracy(run.trainer.actor_model(), held_out, tokenizer, config, mesh=mesh,
                           eos_id=eos)
    assert after >= before + MARGIN, (before, after, [r["reward"] for r in run.records])
