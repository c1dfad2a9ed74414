"""`messages` data: the checkpoint's chat template rendered without transformers, and the SFT loss
mask on the assistant's tokens.

References: transformers' `apply_chat_template` (the text, the ids, and, for a template with
`{% generation %}` blocks, `return_assistant_tokens_mask`'s mask); for a template without them,
an independent search of each assistant turn in the rendered text, mapped to tokens by
transformers' `char_to_token`. Then the rows the jobs read: `{"messages"}` SFT rows and TRL's
conversational preference rows, and every malformed row refused naming its line and field.
"""

import json

import numpy as np
import pytest

from chat_checkpoints import CHATML_GENERATION, CHATML_PLAIN, write_chat_tokenizer
from weightless import weightless_gpt2
from zeroxla.app import chat_data, cli
from zeroxla.app.chat_messages import ChatExample, ChatPairExample
from zeroxla.app.chat_template import ChatTemplate, ChatTemplateError
from zeroxla.app.data import ChatDataError
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.app.tokenizers.records import tokenizer_from_record

MESSAGES = [{"role": "system", "content": "Answer in verse."},
            {"role": "user", "content": "Who's there?"},
            {"role": "assistant", "content": "Nay, answer me: stand, and unfold yourself."},
            {"role": "user", "content": "Long live the king!"},
            {"role": "assistant", "content": "Bernardo? He."}]


def tokenizer(tmp_path, template, **kwargs):
    return PretrainedTokenizer.from_dir(write_chat_tokenizer(tmp_path / "tok", template, **kwargs))


def hf_rendering(tmp_path, messages, assistant_mask=False):
    """transformers' (tokenizer, text, encoding) of `messages` with the tokenizer in
    tmp_path/tok (the encoding with "assistant_masks" when `assistant_mask`)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = hf.apply_chat_template(messages, tokenize=False)
    out = hf.apply_chat_template(messages, return_dict=True,
                                 return_assistant_tokens_mask=assistant_mask)
    return hf, text, out


@pytest.mark.parametrize("template_file", [False, True])
def test_generation_blocks_give_transformers_assistant_mask(tmp_path, template_file):
    template = ChatTemplate.of(tokenizer(tmp_path, CHATML_GENERATION,
                                         template_file=template_file))
    assert template.has_generation_blocks
    hf, text, out = hf_rendering(tmp_path, MESSAGES, assistant_mask=True)
    ids, mask = template.tokens_of(MESSAGES)
    assert template.render(MESSAGES) == text
    np.testing.assert_array_equal(ids, out["input_ids"])
    np.testing.assert_array_equal(mask, np.asarray(out["assistant_masks"], bool))
    assert 0 < mask.sum() < mask.size
    assert hf.decode(ids[mask]) == ("Nay, answer me: stand, and unfold yourself.<|im_end|>"
                                    "Bernardo? He.<|im_end|>")


def test_turns_without_generation_blocks_are_found_in_the_rendered_text(tmp_path):
    template = ChatTemplate.of(tokenizer(tmp_path, CHATML_PLAIN))
    assert not template.has_generation_blocks
    hf, text, out = hf_rendering(tmp_path, MESSAGES[1:])           # the default system turn
    ids, mask = template.tokens_of(MESSAGES[1:])
    assert template.render(MESSAGES[1:]) == text and text.startswith("<|endoftext|>")
    np.testing.assert_array_equal(ids, out["input_ids"])
    expected = np.zeros(len(ids), bool)
    start = 0
    for message in MESSAGES[1:]:
        if message["role"] == "assistant":      # the turn's text after its header, to its end
            turn = f"<|im_start|>assistant\n{message['content']}<|im_end|>\n"
            at = text.index(turn, start) + len("<|im_start|>assistant\n")
            start = at + len(turn) - len("<|im_start|>assistant\n")
            first, last = out.char_to_token(at), out.char_to_token(start - 1)
            expected[first:last + 1] = True
    np.testing.assert_array_equal(mask, expected)


def test_sft_rows_learn_the_assistant_tokens_only(tmp_path):
    tok = tokenizer(tmp_path, CHATML_GENERATION)
    ids, mask = ChatTemplate.of(tok).tokens_of(MESSAGES)
    example = ChatExample(tuple((m["role"], m["content"]) for m in MESSAGES))
    got = chat_data.sft_arrays([example], tok, 128, eos_id=tok.eos_id, pad_id=7)
    n = len(ids) - 1
    np.testing.assert_array_equal(got["inputs"][0, :n], ids[:-1])
    np.testing.assert_array_equal(got["targets"][0, :n], ids[1:])
    np.testing.assert_array_equal(got["loss_mask"][0, :n], mask[1:].astype(np.float32))
    assert np.all(got["loss_mask"][0, n:] == 0) and np.all(got["inputs"][0, n:] == 7)
    with pytest.raises(ChatDataError, match=r"example 0: the conversation renders to "
                       f"{len(ids)} tokens but seq_len=16"):
        chat_data.sft_arrays([example], tok, 16)


def test_conversational_pairs_render_prompt_and_answer(tmp_path):
    tok = tokenizer(tmp_path, CHATML_GENERATION)
    template = ChatTemplate.of(tok)
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": MESSAGES[:2], "chosen": [MESSAGES[2]],
             "rejected": [{"role": "assistant", "content": "Go away."}]},
            {"chosen": MESSAGES[:3], "rejected": MESSAGES[:2] + [
                {"role": "assistant", "content": "Go away."}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = chat_data.read_pair_jsonl(path)
    assert all(isinstance(p, ChatPairExample) for p in pairs) and pairs[1].prompt == ()
    got = chat_data.pair_arrays(pairs, tok, 128, eos_id=tok.eos_id)
    for key, messages in (("chosen", MESSAGES[:3]), ("rejected", MESSAGES[:2] + [
            {"role": "assistant", "content": "Go away."}])):
        ids, _ = template.tokens_of(messages)
        for row in range(2):           # explicit and implicit prompt: the same conversation
            np.testing.assert_array_equal(got[key][row, :len(ids)], ids)
            assert got[f"{key}_end"][row] == len(ids) - 1


def write_rows(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row,message", [
    ({"messages": MESSAGES, "prompt": "x"}, r"x.jsonl:2: a row holds both 'messages' and 'prompt'"),
    ({"messages": [{"role": "tool", "content": "x"}]},
     r"x.jsonl:2: messages\[0\].role='tool' is not accepted; accepted: system, user, assistant"),
    ({"messages": MESSAGES[:2]}, r"x.jsonl:2: field 'messages' holds no assistant message"),
    ({"messages": [{"role": "user", "content": 3}]}, r"x.jsonl:2: messages\[0\].content is a"),
    ({"messages": "hi"}, r"x.jsonl:2: field 'messages' is a JSON str")])
def test_bad_sft_rows_name_the_line_and_field(tmp_path, row, message):
    path = write_rows(tmp_path / "x.jsonl", {"messages": MESSAGES}, row)
    with pytest.raises(ChatDataError, match=message):
        chat_data.read_sft_jsonl(path)


@pytest.mark.parametrize("row,message", [
    ({"prompt": MESSAGES[:2], "chosen": [MESSAGES[2]], "rejected": "no"},
     r"p.jsonl:1: field 'rejected' is a JSON str"),
    ({"prompt": MESSAGES[:2], "chosen": MESSAGES[:3], "rejected": [MESSAGES[2]]},
     r"p.jsonl:1: field 'chosen' holds a non-assistant message after an explicit 'prompt'"),
    ({"chosen": MESSAGES[:2], "rejected": MESSAGES[:3]},
     r"p.jsonl:1: field 'chosen' ends with a user message"),
    ({"messages": MESSAGES, "chosen": [MESSAGES[2]], "rejected": [MESSAGES[2]]},
     r"p.jsonl:1: field 'messages' in a preference row")])
def test_bad_preference_rows_name_the_line_and_field(tmp_path, row, message):
    with pytest.raises(ChatDataError, match=message):
        chat_data.read_pair_jsonl(write_rows(tmp_path / "p.jsonl", row))


def test_a_tokenizer_without_a_chat_template_is_refused_by_name(tmp_path):
    example = ChatExample((("user", "a"), ("assistant", "b")))
    for tok in (tokenizer(tmp_path, None), CharTokenizer("ab")):
        with pytest.raises(ChatTemplateError, match="has no chat_template"):
            chat_data.sft_arrays([example], tok, 32)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    last_only = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                 "{% if not loop.last %} (earlier){% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
    template = ChatTemplate.of(tokenizer(tmp_path, last_only))
    with pytest.raises(ChatTemplateError, match=r"renders message 1 \(assistant\) differently"):
        template.tokens_of(MESSAGES[1:])
    example = ChatExample(tuple((m["role"], m["content"]) for m in MESSAGES[1:]), "d.jsonl", 3)
    with pytest.raises(ChatDataError, match=r"d.jsonl:3: the chat template .* "
                       "renders message 1"):
        chat_data.sft_arrays([example], template.tokenizer, 128)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ raise_exception('Conversation roles must alternate') }}"}))
    refusing = ChatTemplate.of(PretrainedTokenizer.from_dir(tmp_path / "tok"))
    with pytest.raises(ChatTemplateError, match="refused the conversation: Conversation roles"):
        refusing.tokens_of(MESSAGES)


@pytest.mark.parametrize("template, template_file, where, message", [
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", False,
     'tokenizer_config.json ("chat_template", line 2 of the template)',
     "the chat template does not parse: unexpected '}'"),
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", True, "chat_template.jinja:2",
     "the chat template does not parse: unexpected '}'"),
    ("{% for m in messages %}\n{{ m.content }}\n{{ m.role | shout }}\n{% endfor %}", True,
     "chat_template.jinja:3", "the chat template does not parse: No filter named 'shout'"),
    ("{% for m in messages %}\n{{ m.content + 1 }}\n{% endfor %}", False,
     'tokenizer_config.json ("chat_template", line 2 of the template)',
     "the chat template failed while rendering the conversation: TypeError: can only "
     'concatenate str (not "int") to str'),
], ids=["syntax-config", "syntax-jinja", "unknown-filter", "type-error"])
def test_a_broken_template_is_refused_naming_its_file_and_line(tmp_path, capsys, template,
                                                               template_file, where, message):
    """`zeroxla train` on `messages` rows with a checkpoint whose template does not parse or
    fails while rendering: exit 2, one line naming the file the template came from and the
    template's line, no run directory (the refusal comes before the weights are read)."""
    base = weightless_gpt2(tmp_path / "base")
    write_chat_tokenizer(base, template, template_file=template_file)
    data = write_rows(tmp_path / "d.jsonl", *[{"messages": MESSAGES}] * 20)
    out = tmp_path / "run"
    assert cli.main(["train", "--init-from", str(base), "--data", str(data), "--out", str(out),
                     "--steps", "1", "--batch-size", "8", "--seq-len", "128",
                     "--no-progress"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert f"{base}/{where}: {message}" in err, err
    assert err.startswith("zeroxla train: error: ") and "Traceback" not in err


def test_the_template_travels_with_the_tokenizer_record_and_export(tmp_path):
    tok = tokenizer(tmp_path, CHATML_GENERATION, template_file=True)
    again = tokenizer_from_record(tok.record())
    assert ChatTemplate.of(again).template == CHATML_GENERATION
    written = {p.name for p in again.save(tmp_path / "export")}
    assert "chat_template.jinja" in written
    listed = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    listed["chat_template"] = [{"name": "tool_use", "template": "x"},
                               {"name": "default", "template": CHATML_PLAIN}]
    (tmp_path / "tok" / "chat_template.jinja").unlink()
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(listed))
    assert ChatTemplate.of(PretrainedTokenizer.from_dir(tmp_path / "tok")).template == CHATML_PLAIN


# Whitespace control, `namespace`, `tojson`, attribute access, `loop` and `raise_exception`:
# what real templates (Llama 3.x, Qwen2.5) use, in a template of our own.
RICH = """{%- set ns = namespace(system='Default.', turns=0) %}
{%- if messages[0].role == 'system' %}{%- set ns.system = messages[0].content | trim %}{%- endif %}
{{- bos_token }}<<SYS>>{{ ns.system | tojson }}<</SYS>>
{%- for message in messages if message.role != 'system' %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('roles must alternate user/assistant') }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '\\n[' ~ ns.turns ~ '] ' ~ message.role | upper ~ ': ' ~ message.content | trim }}
    {%- if message.role == 'assistant' %}{{ eos_token }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '\\n[' ~ (ns.turns + 1) ~ '] ASSISTANT: ' }}{% endif %}"""


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_rendering_equals_transformers_on_a_template_with_jinja_features(
        tmp_path, add_generation_prompt):
    template = ChatTemplate.of(tokenizer(tmp_path, RICH))
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    for messages in (MESSAGES, MESSAGES[1:3], [{"role": "user", "content": ' "q" <b> '}]):
        want = hf.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
        assert template.render(messages, add_generation_prompt=add_generation_prompt) == want
    _, mask = template.tokens_of(MESSAGES)
    assert template.tokenizer.decode(template.tokens_of(MESSAGES)[0][mask]).endswith(
        "Bernardo? He.<|im_end|>")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(MESSAGES[2:])
