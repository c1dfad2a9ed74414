"""Chat data as people hold it: conversations of `{"role", "content"}` messages, in TRL's
conversational formats, read from a data file's row (`data_files`) and turned into tokens by
the checkpoint's own chat template (`chat_template.py`).

    SFT          {"messages": [{"role": "system", "content": "..."},
                               {"role": "user", "content": "..."},
                               {"role": "assistant", "content": "..."}, ...]}
                 or {"prompt": [<messages>], "completion": [<assistant messages>]}
    preference   {"prompt": [<messages>], "chosen": [<assistant messages>],
                  "rejected": [<assistant messages>]}
                 or, with the prompt implicit, {"chosen": [<whole conversation>],
                 "rejected": [<whole conversation>]}

Roles are `system`, `user` and `assistant`; every content a string. An SFT conversation needs an
assistant message (the loss is on the assistant's tokens only: `ChatTemplate.tokens_of`); each
preference conversation ends with one. A row that mixes these with DeepSpeed-Chat's string fields
(`{"messages", "prompt"}`, a string `prompt` with list `chosen`), holds an unknown role, or no
assistant message is a `ChatDataError` naming the file, the row (a JSON file's line) and the
field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from zeroxla.app.chat_template import ChatTemplate, ChatTemplateError
from zeroxla.app.data import ChatDataError

ROLES = ("system", "user", "assistant")
Message = tuple[str, str]                 # (role, content)
# DeepSpeed-Chat's string fields an SFT `messages` row must not also hold.
SFT_STRING_FIELDS = ("prompt", "response", "chosen")


@dataclasses.dataclass(frozen=True)
class ChatExample:
    """An SFT conversation (the loss on its assistant messages); `path`/`line` say where it was
    read (None for examples built in code)."""

    messages: tuple[Message, ...]
    path: str | None = None
    line: int | None = None


@dataclasses.dataclass(frozen=True)
class ChatPairExample:
    """A preference pair of conversations: `prompt` (empty when implicit) continued by the
    `chosen` or by the `rejected` messages."""

    prompt: tuple[Message, ...]
    chosen: tuple[Message, ...]
    rejected: tuple[Message, ...]
    path: str | None = None
    line: int | None = None


def as_dicts(messages: tuple[Message, ...]) -> list[dict[str, str]]:
    """[{"role", "content"}] as templates read them."""
    return [{"role": role, "content": content} for role, content in messages]


def parse_messages(value: Any, field: str, where: str) -> tuple[Message, ...]:
    """The messages of `field` (a JSON list of {"role", "content"} objects); ChatDataError
    naming `where` (file:line) and the field otherwise."""
    if not isinstance(value, list) or not value:
        raise ChatDataError(f"{where}: field {field!r} is a JSON {type(value).__name__}"
                            f"{' of length 0' if value == [] else ''}; accepted: a non-empty list "
                            "of {\"role\", \"content\"} messages")
    out = []
    for i, message in enumerate(value):
        name = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise ChatDataError(f"{where}: {name} is a JSON {type(message).__name__}; "
                                "accepted: an object {\"role\", \"content\"}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatDataError(f"{where}: {name}.role={role!r} is not accepted; accepted: "
                                f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatDataError(f"{where}: {name}.content is a JSON {type(content).__name__}; "
                                "accepted: a string")
        out.append((role, content))
    return tuple(out)


def _ends_with_assistant(messages: tuple[Message, ...], field: str, where: str) -> None:
    if messages[-1][0] != "assistant":
        raise ChatDataError(f"{where}: field {field!r} ends with a {messages[-1][0]} message; "
                            "accepted: a conversation ending with an assistant message")


def sft_row(record: Mapping[str, Any], where: str, path: str, line: int) -> ChatExample:
    """The `{"messages": [...]}` row `record` (read at `where`)."""
    mixed = [key for key in SFT_STRING_FIELDS if key in record]
    if mixed:
        raise ChatDataError(f"{where}: a row holds both 'messages' and {mixed[0]!r}; accepted: "
                            "either {\"messages\": [...]} or {\"prompt\", \"response\"}")
    messages = parse_messages(record["messages"], "messages", where)
    if not any(role == "assistant" for role, _ in messages):
        raise ChatDataError(f"{where}: field 'messages' holds no assistant message, so there "
                            "is nothing to learn; accepted: a conversation with at least one "
                            "assistant message")
    return ChatExample(messages, path=path, line=line)


def prompt_completion_row(record: Mapping[str, Any], where: str, path: str,
                          line: int) -> ChatExample:
    """TRL's conversational prompt-completion row `{"prompt": [messages], "completion":
    [assistant messages]}` as one conversation, the loss on its assistant tokens."""
    prompt = parse_messages(record["prompt"], "prompt", where)
    completion = parse_messages(record["completion"], "completion", where)
    _ends_with_assistant(completion, "completion", where)
    return ChatExample(prompt + completion, path=path, line=line)


def is_chat_pair(record: Mapping[str, Any]) -> bool:
    """Whether a preference row is conversational (any of its fields a list, or `messages`)."""
    return "messages" in record or any(isinstance(record.get(k), list)
                                       for k in ("prompt", "chosen", "rejected"))


def pair_row(record: Mapping[str, Any], where: str, path: str, line: int) -> ChatPairExample:
    """A conversational preference row (TRL's format, module docstring)."""
    if "messages" in record:
        raise ChatDataError(f"{where}: field 'messages' in a preference row; accepted: TRL's "
                            "{\"prompt\": [messages], \"chosen\": [assistant messages], "
                            "\"rejected\": [assistant messages]}")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise ChatDataError(f"{where}: missing field {key!r}; accepted: a list of messages")
    prompt = (parse_messages(record["prompt"], "prompt", where) if "prompt" in record else ())
    chosen, rejected = (parse_messages(record[k], k, where) for k in ("chosen", "rejected"))
    for key, messages in (("chosen", chosen), ("rejected", rejected)):
        _ends_with_assistant(messages, key, where)
        if prompt and any(role != "assistant" for role, _ in messages):
            raise ChatDataError(f"{where}: field {key!r} holds a non-assistant message after an "
                                "explicit 'prompt'; accepted: assistant messages (or leave "
                                "'prompt' out and give whole conversations)")
    return ChatPairExample(prompt, chosen, rejected, path=path, line=line)


def template_for(examples: Any, tokenizer: Any) -> ChatTemplate | None:
    """The tokenizer's chat template when `examples` hold a conversation (refused, naming
    `chat_template`, when it has none); else None."""
    chat = any(isinstance(e, (ChatExample, ChatPairExample)) for e in examples)
    return ChatTemplate.of(tokenizer) if chat else None


def conversation_tokens(template: ChatTemplate, messages: tuple[Message, ...], where: str,
                        limit: int, limit_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32[L], assistant mask bool[L]) of `messages` under `template`; ChatDataError
    naming `where` (file:line) when the template refuses the conversation or its L tokens
    exceed `limit` (named `limit_name`: zeroxla does not truncate)."""
    try:
        ids, mask = template.tokens_of(as_dicts(messages))
    except ChatTemplateError as err:
        raise ChatDataError(f"{where}: {err}") from None
    if len(ids) > limit:
        raise ChatDataError(f"{where}: the conversation renders to {len(ids)} tokens but "
                            f"{limit_name} fits {limit}; raise seq_len or drop the example "
                            "(zeroxla does not truncate)")
    return ids, mask


def example_text(example: ChatExample) -> str:
    """Every content of the conversation, joined (for fitting a character vocabulary)."""
    return "".join(content for _, content in example.messages)


__all__ = ["ChatExample", "ChatPairExample", "ROLES", "as_dicts", "conversation_tokens",
           "example_text", "is_chat_pair", "pair_row", "parse_messages",
           "prompt_completion_row", "sft_row", "template_for"]
