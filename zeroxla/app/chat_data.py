"""DeepSpeed-Chat's data for its three steps: SFT examples, preference pairs, PPO prompts.

The data flow, one way:

    read_sft_jsonl / read_pair_jsonl / read_prompt_jsonl   data files -> examples (checked first)
    sft_arrays / pair_arrays / prompt_arrays               examples -> numpy arrays for the step
    prompt_rows                                            PPO's prompts: each one's last tokens
    rows_without_loss / pairs_without_preference,
    check_learnable                                        nothing to learn: counted, or refused
                                                           (`learnable.py`, re-exported here)
    shakespeare_sft / _pairs / _prompts, write_jsonl       offline examples from tiny-shakespeare

Files: JSON lines (`.jsonl`), a JSON array of the same objects (`.json`), optionally gzipped,
Parquet, or a `datasets` directory (`data_files.rows`, with `split`); other keys are ignored. The
fields are DeepSpeed-Chat's `PromptRawDataset` ones (`get_prompt`, `get_chosen`, `get_rejected`)
and TRL's standard ones (`completion`):

    SFT      {"prompt": "...", "response": "..."}         ("chosen", or TRL's "completion", for
                                                           "response")
    pairs    {"prompt": "...", "chosen": "...", "rejected": "..."}
    prompts  {"prompt": "..."}

and TRL's conversational rows (`chat_messages.py`: `{"messages": [...]}` or `{"prompt": [...],
"completion": [...]}` for SFT; `{"prompt": [...], "chosen": [...], "rejected": [...]}` for
pairs; a `prompt` of messages for PPO, `prompt_files`), rendered with the checkpoint's chat
template, the SFT loss on the assistant's tokens only.

Every problem with a file is a `ChatDataError` naming the file and the row (`file:line` of a
JSON file, `file row N` of the others) and the field before any token is computed,
and an example too long for the sequence is an error naming it, never a silent truncation. An
example can also hold nothing to learn: an SFT row with no loss token (an empty response and no
EOS token), a pair whose chosen and rejected rows are the same tokens (the pairwise loss is
log 2 with a zero gradient). The jobs count those and report them; a file, or a train or
validation split, of nothing else is refused (`check_learnable`), since it would train on nothing
and still exit 0.

Token layout. Prompt and answer are encoded separately and concatenated, so the boundary the loss
mask follows is exact (encoding `prompt + answer` as one string lets a BPE merge across it):

    SFT      seq = prompt + response (+ eos)   len(seq) <= seq_len + 1
             inputs = seq[:-1], targets = seq[1:], right-padded with the pad id; loss_mask = 1
             where the target is a response (or eos) token: the model learns the answer only
    pairs    prompt + chosen / prompt + rejected (+ eos), each <= seq_len, right-padded;
             *_end = index of the last real token (where the reward model reads its score)
    prompts  left-padded to prompt_length, so every row's next token goes in the same column
    chat     seq = the rendered conversation's tokens (the template writes its own end-of-turn
             and special tokens; no eos is appended); SFT loss_mask = 1 where the target is an
             assistant token (`chat_template.ChatTemplate.tokens_of`)
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zeroxla.app import chat_messages, packing
from zeroxla.app.chat_messages import ChatExample, ChatPairExample
from zeroxla.app.data import ChatDataError, load_text
from zeroxla.app.example_rows import (PairExample, SFTExample, example_where as _where,
                                      read_pair_jsonl, read_prompt_jsonl, read_sft_jsonl)
from zeroxla.app.learnable import check_learnable, pairs_without_preference, rows_without_loss
from zeroxla.app.tokenizers.basic import Tokenizer


# ----------------------------------------------------------------------------- token arrays

def _pad_id(tokenizer: Tokenizer, pad_id: int | None, length_name: str, length: int) -> int:
    """`pad_id`, else the tokenizer's `pad_id` (PretrainedTokenizer has one), else 0; checks
    the row length `length_name`=`length` on the way."""
    if not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"{length_name}={length!r} is invalid; accepted: an integer >= 1")
    return int(pad_id if pad_id is not None else getattr(tokenizer, "pad_id", 0))


def _encode_answer(tokenizer: Tokenizer, prompt: str, answer: str,
                   eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids int32[P], answer ids int32[A] with eos appended when given)."""
    tail = [] if eos_id is None else [int(eos_id)]
    answer_ids = np.concatenate([tokenizer.encode(answer), np.asarray(tail, np.int32)])
    return tokenizer.encode(prompt).astype(np.int32), answer_ids.astype(np.int32)


def _check_fit(where: str, what: str, prompt: int, answer: int, limit: int,
               limit_name: str) -> None:
    """ChatDataError when a `prompt + answer`-token sequence is empty or longer than `limit`."""
    if prompt + answer > limit:
        raise ChatDataError(f"{where}: prompt+{what} is {prompt + answer} tokens (prompt "
                            f"{prompt}, {what} {answer}) but {limit_name} fits {limit}; raise "
                            "seq_len or drop the example (zeroxla does not truncate)")
    if prompt + answer == 0:
        raise ChatDataError(f"{where}: prompt+{what} has no tokens")


def _sft_tokens(example: SFTExample | ChatExample, index: int, tokenizer: Tokenizer,
                template: Any, eos_id: int | None,
                seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(seq int32[L], learned bool[L]: True on the tokens the loss predicts), L <= seq_len + 1."""
    limit = f"seq_len={seq_len} (+1 for the shifted targets)"
    if isinstance(example, ChatExample):
        return chat_messages.conversation_tokens(template, example.messages,
                                                 _where(example, index), seq_len + 1, limit)
    prompt, answer = _encode_answer(tokenizer, example.prompt, example.response, eos_id)
    _check_fit(_where(example, index), "response", len(prompt), len(answer), seq_len + 1, limit)
    learned = np.arange(len(prompt) + len(answer)) >= len(prompt)
    return np.concatenate([prompt, answer]), learned


def sft_arrays(examples: Sequence[SFTExample | ChatExample], tokenizer: Tokenizer,
               seq_len: int, *, eos_id: int | None = None, pad_id: int | None = None,
               packed: bool = False) -> dict[str, np.ndarray]:
    """SFT batch arrays for `examples`: {"inputs", "targets"} int32[N, seq_len] and
    "loss_mask" float32[N, seq_len], 1 exactly where the target is a response token (or the
    appended `eos_id`), or an assistant token of a conversation, 0 on prompt and padding.
    Padding uses `pad_id` (default: the tokenizer's pad id, else 0). Each prompt+response(+eos),
    or rendered conversation, must fit seq_len + 1 tokens. `packed`: several examples per row,
    with "positions" and "segment_ids" (`zeroxla.app.packing.pack`), R <= N rows."""
    pad = _pad_id(tokenizer, pad_id, "seq_len", seq_len)
    template = chat_messages.template_for(examples, tokenizer)
    sequences = [_sft_tokens(example, i, tokenizer, template, eos_id, seq_len)  # ([L], [L])
                 for i, example in enumerate(examples)]
    if packed:
        return packing.pack(sequences, seq_len, pad)
    n = len(examples)
    inputs = np.full((n, seq_len), pad, np.int32)          # [N, T]
    targets = np.full((n, seq_len), pad, np.int32)         # [N, T]
    loss_mask = np.zeros((n, seq_len), np.float32)         # [N, T]
    for i, (seq, learned) in enumerate(sequences):
        inputs[i, :len(seq) - 1] = seq[:-1]
        targets[i, :len(seq) - 1] = seq[1:]
        loss_mask[i, :len(seq) - 1] = learned[1:]          # targets[t] = seq[t + 1]
    return {"inputs": inputs, "targets": targets, "loss_mask": loss_mask}


def _pair_tokens(example: PairExample | ChatPairExample, key: str, tokenizer: Tokenizer,
                 template: Any, eos_id: int | None, where: str,
                 seq_len: int) -> tuple[int, np.ndarray]:
    """(prompt tokens, prompt + answer int32[L]) of one side (`key`) of a pair; a
    conversation's prompt is what precedes its first assistant token."""
    if isinstance(example, ChatPairExample):
        seq, learned = chat_messages.conversation_tokens(
            template, example.prompt + getattr(example, key), where, seq_len,
            f"seq_len={seq_len}")
        return int(np.argmax(learned)), seq
    prompt, answer = _encode_answer(tokenizer, example.prompt, getattr(example, key), eos_id)
    return len(prompt), np.concatenate([prompt, answer])


def pair_arrays(examples: Sequence[PairExample | ChatPairExample], tokenizer: Tokenizer,
                seq_len: int, *, eos_id: int | None = None,
                pad_id: int | None = None) -> dict[str, np.ndarray]:
    """Reward-model batch arrays for `examples`: "chosen" and "rejected" int32[N, seq_len]
    (prompt + answer (+ `eos_id`), or the rendered conversation, right-padded), "chosen_end"
    and "rejected_end" int32[N] (index of each row's last real token). Each sequence must fit
    seq_len tokens."""
    pad = _pad_id(tokenizer, pad_id, "seq_len", seq_len)
    template = chat_messages.template_for(examples, tokenizer)
    n = len(examples)
    out = {"chosen": np.full((n, seq_len), pad, np.int32),          # [N, T]
           "rejected": np.full((n, seq_len), pad, np.int32),        # [N, T]
           "chosen_end": np.zeros((n,), np.int32),                  # [N]
           "rejected_end": np.zeros((n,), np.int32)}                # [N]
    for i, example in enumerate(examples):
        for key in ("chosen", "rejected"):
            prompt, seq = _pair_tokens(example, key, tokenizer, template, eos_id,
                                       f"{_where(example, i)} {key}", seq_len)
            _check_fit(_where(example, i), key, prompt, len(seq) - prompt, seq_len,
                       f"seq_len={seq_len}")
            out[key][i, :len(seq)] = seq
            out[f"{key}_end"][i] = len(seq) - 1
    return out


def prompt_arrays(prompts: Sequence[str], tokenizer: Tokenizer, prompt_length: int, *,
                  pad_id: int | None = None) -> dict[str, np.ndarray]:
    """Generation inputs: "prompts" int32[N, prompt_length] LEFT-padded (DeepSpeed-Chat's
    layout: every row ends at the same column), "prompt_mask" bool[N, prompt_length] (True on
    real tokens) and "lengths" int32[N]. A prompt of no tokens or more than `prompt_length`
    tokens is a ChatDataError naming its index."""
    pad = _pad_id(tokenizer, pad_id, "prompt_length", prompt_length)
    ids = np.full((len(prompts), prompt_length), pad, np.int32)     # [N, P]
    mask = np.zeros((len(prompts), prompt_length), bool)            # [N, P]
    lengths = np.zeros((len(prompts),), np.int32)                   # [N]
    for i, prompt in enumerate(prompts):
        tokens = tokenizer.encode(prompt)
        if not 0 < len(tokens) <= prompt_length:
            raise ChatDataError(f"prompt {i} ({prompt[:40]!r}...) is {len(tokens)} tokens; "
                                f"accepted: 1 to prompt_length={prompt_length}")
        ids[i, prompt_length - len(tokens):] = tokens
        mask[i, prompt_length - len(tokens):] = True
        lengths[i] = len(tokens)
    return {"prompts": ids, "prompt_mask": mask, "lengths": lengths}


def prompt_rows(prompts: Sequence[str], tokenizer: Tokenizer, length: int,
                path: str) -> np.ndarray:
    """int32[N, length]: each prompt's last `length` tokens, as DeepSpeed-Chat's prompt dataset
    keeps them (`zeroxla ppo`'s rollouts). The models take no attention mask, so a shorter
    prompt cannot be left-padded without changing what the actor sees: a ChatDataError names
    it (its number in `path`) and --max-prompt-seq-len."""
    rows = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(tokenizer.encode(prompt), np.int32)
        if len(ids) < length:
            raise ChatDataError(
                f"{path}: prompt {i + 1} ({prompt[:30]!r}...) is {len(ids)} tokens, fewer than "
                f"--max-prompt-seq-len {length}; our models take no attention mask, so prompts "
                "are not left-padded: lower --max-prompt-seq-len or lengthen the prompt")
        rows.append(ids[-length:])
    return np.stack(rows)


# ----------------------------------------------------------------------------- writing files

def _record(example: SFTExample | PairExample | str) -> dict[str, str]:
    if isinstance(example, str):
        return {"prompt": example}
    if isinstance(example, SFTExample):
        return {"prompt": example.prompt, "response": example.response}
    if isinstance(example, PairExample):
        return {"prompt": example.prompt, "chosen": example.chosen, "rejected": example.rejected}
    raise TypeError(f"write_jsonl: {type(example).__name__} is not SFTExample, PairExample or "
                    "str (a prompt)")


def write_jsonl(examples: Sequence[SFTExample | PairExample | str],
                path: str | os.PathLike) -> Path:
    """Writes `examples` (SFT examples, pairs, or prompt strings) as JSON lines that the matching
    reader reads back; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(_record(e), ensure_ascii=False) + "\n" for e in examples]
    path.write_text("".join(lines), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- generated examples

# Generated examples are short, so tiny models and short sequences fit them: prompt + response is
# at most 60 characters, which the tests' 512-token byte-level BPE (zeroxla/app/tiny_checkpoints)
# encodes in at most 47 tokens, 48 with eos (538 distinct examples).
MAX_EXAMPLE_CHARS = 60
_WORD = re.compile(r"[A-Za-z]+")


@functools.lru_cache(maxsize=1)
def _dialogue() -> tuple[tuple[str, str], ...]:
    """(prompt, answer) for every two consecutive speeches of tiny-shakespeare that are short
    enough: the prompt is the first speaker's name and last line and the next speaker's name,
    the answer the next speech's first line, which has a word of two different letters (so that
    `_scramble` changes it)."""
    speeches = []
    for block in load_text().split("\n\n"):
        head, *lines = block.strip().split("\n")
        if head.endswith(":") and lines:
            speeches.append((head[:-1], lines))
    out = []
    for (speaker, lines), (next_speaker, next_lines) in zip(speeches, speeches[1:]):
        prompt = f"{speaker}:\n{lines[-1]}\n\n{next_speaker}:\n"
        answer = next_lines[0]
        if (len(prompt) + len(answer) <= MAX_EXAMPLE_CHARS
                and any(len(set(w)) > 1 for w in _WORD.findall(answer))):
            out.append((prompt, answer))
    return tuple(out)


def _pick(n: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """`n` (prompt, answer) pairs drawn by `rng` (distinct while n <= the candidates)."""
    if n < 0:
        raise ValueError(f"n={n} is invalid; accepted: an integer >= 0")
    table = _dialogue()
    rows = rng.choice(len(table), size=n, replace=n > len(table))
    return [table[r] for r in rows]


def shakespeare_sft(n: int, seed: int = 0) -> list[SFTExample]:
    """`n` SFT examples from tiny-shakespeare, a pure function of `seed`: the prompt is a
    speaker's line followed by the next speaker's name, the response that speaker's first line
    (prompt + response <= MAX_EXAMPLE_CHARS characters), e.g.

        prompt   "MENENIUS:\nThe city is well stored.\n\nMARCIUS:\n"
        response "Hang 'em! They say!"
    """
    return [SFTExample(p, a) for p, a in _pick(n, np.random.default_rng(seed))]


def shakespeare_prompts(n: int, seed: int = 0) -> list[str]:
    """The prompts of `shakespeare_sft(n, seed)`: PPO prompts in the SFT format."""
    return [example.prompt for example in shakespeare_sft(n, seed)]


def _scramble(text: str, rng: np.random.Generator) -> str:
    """`text` with each word's letters shuffled in place (spaces and punctuation kept): the
    same characters and length, so neither is a cue for the reward model. Never returns `text`
    when a word has two different letters (then the first such word is rotated by one)."""
    out = _WORD.sub(lambda m: "".join(rng.permutation(list(m.group()))), text)
    if out != text:
        return out
    for m in _WORD.finditer(text):
        if len(set(m.group())) > 1:
            word = m.group()
            return text[:m.start()] + word[1:] + word[0] + text[m.end():]
    return out


def shakespeare_pairs(n: int, seed: int = 0) -> list[PairExample]:
    """`n` preference pairs, a pure function of `seed`: the prompt and the true continuation
    (chosen) of `shakespeare_sft`'s kind, and a corrupted one (rejected: each word's letters
    shuffled, `_scramble`), which differs from chosen and has its length in characters (a BPE
    encodes scrambled words in more tokens: up to 52 with eos under the tests' tokenizer)."""
    rng = np.random.default_rng(seed)
    return [PairExample(p, a, _scramble(a, rng)) for p, a in _pick(n, rng)]


__all__ = ["ChatDataError", "MAX_EXAMPLE_CHARS", "PairExample", "SFTExample", "check_learnable",
           "pair_arrays", "pairs_without_preference", "prompt_arrays", "prompt_rows",
           "read_pair_jsonl", "read_prompt_jsonl", "read_sft_jsonl", "rows_without_loss",
           "shakespeare_pairs", "shakespeare_prompts", "shakespeare_sft", "sft_arrays",
           "write_jsonl"]
