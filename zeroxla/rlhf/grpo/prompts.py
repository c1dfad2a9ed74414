"""GRPO's prompts as token rows of their own lengths, and what a cap on their length cut.

Our models take no attention mask, so prompts of different lengths are laid out RIGHT-padded
(TRL left-pads and masks the pads; here unmasked pads would be attended): row b holds its
prompt at positions 0 .. L_b - 1, its answer from L_b, then zeros (`rollout.pad_answers` with
`prompt_lengths`). A causal model's token at position t sees positions 0 .. t only, which are
all real tokens of its own row at their true positions, so every log-prob equals the one of
that prompt and answer run alone. The Hybrid Engine's decode lays prompts out the same way
(`zeroxla.inference.decode`); the training forward reads each row's answer from its own
offset (`answer_values.ragged_answer_logprobs`).

A prompt longer than the cap (`GRPOConfig.prompt_length`, the job's `--max-prompt-seq-len`)
keeps its last tokens (TRL's `max_prompt_length`, DeepSpeed-Chat's prompt dataset);
`PromptRows` counts the prompts cut and the tokens lost, and its rows carry the decoded kept
tokens as their "prompt", so the reward functions see the text the model saw.

Where `zeroxla grpo`'s prompts come from: a file's rows (`file_rows`), or the bundled
arithmetic task (`task_rows`: its training and held-out problems, `TASK_REWARDS`); the cap
(`prompt_cap`) and whether prompt and answer fit the model (`check_fit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from zeroxla.rlhf.grpo import arithmetic_task as task

TASK_SPLIT = dict(n_train=2000, n_test=200, seed=0)     # the bundled task's problems
TASK_DIGITS = 2
TASK_REWARDS = ("accuracy", "format")                    # its reward functions


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """Prompt rows tokenized under a length cap (see the module docstring)."""

    ids: tuple[np.ndarray, ...]          # int32[L_i] each, 1 <= L_i <= length
    rows: tuple[dict[str, Any], ...]     # the rows; a cut row's "prompt" is its kept text
    length: int                          # the cap
    truncated: int                       # prompts longer than the cap
    tokens_lost: int                     # the tokens cut from them, in all

    def summary(self) -> dict[str, int]:
        """{"max_prompt_tokens", "prompts", "truncated_prompts", "tokens_lost"} for a log."""
        return {"max_prompt_tokens": self.length, "prompts": len(self.ids),
                "truncated_prompts": self.truncated, "tokens_lost": self.tokens_lost}


def prompt_rows(prompts: Sequence[dict[str, Any]], tokenizer: Any, length: int) -> PromptRows:
    """`prompts` ({"prompt": text, ...} each) tokenized, each keeping at most its last `length`
    tokens; ValueError naming the row for one that is not such a dict or has no token."""
    ids, rows, truncated, lost = [], [], 0, 0
    for i, row in enumerate(prompts):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"prompt row {i} is {row!r:.80}; accepted: a dict with a 'prompt' "
                             "string (other keys are passed to the reward functions)")
        tokens = np.asarray(tokenizer.encode(row["prompt"]), np.int32).reshape(-1)
        if tokens.size == 0:
            raise ValueError(f"prompt row {i} ({row['prompt']!r:.40}) has no tokens; accepted: "
                             "a prompt of at least one token")
        if tokens.size > length:
            truncated, lost = truncated + 1, lost + tokens.size - length
            tokens = tokens[-length:]
            row = dict(row, prompt=tokenizer.decode(tokens))
        ids.append(tokens)
        rows.append(row)
    return PromptRows(tuple(ids), tuple(rows), length, truncated, lost)


def truncation_report(prompts: PromptRows, held_out: Sequence[dict[str, Any]], tokenizer: Any
                      ) -> tuple[dict[str, Any], str | None]:
    """`zeroxla grpo`'s summary.json "prompt_truncation" (`PromptRows.summary` of the prompts
    and, under the same cap, of the held-out problems) and the line its log starts with when
    the cap (--max-prompt-seq-len) cut any prompt (else None)."""
    cut = {"prompts": prompts.summary()}
    if held_out:
        cut["held_out"] = prompt_rows(held_out, tokenizer, prompts.length).summary()
    names = {"prompts": "prompts", "held_out": "held-out problems"}
    parts = [f"--max-prompt-seq-len {part['max_prompt_tokens']}: {part['truncated_prompts']} of "
             f"{part['prompts']} {names[name]} keep their last {part['max_prompt_tokens']} "
             f"tokens ({part['tokens_lost']} tokens cut)"
             for name, part in cut.items() if part["truncated_prompts"]]
    if not parts:
        return cut, None
    return cut, "; ".join(parts) + "; the reward functions see the kept text"


def longest_prompt(prompts: Sequence[dict[str, Any]], tokenizer: Any) -> int:
    """The most tokens of any row's "prompt" (0 for no rows)."""
    return max((len(tokenizer.encode(row["prompt"])) for row in prompts), default=0)


def prompt_cap(prompts: Sequence[dict[str, Any]], tokenizer: Any, given: int | None) -> int:
    """The cap on prompt tokens: `given` (--max-prompt-seq-len), else the longest prompt's, so
    every prompt is kept whole; at least 1 (a prompt of no token is then refused by row,
    `prompt_rows`)."""
    return given or max(longest_prompt(prompts, tokenizer), 1)


def check_fit(prompt_length: int, completion_length: int, max_seq_len: int | None, *,
              capped: bool, model: str) -> None:
    """ValueError naming the options unless prompt + answer tokens fit the model's positions
    (`capped`: the cap was --max-prompt-seq-len, not the longest prompt)."""
    need = prompt_length + completion_length
    if max_seq_len is None or need <= max_seq_len:
        return
    given = ("--max-prompt-seq-len" if capped else
             "the longest prompt's; --max-prompt-seq-len cuts longer ones")
    raise ValueError(f"prompt tokens {prompt_length} ({given}) + --max-completion-length "
                     f"{completion_length} = {need} exceed the max_seq_len={max_seq_len} of "
                     f"{model}; accepted: a sum <= {max_seq_len}")


def file_rows(records: Sequence[dict[str, Any]], tokenizer: Any
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int | None]:
    """(a prompts file's rows, checked and with their prompts as text by
    `zeroxla.app.prompt_files.prompt_records`; no held-out problems; the tokenizer's `eos_id`)
    as `task_rows` returns them."""
    return list(records), [], getattr(tokenizer, "eos_id", None)


def task_rows(tokenizer: Any, model: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                   int | None]:
    """(training problems, held-out problems, the id that ends an answer) of the bundled task:
    the tokenizer's `eos_id`, else its newline when that is one token. ValueError naming
    `model` when its tokenizer cannot write every character of the task."""
    unknown = "".join(ch for ch in task.ALPHABET if _token_ids(tokenizer, ch) is None)
    if unknown:
        raise ValueError(f"{model}: its tokenizer cannot write the bundled task (characters "
                         f"{unknown!r}); accepted: an actor SFT'd on the task "
                         "(zeroxla.rlhf.grpo.task_sft), or give --prompts")
    eos_id = getattr(tokenizer, "eos_id", None)
    if eos_id is None:
        ids = _token_ids(tokenizer, task.END)
        eos_id = int(ids[0]) if ids is not None and len(ids) == 1 else None
    return (*task.split_problems(**TASK_SPLIT, digits=TASK_DIGITS), eos_id)


def _token_ids(tokenizer: Any, text: str) -> Sequence[int] | None:
    try:
        return tokenizer.encode(text)
    except ValueError:
        return None


__all__ = ["PromptRows", "TASK_REWARDS", "check_fit", "file_rows", "longest_prompt",
           "prompt_cap", "prompt_rows", "task_rows", "truncation_report"]
