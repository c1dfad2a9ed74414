"""A checkpoint's chat template: a conversation (`messages`) rendered as the checkpoint's model
was trained to read it, and which of its tokens are the assistant's (the SFT loss mask).

    template = ChatTemplate.of(tokenizer)        # chat_template.jinja, else tokenizer_config.json's
    ids, mask = template.tokens_of(messages)     # int32[L], bool[L]: True on assistant tokens

A template that does not parse (a Jinja syntax error, an unknown filter) is refused when it is
read (`ChatTemplate.of`), one that fails while rendering (a TypeError, an undefined attribute)
when it renders: a `ChatTemplateError` naming the file it came from and the template's line.

The template is `chat_template.jinja` when the checkpoint has one (transformers 5 saves it so, and
reads it first), else `tokenizer_config.json`'s `chat_template` (a string, or a list of {name,
template} of which "default" is used). A tokenizer without one is refused, naming
`chat_template`.

Rendering is transformers' (`transformers.utils.chat_template_utils`), with Jinja2 alone: the
sandboxed environment with `trim_blocks` and `lstrip_blocks`, `loopcontrols`, the globals
`raise_exception`, `strftime_now` and `namespace`, a `tojson` that does not escape HTML, the
tokenizer's special tokens as variables (`bos_token`, `eos_token`, ...), and the
`{% generation %} ... {% endgeneration %}` block, which marks what the assistant says.
`tests/zeroxla/app/test_chat_template.py` checks the text, the ids and the mask against
`apply_chat_template`.

Which characters are the assistant's (`assistant_spans`):
  with `{% generation %}` blocks: what those blocks render, exactly what transformers'
      `apply_chat_template(..., return_assistant_tokens_mask=True)` marks;
  without: for each assistant message i, the text between render(messages[:i],
      add_generation_prompt=True) and render(messages[:i + 1]): the message and what the template
      closes its turn with (the end-of-turn token the model must learn to emit). Both renders
      must be prefixes of the whole conversation's; a template that renders earlier turns
      differently once later ones follow (Qwen3's drops earlier turns' reasoning) is refused,
      since no span of the whole text would then be exact.
A token is the assistant's when any of its characters is in a span (transformers'
`char_to_token` rule). The rendered text is encoded with no special tokens added: the template
writes them.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import re
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zeroxla.app.tokenizers.pretrained import (CHAT_TEMPLATE_FILE, SPECIAL_TOKENS_MAP_FILE,
                                               TOKENIZER_CONFIG_FILE as CONFIG_FILE)

# The special tokens a template sees as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
Span = tuple[int, int]                    # [start, end) characters of the rendered text


class ChatTemplateError(ValueError):
    """A tokenizer with no chat template, a template that does not parse or fails while
    rendering, or one whose turns cannot be told apart."""


class _Refusal(Exception):
    """What a template's `raise_exception(message)` raises: the template refusing the
    conversation on purpose (transformers raises a jinja2 TemplateError)."""


def _token(value: Any) -> str | None:
    """A special token as transformers writes it: a string, or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _find_template(files: Mapping[str, str], source: str) -> tuple[str, str]:
    """(the template text of the tokenizer files `files` (name -> text), by transformers' rule;
    the file it came from: `source/chat_template.jinja` or `source/tokenizer_config.json`)."""
    if CHAT_TEMPLATE_FILE in files:
        return files[CHAT_TEMPLATE_FILE], f"{source}/{CHAT_TEMPLATE_FILE}"
    config = json.loads(files.get(CONFIG_FILE, "{}"))
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(
            f"the tokenizer in {source or 'the checkpoint'} has no chat_template (neither "
            f"{CHAT_TEMPLATE_FILE} nor a \"chat_template\" in {CONFIG_FILE}), so `messages` "
            "data cannot be rendered; accepted: a checkpoint whose tokenizer has a chat "
            "template, or {\"prompt\", \"response\"} rows")
    return template, f"{source}/{CONFIG_FILE}"


def _template_tokens(files: Mapping[str, str]) -> dict[str, str]:
    """{name: token} of TEMPLATE_TOKENS in tokenizer_config.json, then special_tokens_map.json
    (which wins, as in transformers)."""
    tokens: dict[str, str] = {}
    for name in (CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE):
        record = json.loads(files[name]) if name in files else {}
        for key in TEMPLATE_TOKENS:
            token = _token(record.get(key)) if isinstance(record, dict) else None
            if token is not None:
                tokens[key] = token
    return tokens


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """The Jinja2 template in transformers' environment, with a `{% generation %}` tag that
    records where its text starts and ends while `environment.tracked` is (the blocks yielded
    so far, the spans found; None: off): at the length of what was yielded when the block
    ends, as transformers' `AssistantTracker` places it."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [],
                                          body).set_lineno(lineno)

        def _generation(self, caller: Any) -> str:
            text = caller()
            if self.environment.tracked is not None:
                blocks, spans = self.environment.tracked
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise _Refusal(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: datetime.datetime.now().strftime(f)
    env.tracked = None
    return env.from_string(template)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the special tokens it sees and the tokenizer that encodes its text
    (a `PretrainedTokenizer`: its `tokenizer` is a `tokenizers.Tokenizer`)."""

    template: str = dataclasses.field(repr=False)
    special_tokens: tuple[tuple[str, str], ...]    # (name, token): template variables
    tokenizer: Any = dataclasses.field(repr=False, compare=False)
    source: str = ""
    file: str = ""                  # where the template was read: ...chat_template.jinja or
                                    # ...tokenizer_config.json (its "chat_template")

    @classmethod
    def of(cls, tokenizer: Any) -> "ChatTemplate":
        """The template of `tokenizer`'s files, parsed; ChatTemplateError naming
        `chat_template` when it has none (a character or byte tokenizer never has one), or
        naming its file and line when it does not parse."""
        files = dict(getattr(tokenizer, "files", ()) or ())
        source = getattr(tokenizer, "source", "") or type(tokenizer).__name__
        template, file = _find_template(files, source)
        out = cls(template, tuple(sorted(_template_tokens(files).items())), tokenizer, source,
                  file)
        out.parsed()
        return out

    def parsed(self) -> Any:
        """The parsed template (`_compile`); ChatTemplateError naming the file and line of a
        syntax error or an unknown filter."""
        import jinja2

        try:
            return _compile(self.template)
        except jinja2.exceptions.TemplateSyntaxError as err:     # unknown filters included
            raise ChatTemplateError(
                f"{self._line(err.lineno)}: the chat template does not parse: "
                f"{(err.message or '').rstrip('.')}; accepted: a Jinja template that "
                "transformers' apply_chat_template renders") from None

    def _line(self, line: int | None) -> str:
        """Where line `line` of the template is: `file:line` for chat_template.jinja, the
        template's line within tokenizer_config.json's "chat_template" string otherwise."""
        file = self.file or f"the chat template of {self.source or 'a tokenizer'}"
        if line is None:
            return file
        if file.endswith(CHAT_TEMPLATE_FILE):
            return f"{file}:{line}"
        return f"{file} (\"chat_template\", line {line} of the template)"

    @property
    def has_generation_blocks(self) -> bool:
        return GENERATION_TAG.search(self.template) is not None

    def _render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
                track: bool = False) -> tuple[str, list[Span]]:
        """(text, spans of its `{% generation %}` blocks when `track`)."""
        compiled = self.parsed()
        blocks: list[str] = []
        spans: list[Span] = []
        compiled.environment.tracked = (blocks, spans) if track else None
        try:
            for block in compiled.generate(messages=[dict(m) for m in messages], tools=None,
                                           documents=None,
                                           add_generation_prompt=add_generation_prompt,
                                           **dict(self.special_tokens)):
                blocks.append(block)
        except _Refusal as err:                               # raise_exception(...)
            raise ChatTemplateError(f"the chat template of {self.source} refused the "
                                    f"conversation: {err}") from None
        except Exception as err:        # the template's own error: TypeError, undefined, ...
            lines = [f.lineno for f in traceback.extract_tb(err.__traceback__)
                     if f.filename == "<template>"]
            raise ChatTemplateError(
                f"{self._line(lines[-1] if lines else None)}: the chat template failed while "
                f"rendering the conversation: {type(err).__name__}: {str(err).rstrip('.')}; "
                "accepted: a template that renders {\"role\", \"content\"} messages") from None
        finally:
            compiled.environment.tracked = None
        return "".join(blocks), spans

    def render(self, messages: Sequence[Mapping[str, str]], *,
               add_generation_prompt: bool = False) -> str:
        """The conversation as text (transformers' `apply_chat_template(..., tokenize=False)`)."""
        return self._render(messages, add_generation_prompt)[0]

    def assistant_spans(self, messages: Sequence[Mapping[str, str]]) -> tuple[str, list[Span]]:
        """(the rendered conversation, the character spans of the assistant's text): see the
        module docstring for the two rules."""
        if self.has_generation_blocks:
            return self._render(messages, False, track=True)
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[:i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ChatTemplateError(
                    f"the chat template of {self.source} renders message {i} (assistant) "
                    "differently once later messages follow, so its tokens cannot be located "
                    "in the conversation; accepted: a template whose turns render as prefixes "
                    "of the conversation, or one that marks them with {% generation %}")
            spans.append((len(before), len(through)))
        return text, spans

    def tokens_of(self, messages: Sequence[Mapping[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32[L], mask bool[L]: True on the assistant's tokens) of the conversation."""
        text, spans = self.assistant_spans(messages)
        encoding = self.tokenizer.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, np.int32).reshape(-1)                   # [L]
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)        # [L, 2]
        mask = np.zeros(ids.shape, bool)
        for start, end in spans:
            if end > start:        # a token holding any character of [start, end)
                mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return ids, mask


__all__ = ["ChatTemplate", "ChatTemplateError", "Span"]
