"""What each command's `--init-from` (and `zeroxla ppo --reward`) takes, decided from config.json's
`architectures` before any tensor is read: `zeroxla train` a causal LM, `zeroxla reward` a causal
LM or a one-label sequence classifier, `--reward` a sequence classifier. Every refusal names the
architecture.

The directories hold config.json and the tokenizer but no weights at all, so a refusal that came
from reading tensors would be a missing-file error instead.
"""

import json
import re

import pytest

from zeroxla.app.jobs import loading
from zeroxla.app import chat_data, cli
from zeroxla.app.tiny_checkpoints import write_tokenizer
from zeroxla.models import hf

from zeroxla import models

GPT = models.GPTConfig(vocab_size=512, max_seq_len=128, d_model=64, num_heads=4, num_layers=2,
                       mlp_dim=256)


def weightless(directory, architecture, **fields):
    """A HF directory with config.json naming `architecture`, a tokenizer, and no weights."""
    write_tokenizer(directory)
    config = {**hf.to_hf_config(GPT), "architectures": [architecture], **fields}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("architecture,what", [
    ("GPT2ForSequenceClassification", r"a sequence-classification \(reward\) model"),
    ("GPT2ForTokenClassification", "a token-classification model"),
    ("GPT2ForQuestionAnswering", "a question-answering model"),
])
def test_train_init_from_refuses_other_heads_by_architecture(tmp_path, capsys, architecture,
                                                             what):
    directory = weightless(tmp_path / "hf", architecture)
    data = chat_data.write_jsonl(chat_data.shakespeare_sft(4, seed=0), tmp_path / "sft.jsonl")
    out = tmp_path / "run"
    assert cli.main(["train", "--init-from", str(directory), "--data", str(data), "--out",
                     str(out), "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (f"architectures=['{architecture}']: {architecture} is" in err and
            "`zeroxla train` needs a causal LM (GPT2LMHeadModel, Gemma2ForCausalLM, "
            "Gemma3ForCausalLM, Gemma4ForCausalLM, GptOssForCausalLM, LlamaForCausalLM, "
            "MistralForCausalLM, MixtralForCausalLM, OlmoeForCausalLM, Qwen2ForCausalLM, "
            "Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, "
            "Qwen3_5MoeForCausalLM); use "
            "`zeroxla reward --init-from` or `zeroxla ppo --reward`" in err), err
    assert what.replace("\\", "") in err
    assert not out.exists()


def test_reward_init_from_takes_lms_and_one_label_classifiers_only(tmp_path, capsys):
    data = chat_data.write_jsonl(chat_data.shakespeare_pairs(8, seed=1), tmp_path / "p.jsonl")
    tokens = weightless(tmp_path / "tok", "GPT2ForTokenClassification")
    two = weightless(tmp_path / "two", "GPT2ForSequenceClassification",
                     id2label={"0": "bad", "1": "good"})
    for directory, message in (
            (tokens, "GPT2ForTokenClassification is a token-classification model; `zeroxla "
                     "reward` needs a causal LM (GPT2LMHeadModel, Gemma2ForCausalLM, "
                     "Gemma3ForCausalLM, Gemma4ForCausalLM, GptOssForCausalLM, "
                     "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, "
                     "OlmoeForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, "
                     "Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, "
                     "Qwen3_5MoeForCausalLM) or a sequence-classification (reward) model "
                     "(GPT2ForSequenceClassification, Gemma2ForSequenceClassification, "
                     "GptOssForSequenceClassification, "
                     "LlamaForSequenceClassification, MistralForSequenceClassification, "
                     "MixtralForSequenceClassification, "
                     "Qwen2ForSequenceClassification, Qwen2MoeForSequenceClassification, "
                     "Qwen3ForSequenceClassification, Qwen3MoeForSequenceClassification)"),
            (two, "num_labels=2")):
        out = tmp_path / f"rm-{directory.name}"
        assert cli.main(["reward", "--init-from", str(directory), "--data", str(data), "--out",
                         str(out), "--no-progress"]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()


def test_ppo_reward_takes_a_sequence_classifier_only(tmp_path):
    for architecture, what in (("GPT2LMHeadModel", "is a causal LM; a reward model needs a "
                                                   "sequence-classification (reward) model"),
                               ("GPT2ForTokenClassification", "is a token-classification")):
        directory = weightless(tmp_path / architecture, architecture)
        with pytest.raises(ValueError, match=re.escape(f"{architecture} {what}")):
            loading.load_reward_model(directory)
