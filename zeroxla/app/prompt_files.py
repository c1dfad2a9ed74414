"""GRPO's and PPO's prompt files: rows whose `prompt` is text or a conversation, and verl's
columns.

    prompt_records(path, split, tokenizer) -> [{"prompt": text, ...}]     one per row

`prompt` is a string, used as it is, or chat messages (TRL's conversational prompts, verl's
`prompt` column), rendered with the tokenizer's chat template and its generation prompt
(transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`), so
the model answers as the assistant; the reward functions see that text. The other columns go
to the reward functions, one keyword each (`zeroxla.rlhf.grpo.reward_funcs`). verl's layout (its
`examples/data_preprocess` recipes: `data_source`, `prompt`, `ability`, `reward_model: {"style",
"ground_truth"}`, `extra_info`) adds the column `ground_truth`: the row's
`reward_model.ground_truth`, which verl's `compute_score(data_source, solution_str,
ground_truth, extra_info)` takes (`zeroxla.rlhf.grpo.verl_score`). A row without a `prompt`, or
whose `prompt` or `reward_model` has another type, is a ChatDataError naming the file, the row
and the column.
"""

from __future__ import annotations

import os
from typing import Any

from zeroxla.app import chat_messages, data_files
from zeroxla.app.chat_template import ChatTemplate, ChatTemplateError
from zeroxla.app.data import ChatDataError

PROMPT_ACCEPTED = ("a string, or a list of {\"role\", \"content\"} messages (rendered with the "
                   "checkpoint's chat template)")


def prompt_records(path: str | os.PathLike, split: str | None,
                   tokenizer: Any) -> list[dict[str, Any]]:
    """Every row of `path` (`data_files.rows`) with its `prompt` as text (module docstring)."""
    template: list[ChatTemplate] = []             # read once, at the first conversation
    out = []
    for row in data_files.rows(path, split):
        record = dict(row.record)
        prompt = record.get("prompt")
        if isinstance(prompt, list):
            if not template:
                template.append(_template(tokenizer, row.where))
            record["prompt"] = _render(template[0], prompt, row.where)
        elif not isinstance(prompt, str):
            found = (f"missing field 'prompt'; accepted: 'prompt' (found {sorted(record)})"
                     if prompt is None else f"field 'prompt' is "
                     f"{data_files.type_name(row.source, prompt)}; accepted")
            raise ChatDataError(f"{row.where}: {found}: {PROMPT_ACCEPTED} (other columns go to "
                                "the reward functions)")
        if "reward_model" in record:
            record["ground_truth"] = _ground_truth(record, row)
        out.append(record)
    return out


def _template(tokenizer: Any, where: str) -> ChatTemplate:
    try:
        return ChatTemplate.of(tokenizer)
    except ChatTemplateError as err:
        raise ChatDataError(f"{where}: column 'prompt' holds chat messages, which need the "
                            f"checkpoint's chat template: {err}") from None


def _render(template: ChatTemplate, messages: list, where: str) -> str:
    parsed = chat_messages.parse_messages(messages, "prompt", where)
    try:
        return template.render(chat_messages.as_dicts(parsed), add_generation_prompt=True)
    except ChatTemplateError as err:
        raise ChatDataError(f"{where}: {err}") from None


def _ground_truth(record: dict[str, Any], row: data_files.Row) -> Any:
    """verl's `reward_model.ground_truth` of a row (its `reward_model` a mapping)."""
    reward_model = record["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        found = (data_files.type_name(row.source, reward_model)
                 if not isinstance(reward_model, dict) else f"keys {sorted(reward_model)}")
        raise ChatDataError(f"{row.where}: column 'reward_model' is {found}; accepted: verl's "
                            "{\"style\": ..., \"ground_truth\": ...}")
    if "ground_truth" in row.record:
        raise ChatDataError(f"{row.where}: columns 'ground_truth' and "
                            "'reward_model.ground_truth' both given; accepted: one of them")
    return reward_model["ground_truth"]


__all__ = ["PROMPT_ACCEPTED", "prompt_records"]
