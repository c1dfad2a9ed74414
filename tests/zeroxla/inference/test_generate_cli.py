"""`zeroxla generate CHECKPOINT --prompt TEXT`: a `zeroxla train` checkpoint continued by the
Hybrid Engine; greedy output equals the restored model's own greedy decoding (full forward per
token, no cache)."""

import pytest

from inference_helpers import greedy_reference
from zeroxla.app import cli


@pytest.mark.slow
def test_generate_continues_a_trained_checkpoint(tmp_path, capsys):
    import numpy as np

    import zeroxla
    from zeroxla.app.jobs.train import job as train_job
    from zeroxla.app.jobs.train.resolve import resolve_job
    from zeroxla.app.tokenizers.records import tokenizer_from_record
    from zeroxla.checkpoint.export import checkpoint_metadata

    job = resolve_job(dict(steps=2, batch_size=8, seq_len=32, eval_batches=1,
                           sample_tokens=0, progress=False, out_dir=str(tmp_path / "run")))
    train_job.run(job, write=lambda line: None)
    checkpoint = f"{job.run.out_dir}/checkpoint"
    assert cli.main(["generate", checkpoint, "--prompt", "ROMEO:", "--max-new-tokens", "12",
                     "--temperature", "0", "--tp", "2"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")

    tokenizer = tokenizer_from_record(checkpoint_metadata(checkpoint)["metadata"]["tokenizer"])
    model = zeroxla.load_params(checkpoint)                 # the unsharded trained model
    prompt = np.asarray(tokenizer.encode("ROMEO:"), np.int32)
    expected = greedy_reference(model, [prompt], 12)[0]
    assert printed == tokenizer.decode(expected)
    assert printed.startswith("ROMEO:") and len(expected) == prompt.size + 12

    assert cli.main(["generate", checkpoint, "--prompt", "A", "--max-new-tokens", "500"]) == 2
    assert "max_seq_len" in capsys.readouterr().err
