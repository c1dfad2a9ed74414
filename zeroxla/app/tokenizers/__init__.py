"""Tokenizers of the jobs: text to ids and back, and how a checkpoint records them.

    basic.py      character and UTF-8 byte tokenizers (`make_tokenizer`)
    pretrained.py a checkpoint's Hugging Face tokenizer files, and any of ours written as them
                  (`save_tokenizer`, for export)
    records.py    tokenizers as JSON records stored in checkpoints, and read back
"""
