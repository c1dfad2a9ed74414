"""The training application: `zeroxla train` and its data, tokenizers and sampling.

Nothing in the library imports this package; `import zeroxla` does not load it.

    cli.py        the `zeroxla` command
    train.py      the training job (TrainJobConfig, run)
    data.py       corpora and per-device batches
    tokenizer.py  character and byte tokenizers
    sampling.py   text sampling from a trained model
"""
