"""Chat tokenizers and padded-vocabulary checkpoints for the `messages` data and padded-vocabulary
tests, written offline.

    write_chat_tokenizer(dir, template=CHATML_GENERATION)   # 300 ids, ChatML special tokens
    padded_gpt2_checkpoint(dir, vocab_size=1024)            # a GPT-2 of 1024 rows, that tokenizer

The tokenizer: a ByteLevel BPE of TOKENIZER_SIZE - 3 tokens trained on the bundled corpus, plus
`<|endoftext|>` (bos, eos), `<|im_start|>` and `<|im_end|>` as special tokens: TOKENIZER_SIZE ids.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from zeroxla.app.data import load_text

TOKENIZER_SIZE = 300
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML whose assistant turns are `{% generation %}` blocks (what TRL's training templates do).
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Qwen2.5's shape, no generation blocks: a default system turn, and the bos token first.
CHATML_PLAIN = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE - len(SPECIAL_TOKENS),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([load_text()[:100_000]], trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size(with_added_tokens=True) == TOKENIZER_SIZE
    return tok.to_str()


def write_chat_tokenizer(out_dir: str | Path, template: str | None = CHATML_GENERATION, *,
                         template_file: bool = False, eos_token: str = "<|im_end|>") -> Path:
    """tokenizer.json and tokenizer_config.json in `out_dir` (the template inline, or in
    chat_template.jinja with `template_file`; none when `template` is None)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128,
              "eos_token": eos_token, "bos_token": "<|endoftext|>",
              "clean_up_tokenization_spaces": False}
    if template is not None and template_file:
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template is not None:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                   encoding="utf-8")
    return out_dir


def padded_gpt2_checkpoint(out_dir: str | Path, *, vocab_size: int = 1024,
                           template: str | None = CHATML_GENERATION) -> Path:
    """A random GPT2LMHeadModel (n_embd 64, 2 layers, 4 heads, 128 positions) with `vocab_size`
    embedding rows and the TOKENIZER_SIZE-id chat tokenizer: a padded vocabulary. The padded
    rows are drawn as the others (std 0.1), so an unmasked sampler would pick them often."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_scale = p.ndim == 1 and name.endswith("weight")
            p.copy_(0.1 * torch.randn_like(p) + (1.0 if norm_scale else 0.0))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    write_chat_tokenizer(out_dir, template)
    return out_dir
